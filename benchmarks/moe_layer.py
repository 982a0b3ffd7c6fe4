"""One loom_1p7b-shaped MoE layer, forward + backward: the plain compositions ("before": the
SwiGLU as chunk / silu / mul, the combine as a gate multiply + index_add_, exactly LoomMoE's math
before models/loom/swiglu.py) against `LoomMoE.forward` ("after": the fused SwiGLU and combine),
side by side in one run, on the same module, weights and tokens.

    OMP_NUM_THREADS=1 python benchmarks/moe_layer.py --table by_op       # bytes per aten op, fp32 eager
    OMP_NUM_THREADS=1 python benchmarks/moe_layer.py --table compiled --rounds 5
    OMP_NUM_THREADS=1 python benchmarks/moe_layer.py --table precision --tokens 4096 --precision autocast

Tables (all three by default):
- by_op: per aten op, calls, bytes of its outputs in new storage (allocated) and bytes it writes
  (in-place and out= targets included), eager fp32; then the totals outside and inside the GEMMs.
- compiled: the median fwd+bwd time of both variants under torch.compile (fullgraph, inductor,
  fp32), alternating, after one compiling call each.
- precision: bytes allocated during one forward + backward (sum of the profiler's allocation
  events), peak live bytes above the start of the call (the same events in time order), and the
  median time of the rounds, alternating, in three precisions: `fsdp_bf16` (weights and tokens
  bf16, as FSDP's MixedPrecisionPolicy hands them to a block; routers fp32), `autocast` (fp32
  weights and tokens under bf16 autocast: one process) and `float32`; with max |after - before|
  of the output and of every gradient, relative to the largest entry.
The layer is loom_1p7b's (D = 1280, 30 routed experts of width 768, top-6, 2 shared, capacity
factor 1.5) at a reduced token count.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan_loom.models.loom import loom_flavors
from torchtitan_loom.models.loom.moe import (
    LoomMoE,
    capacity_plan,
    expert_capacity,
    expert_dtype,
    gemm_path,
    route,
)


def plain_swiglu(h_M2I: torch.Tensor) -> torch.Tensor:
    """The activation as it was: chunk, silu, mul (autograd saves silu(gate) and up)."""
    gate_MI, up_MI = h_M2I.chunk(2, dim=-1)
    return F.silu(gate_MI) * up_MI


def plain_experts(moe: LoomMoE, x_AD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """run_experts with the plain activation, on the GEMM path run_experts would take."""
    w13, w2 = moe.experts.w13, moe.experts.w2
    dtype = expert_dtype(x_AD.device.type, w13.dtype)
    x_AD, w13, w2 = x_AD.to(dtype), w13.to(dtype), w2.to(dtype)
    path, _ = gemm_path(
        x_AD.device.type, dtype, torch.compiler.is_compiling(), w2.shape[1], w2.shape[2]
    )
    if path == "grouped":
        offsets_E = torch.cumsum(counts_E, 0).to(torch.int32)
        h_A2I = torch._grouped_mm(x_AD, w13.transpose(-2, -1), offs=offsets_E)
        return torch._grouped_mm(plain_swiglu(h_A2I), w2.transpose(-2, -1), offs=offsets_E)
    chunks = x_AD.split(counts_E.tolist())
    return torch.cat([plain_swiglu(c @ w13[e].t()) @ w2[e].t() for e, c in enumerate(chunks)])


def before_forward(moe: LoomMoE, x_BSD: torch.Tensor, router_w_ED: torch.Tensor) -> torch.Tensor:
    """LoomMoE.forward's math as plain compositions (the SwiGLU's chunk/silu/mul, the combine's
    gate multiply and index_add_): the reference the fused functions are measured against."""
    B, S, D = x_BSD.shape
    N, K = B * S, moe.top_k
    x_ND = x_BSD.reshape(N, D)
    _, expert_NK, gate_NK = route(x_ND, router_w_ED, moe.expert_bias, K)
    capacity = expert_capacity(N, K, moe.num_experts, moe.capacity_factor)
    order_A, counts_E, _, gate_NK = capacity_plan(expert_NK, gate_NK, moe.num_experts, capacity)
    x_cast_ND = x_ND.to(moe.experts.input_dtype(x_ND))
    gate_A, token_A = gate_NK.reshape(-1)[order_A], order_A // K
    out_AD = plain_experts(moe, x_cast_ND[token_A], counts_E)
    weighted_AD = out_AD * gate_A.unsqueeze(-1)
    y_ND = weighted_AD.new_zeros(N, D).index_add_(0, token_A, weighted_AD)
    for shared in moe.shared_experts:
        y_ND = y_ND + shared.w2(plain_swiglu(shared.w13(x_ND)))
    return y_ND.view(B, S, D)


def after_forward(moe: LoomMoE, x_BSD: torch.Tensor, router_w_ED: torch.Tensor) -> torch.Tensor:
    return moe(x_BSD, router_w_ED)[0]


VARIANTS = {"before": before_forward, "after": after_forward}


PRECISIONS = ("fsdp_bf16", "autocast", "float32")


def build(tokens: int, precision: str, seed: int = 0) -> tuple[LoomMoE, torch.Tensor, torch.Tensor]:
    args = loom_flavors["loom_1p7b"]
    torch.manual_seed(seed)
    moe = LoomMoE(args)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.02)
    dtype = torch.bfloat16 if precision == "fsdp_bf16" else torch.float32
    moe.to(dtype)
    router_w = (
        moe.routers[0].detach().float().requires_grad_(True)
    )  # routers stay fp32 (replicated)
    x = torch.randn(1, tokens, args.dim, dtype=dtype)
    return moe, x, router_w


def fwd_bwd(
    fn, moe, x, router_w, grad_y, precision: str
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    moe.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    router_w.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
        y = fn(moe, x, router_w)
    y.backward(grad_y.to(y.dtype))
    return y.detach(), [x.grad, router_w.grad] + [p.grad for p in moe.parameters()]


def allocation_profile(fn, moe, x, router_w, grad_y, precision: str) -> tuple[int, int]:
    """(bytes allocated, peak live bytes above the start) over one forward + backward."""
    moe.zero_grad(set_to_none=True)  # freed before, so the profile sees only this call's tensors
    router_w.grad = None
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fwd_bwd(fn, moe, x, router_w, grad_y, precision)
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    )
    allocated = sum(n for _, n in events if n > 0)
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return allocated, peak


GEMMS = frozenset({"mm", "addmm", "bmm", "_grouped_mm"})
ALLOCATE_ONLY = frozenset({"empty", "empty_like", "new_empty", "empty_strided"})


class OpWrites(TorchDispatchMode):
    """Per aten op: calls, bytes of its outputs in new storage ("allocated") and bytes it writes
    ("written": new outputs, plus in-place and out= targets; views and bare allocations write
    nothing). Sees the forward and, the CPU backward running on the calling thread, the backward."""

    def __init__(self):
        super().__init__()
        self.by_op: dict[str, list[int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        mutates = any(
            a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments
        )
        name = func.overloadpacket.__name__
        entry = self.by_op.setdefault(name, [0, 0, 0])
        entry[0] += 1
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            nbytes = t.numel() * t.element_size()
            if t.untyped_storage().data_ptr() not in inputs:
                entry[1] += nbytes
                entry[2] += 0 if name in ALLOCATE_ONLY else nbytes
            elif mutates:
                entry[2] += nbytes
        return out


def op_writes(fn, moe, x, router_w, grad_y) -> dict[str, list[int]]:
    """OpWrites over one eager fp32 forward + backward of `fn`."""
    moe.zero_grad(set_to_none=True)
    router_w.grad = None
    with OpWrites() as counter:
        fwd_bwd(fn, moe, x, router_w, grad_y, "float32")
    return counter.by_op


def print_by_op(tokens: int) -> None:
    """The by-op table of both variants (fp32, eager), and the totals outside and inside the GEMMs."""
    moe, x, router_w = build(tokens, "float32")
    grad_y = torch.randn_like(x)
    tables = {name: op_writes(fn, moe, x, router_w, grad_y) for name, fn in VARIANTS.items()}
    mib = 2**20
    print(
        "\n| op | before calls | before allocated (MiB) | before written (MiB) | after calls | after allocated (MiB) | after written (MiB) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    ops = sorted(
        set().union(*tables.values()),
        key=lambda op: -max(t.get(op, [0, 0, 0])[1] for t in tables.values()),
    )
    for op in ops:
        cells = []
        for name in VARIANTS:
            calls, allocated, written = tables[name].get(op, [0, 0, 0])
            cells += [str(calls), f"{allocated / mib:,.1f}", f"{written / mib:,.1f}"]
        if any(float(c.replace(",", "")) >= 0.05 for c in cells[1:3] + cells[4:6]):
            print(f"| `{op}` | " + " | ".join(cells) + " |")
    for label, inside in (("outside the GEMMs", False), ("GEMMs", True)):
        cells = []
        for name in VARIANTS:
            rows = [v for op, v in tables[name].items() if (op in GEMMS) == inside]
            cells += [
                str(sum(r[0] for r in rows)),
                f"{sum(r[1] for r in rows) / mib:,.1f}",
                f"{sum(r[2] for r in rows) / mib:,.1f}",
            ]
        print(f"| **{label}** | " + " | ".join(cells) + " |", flush=True)


def compiled_times(tokens: int, rounds: int) -> dict[str, float]:
    """Median fwd+bwd seconds of each variant under torch.compile (fp32, as the trainer compiles a
    block: fullgraph), alternating, after one warm-up (compile) call each."""
    moe, x, router_w = build(tokens, "float32")
    grad_y = torch.randn_like(x)
    compiled = {name: torch.compile(fn, fullgraph=True) for name, fn in VARIANTS.items()}
    for fn in compiled.values():
        fwd_bwd(fn, moe, x, router_w, grad_y, "float32")
    times = {name: [] for name in compiled}
    for _ in range(rounds):
        for name, fn in compiled.items():
            start = time.perf_counter()
            fwd_bwd(fn, moe, x, router_w, grad_y, "float32")
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(v) for name, v in times.items()}


def measure(tokens: int, precision: str, rounds: int) -> dict:
    moe, x, router_w = build(tokens, precision)
    grad_y = torch.randn_like(x)
    results = {
        name: fwd_bwd(fn, moe, x, router_w, grad_y, precision) for name, fn in VARIANTS.items()
    }  # warm-up
    (y0, g0), (y1, g1) = results["before"], results["after"]
    rel = [
        ((b.float() - a.float()).abs().max() / a.float().abs().max()).item()
        for a, b in zip([y0, *g0], [y1, *g1])
        if a is not None
    ]  # the module's own routers get no gradient (router_w stands in)
    memory = {
        name: allocation_profile(fn, moe, x, router_w, grad_y, precision)
        for name, fn in VARIANTS.items()
    }
    times = {name: [] for name in VARIANTS}
    for _ in range(rounds):
        for name, fn in VARIANTS.items():
            start = time.perf_counter()
            fwd_bwd(fn, moe, x, router_w, grad_y, precision)
            times[name].append(time.perf_counter() - start)
    return {
        "memory": memory,
        "time": {k: statistics.median(v) for k, v in times.items()},
        "rel_out": rel[0],
        "rel_grad": max(rel[1:]),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tokens", type=int, default=2048, help="tokens N of the micro-batch (loom_1p7b: 8 × 1023)"
    )
    parser.add_argument("--precision", default="all", choices=("all", *PRECISIONS))
    parser.add_argument(
        "--rounds", type=int, default=3, help="timed forward + backward per variant, alternating"
    )
    parser.add_argument(
        "--table",
        default="all",
        choices=("all", "by_op", "precision", "compiled"),
        help="by_op: bytes per aten op, eager fp32; precision: bytes, peak and time per precision; "
        "compiled: fwd+bwd time under torch.compile (fp32)",
    )
    args = parser.parse_args(argv)
    a = loom_flavors["loom_1p7b"]
    print(
        f"loom_1p7b MoE layer: N = {args.tokens} tokens, A = N*K = {args.tokens * a.routed_top_k} assignments, "
        f"D = {a.dim}, E = {a.num_routed_experts}, K = {a.routed_top_k}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s)"
    )
    if args.table in ("all", "by_op"):
        print_by_op(args.tokens)
    if args.table in ("all", "compiled"):
        t = compiled_times(args.tokens, args.rounds)
        print(
            f"\ncompiled (fp32, fullgraph), fwd+bwd median of {args.rounds}, alternating: "
            f"before {t['before']:.3f} s, after {t['after']:.3f} s, after/before {t['after'] / t['before']:.3f}",
            flush=True,
        )
    if args.table not in ("all", "precision"):
        return 0
    print(
        "\n| precision | variant | bytes allocated (MiB) | peak live (MiB) | time fwd+bwd (s, median) | "
        "after/before bytes | max rel. diff output / grads |"
    )
    print("|---|---|---:|---:|---:|---:|---|")
    for precision in PRECISIONS if args.precision == "all" else (args.precision,):
        r = measure(args.tokens, precision, args.rounds)
        for name in VARIANTS:
            allocated, peak = r["memory"][name]
            ratio, diff = "", ""
            if name == "after":
                ratio = f"{allocated / r['memory']['before'][0]:.3f}"
                diff = f"{r['rel_out']:.1e} / {r['rel_grad']:.1e}"
            print(
                f"| {precision} | {name} | {allocated / 2**20:,.1f} | {peak / 2**20:,.1f} | {r['time'][name]:.3f} | "
                f"{ratio} | {diff} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
