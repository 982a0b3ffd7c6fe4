"""Rank-side checks of test_expert_parallel.py, run in 4 gloo processes by one launch.

Every rank builds the same single-process reference (same seeds) and compares its own share of
the expert-parallel result with it. Failures raise, and the launcher shows the rank's traceback.

Legend: B batch rows, S sequence length, D model dim, E routed experts, W ep ranks.
"""

from __future__ import annotations

import copy
import datetime
import math
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard
from torch.overrides import TorchFunctionMode

from torchtitan_loom.components.quantization.grouped_gemm import grouped_kernel
from torchtitan_loom.models.loom import LoomTransformer, loom_flavors
from torchtitan_loom.models.loom.float8_experts import Float8GroupedExperts, convert_float8_experts
from torchtitan_loom.models.loom.infra.expert_parallel import (
    ExpertParallelExperts,
    apply_expert_parallel,
)
from torchtitan_loom.models.loom.moe import LoomMoE

# fp32 on CPU. Outputs and input grads: EP runs the same per-row math as one process (measured
# max error 0). Expert-weight grads: one process sums each source's rows in a separate backward,
# EP sums all rows of an expert in one matmul, so the sum is reassociated; the bound is relative
# to the gradient's largest entry (measured <= 2e-7 of it, ~2 fp32 ulps).
TOL = 1e-6
# Float8 expert-weight grads: MXFP8 quantises the weight-gradient GEMM's operands in blocks of 32
# rows of each expert's group, and EP's groups (every source's rows of an expert together) are not
# one process's (each source apart), so the blocks' scales differ; e4m3 keeps 3 mantissa bits
# (1/16 steps). Measured <= 4.3e-3 of the largest entry on 4 ranks; outputs and input grads stay
# within TOL (per-row quantisation, the same on both sides).
F8_WEIGHT_GRAD_TOL = 2e-2
# Experts nobody picks (bias -10 on sigmoid scores in (0, 1)): 2 and 3 make ep rank 1 of 4
# receive no rows at all, 6 leaves one expert of ep rank 3 empty.
UNPICKED = (2, 3, 6)


class _OneLayer(nn.Module):
    """Holds one LoomMoE so apply_expert_parallel (moe_layers()) and the float8 conversion
    (layers[i].moe) can find it."""

    def __init__(self, moe: LoomMoE):
        super().__init__()
        self.moe = moe
        self.layers = [self]  # a plain list: the layer is not registered twice

    def moe_layers(self):
        return iter([self.moe])


def _close(
    name: str, got: torch.Tensor, want: torch.Tensor, tol: float = TOL, relative: bool = False
) -> None:
    assert got.shape == want.shape, f"{name}: shapes {tuple(got.shape)} != {tuple(want.shape)}"
    if got.numel() == 0:
        return
    err = (got - want).abs().max().item()
    bound = tol * max(want.abs().max().item(), 1e-30) if relative else tol
    assert err <= bound, f"{name}: max abs error {err:.3g} > {bound:.3g}"


def _layer_inputs(rank: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(2, 12, D, generator=g), torch.randn(2, 12, D, generator=g)


def check_layer(ep_mesh, impl: str, capacity_factor: float = 1.0, float8: bool = False) -> None:
    """One EP MoE layer == the single-process LoomMoE: outputs, kept counts, input and weight grads.
    Capacity on: the kept assignments travel in fixed slots; off: every assignment, split sizes.
    `float8`: both run emulated MXFP8 experts (EP wraps them)."""
    args = loom_flavors["debug"].replace(
        dim=64,
        n_heads=1,
        expert_intermediate_size=32,
        moe_impl=impl,
        capacity_factor=capacity_factor,
    )
    ref = LoomMoE(args)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
        ref.expert_bias[list(UNPICKED)] = -10.0
    if float8:
        convert_float8_experts(_OneLayer(ref), grouped_kernel("mxfp8_emulated", 32, 32))
        assert isinstance(ref.experts, Float8GroupedExperts)
    ep_moe = copy.deepcopy(ref)
    apply_expert_parallel(_OneLayer(ep_moe), ep_mesh)
    assert isinstance(ep_moe.experts, ExpertParallelExperts)
    assert type(ep_moe.experts.local) is type(ref.experts)  # wrapped, not replaced

    W, me = ep_mesh.size(), ep_mesh.get_local_rank()
    group_ranks = dist.get_process_group_ranks(ep_mesh.get_group())
    router_w = ref.routers[0]

    # Reference: every rank of my ep group, one process, loss summed over them.
    ref_out, ref_kept, ref_xgrad = [], [], []
    for src in group_ranks:
        x, cot = _layer_inputs(src, args.dim)
        x.requires_grad_(True)
        out, kept, _ = ref(x, router_w)
        (out * cot).sum().backward()
        ref_out.append(out.detach()), ref_kept.append(kept), ref_xgrad.append(x.grad)
    all_kept = torch.stack(ref_kept)
    # The case must exercise dropping and experts without rows.
    if capacity_factor:
        assert (all_kept.sum(1) < 2 * 12 * args.routed_top_k).all(), "capacity dropped nothing"
    assert all_kept[:, list(UNPICKED)].sum() == 0

    x, cot = _layer_inputs(dist.get_rank(), args.dim)
    x.requires_grad_(True)
    out, kept, _ = ep_moe(x, ep_moe.routers[0])
    (out * cot).sum().backward()
    tag = f"{'float8' if float8 else impl} ep={W} capacity_factor={capacity_factor}"
    _close(f"{tag} output", out.detach(), ref_out[me])
    assert torch.equal(kept, ref_kept[me]), (
        f"{tag} kept counts {kept.tolist()} != {ref_kept[me].tolist()}"
    )
    _close(f"{tag} input grad", x.grad, ref_xgrad[me])
    L = args.num_routed_experts // W
    block = slice(me * L, (me + 1) * L)
    for name in ("w13", "w2"):
        param = getattr(ep_moe.experts, name)
        assert param.to_local().shape[0] == L
        want = getattr(ref.experts, name).grad[block]
        _close(
            f"{tag} {name} local grad",
            param.grad.to_local(),
            want,
            F8_WEIGHT_GRAD_TOL if float8 else TOL,
            relative=True,
        )


def check_host_syncs(ep_mesh) -> None:
    """Host copies of one EP MoE call: none with capacity on (fixed slots, grouped GEMM and loop
    alike); exactly one with capacity off (the split sizes; the loop reuses them)."""
    for capacity_factor, impl, want in (
        (1.5, "grouped", []),
        (1.5, "loop", []),
        (0.0, "loop", ["tolist"]),
    ):
        args = loom_flavors["debug"].replace(
            dim=64,
            n_heads=1,
            expert_intermediate_size=32,
            moe_impl=impl,
            capacity_factor=capacity_factor,
        )
        moe = LoomMoE(args)
        with torch.no_grad():
            for p in moe.parameters():
                p.normal_(0, 0.1)
        apply_expert_parallel(_OneLayer(moe), ep_mesh)
        x, _ = _layer_inputs(dist.get_rank(), args.dim)
        calls = []

        def counted(name, calls):
            original = getattr(torch.Tensor, name)

            def wrapper(self, *a, **k):
                calls.append(name)
                return original(self, *a, **k)

            return wrapper

        with (
            mock.patch.object(torch.Tensor, "tolist", counted("tolist", calls)),
            mock.patch.object(torch.Tensor, "item", counted("item", calls)),
        ):
            moe(x, moe.routers[0])[0].sum().backward()
        assert calls == want, (
            f"host copies in one EP MoE call (capacity_factor={capacity_factor}, {impl}): {calls}"
        )


class _GroupedMMDtypes(TorchFunctionMode):
    """Records the dtypes of the (rows, weights) of every torch._grouped_mm call."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "_grouped_mm":
            self.calls.append((args[0].dtype, args[1].dtype))
        return func(*args, **(kwargs or {}))


def _bf16_layer(ep_mesh, capacity_factor: float = 1.5) -> LoomMoE:
    args = loom_flavors["debug"].replace(
        dim=64, n_heads=1, expert_intermediate_size=32, capacity_factor=capacity_factor
    )
    moe = LoomMoE(args)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.1)
    apply_expert_parallel(_OneLayer(moe), ep_mesh)
    return moe


def check_bf16_experts(ep_mesh, dp_mesh) -> None:
    """bf16 reaches the EP experts: under autocast (no FSDP), and under FSDP's bf16 mixed precision
    on the experts (no autocast, fp32 rows in): grouped GEMMs on bf16 rows and weights only."""
    x, _ = _layer_inputs(dist.get_rank(), 64)
    moe = _bf16_layer(ep_mesh)
    with _GroupedMMDtypes() as mode, torch.autocast("cpu", dtype=torch.bfloat16):
        y, _, _ = moe(x, moe.routers[0])
    assert len(mode.calls) == 2 and set(mode.calls) == {(torch.bfloat16, torch.bfloat16)}, (
        mode.calls
    )

    moe = _bf16_layer(ep_mesh)
    mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    fully_shard(moe.experts, mesh=dp_mesh, mp_policy=mp, shard_placement_fn=lambda p: Shard(1))
    with _GroupedMMDtypes() as mode:
        moe(x, moe.routers[0])[0].sum().backward()
    assert len(mode.calls) == 2 and set(mode.calls) == {(torch.bfloat16, torch.bfloat16)}, (
        mode.calls
    )


def check_compile_breaks_at_dispatch(ep_mesh) -> None:
    """torch.compile of an EP MoE call (fullgraph off, as the trainer applies it with EP): with
    capacity off it breaks the graph only at the documented dispatch point, the host copy of the
    split sizes in _split_sizes (every break reason's innermost frame is _split_sizes; dynamo
    reports it once per frame it falls back through: 3 on torch 2.13 — LoomMoE.forward,
    ExpertParallelExperts.forward, _split_sizes — and 2 on 2.11); with capacity on (fixed slots)
    not at all. Under bf16 autocast (fp32 breaks at the same point; one dtype keeps this 4-rank
    launch short)."""
    for capacity_factor, want in ((0.0, {"_split_sizes"}), (1.5, set())):
        moe = _bf16_layer(ep_mesh, capacity_factor)
        x, _ = _layer_inputs(dist.get_rank(), 64)
        torch._dynamo.reset()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            explained = torch._dynamo.explain(moe)(x, moe.routers[0])
        torch._dynamo.reset()
        sites = [reason.user_stack[-1].name for reason in explained.break_reasons]
        assert set(sites) == want, (
            capacity_factor,
            [(r.reason[:60], r.user_stack[-3:]) for r in explained.break_reasons],
        )


def _model_batch(rank: int, B: int = 2, S: int = 16):
    g = torch.Generator().manual_seed(1000 + rank)  # different rows on every rank
    tokens = torch.randint(0, 512, (B, S), generator=g)
    positions = torch.cat([torch.arange(6), torch.arange(S - 6)]).expand(B, S)
    doc_ids = torch.tensor([0] * 6 + [1] * (S - 6)).expand(B, S)
    return tokens, positions, doc_ids


def check_model(ep_mesh) -> None:
    """Debug LoomTransformer built on meta + EP + to_empty + init == the single-process model on
    this rank's rows: initial weights, logits, counts, expert-weight grads."""
    args = loom_flavors["debug"].replace(num_loops=3)
    ref = LoomTransformer(args)
    ref.init_weights()
    with torch.device("meta"):
        model = LoomTransformer(args)
    apply_expert_parallel(model, ep_mesh)
    model.to_empty(device="cpu")
    model.init_weights()
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]

    W, me = ep_mesh.size(), ep_mesh.get_local_rank()
    L = args.num_routed_experts // W
    block = slice(me * L, (me + 1) * L)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        want = ref_params[name][block] if ".experts." in name else ref_params[name]
        got = p.to_local() if ".experts." in name else p
        assert torch.equal(got, want), f"initial weight {name} differs"

    ref_out = {}
    for src in dist.get_process_group_ranks(ep_mesh.get_group()):
        out = ref(*_model_batch(src))
        out.logits_BSV.square().mean().backward()
        ref_out[src] = out
    out = model(*_model_batch(dist.get_rank()))
    out.logits_BSV.square().mean().backward()
    mine = ref_out[dist.get_rank()]
    # A matmul over more rows may pick another CPU kernel (other summation order per row); over
    # 3 loops x 2 layers that gave <= 1.5e-6 on logits of magnitude ~4.
    _close("model logits", out.logits_BSV.detach(), mine.logits_BSV.detach(), tol=1e-5)
    assert torch.equal(out.counts_LTE, mine.counts_LTE), "model kept counts differ"
    for name, p in model.named_parameters():
        if ".experts." in name:
            _close(
                f"model grad {name}", p.grad.to_local(), ref_params[name].grad[block], relative=True
            )


def check_errors(ep_mesh_2d, ep_mesh) -> None:
    args = loom_flavors["debug"].replace(
        dim=64, n_heads=1, expert_intermediate_size=32, num_routed_experts=6
    )
    for mesh, fragment in (
        (ep_mesh, "parallelism.ep=4 must divide num_routed_experts=6"),
        (ep_mesh_2d, "1-D ep mesh"),
    ):
        try:
            apply_expert_parallel(_OneLayer(LoomMoE(args)), mesh)
        except ValueError as err:
            assert fragment in str(err), str(err)
        else:
            raise AssertionError(f"no ValueError for {fragment!r}")


def run(rank: int, world: int, store_path: str) -> None:
    """Entry point of one rank (torch.multiprocessing start_processes)."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        mesh_4 = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        mesh_2x2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "ep"))
        for impl in ("grouped", "loop"):
            check_layer(mesh_4["ep"], impl)
            check_layer(mesh_2x2["ep"], impl)
            check_layer(mesh_4["ep"], impl, capacity_factor=0.0)
        # Float8 experts under EP: rows quantised per row block, as one process does (emulated
        # MXFP8; measured equal within the fp32 bounds above).
        for capacity_factor in (1.0, 0.0):
            check_layer(mesh_4["ep"], "grouped", capacity_factor, float8=True)
        check_host_syncs(mesh_4["ep"])
        check_bf16_experts(mesh_2x2["ep"], mesh_2x2["dp"])
        check_compile_breaks_at_dispatch(mesh_4["ep"])
        check_model(mesh_2x2["ep"])
        check_errors(mesh_2x2, mesh_4["ep"])
    finally:
        dist.destroy_process_group()
