"""One loom_1p7b-shaped MoE layer, forward + backward: the dispatch/combine as it was ("before":
rows gathered in fp32 then cast, outputs copied into an [N, K, D] buffer, weighted sum over K)
against `LoomMoE.forward` ("after": rows gathered in the experts' dtype, gate-weighted `index_add_`
into [N, D]), side by side in one run, alternating, on the same module, weights and tokens.

    OMP_NUM_THREADS=1 python benchmarks/moe_layer.py                      # 2048 tokens, every precision
    OMP_NUM_THREADS=1 python benchmarks/moe_layer.py --tokens 4096 --precision autocast --rounds 5

Per variant: bytes allocated during one forward + backward (sum of the profiler's allocation
events), peak live bytes above the start of the call (the same events in time order), and the
median time of the rounds. The layer is loom_1p7b's (D = 1280, 30 routed experts of width 768,
top-6, 2 shared, capacity factor 1.5) at a reduced token count, in three precisions: `fsdp_bf16`
(weights and tokens bf16, as FSDP's MixedPrecisionPolicy hands them to a block; routers fp32),
`autocast` (fp32 weights and tokens under bf16 autocast: one process) and `float32`. Also printed: max |after - before| of the output and of
every gradient, relative to the largest entry (the K terms of a token add up in another order).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan_loom.models.loom import loom_flavors  # noqa: E402
from torchtitan_loom.models.loom.moe import LoomMoE, capacity_plan, expert_capacity, route  # noqa: E402


def before_forward(moe: LoomMoE, x_BSD: torch.Tensor, router_w_ED: torch.Tensor) -> torch.Tensor:
    """The combine as it was: the reference the new one is measured against."""
    B, S, D = x_BSD.shape
    N, K = B * S, moe.top_k
    x_ND = x_BSD.reshape(N, D)
    _, expert_NK, gate_NK = route(x_ND, router_w_ED, moe.expert_bias, K)
    capacity = expert_capacity(N, K, moe.num_experts, moe.capacity_factor)
    order_A, counts_E, _, gate_NK = capacity_plan(expert_NK, gate_NK, moe.num_experts, capacity)
    out_AD = moe.experts(x_ND[order_A // K], counts_E)
    out_NKD = out_AD.new_empty(N * K, D).index_copy(0, order_A, out_AD).view(N, K, D)
    y_ND = (out_NKD * gate_NK.unsqueeze(-1)).sum(dim=1)
    for shared in moe.shared_experts:
        y_ND = y_ND + shared(x_ND)
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
    args = parser.parse_args(argv)
    a = loom_flavors["loom_1p7b"]
    print(
        f"loom_1p7b MoE layer: N = {args.tokens} tokens, A = N*K = {args.tokens * a.routed_top_k} assignments, "
        f"D = {a.dim}, E = {a.num_routed_experts}, K = {a.routed_top_k}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s)"
    )
    print(
        "| precision | variant | bytes allocated (MiB) | peak live (MiB) | time fwd+bwd (s, median) | "
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
