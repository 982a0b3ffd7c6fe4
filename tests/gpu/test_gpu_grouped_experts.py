"""The routed experts as the GPU cells run them: torch._grouped_mm in bf16 (eager and compiled),
forward and backward, with empty, 1-row and 5-row groups among larger ones, against a per-expert
fp32 reference written here; an expert with no rows must get an exactly zero weight gradient
(upstream: pytorch/pytorch#152668, a bf16 grouped-GEMM backward hang on empty groups, and #172439,
non-zero gradients for empty groups on SM100). Repeated backwards catch reads of uninitialised
rows (the allocator hands back used memory after the first).

This file runs last in benchmarks/gpu_check.sh. The same comparison runs on the CPU (the grouped
GEMM's CPU eager path in fp32), so the reference and the checks are exercised in CI too.

Legend: A rows grouped by expert, D model dim, I expert width, E experts.
"""

import pytest
import torch
import torch.nn.functional as F

from torchtitan_loom.models.loom.moe import run_experts

COUNTS = [0, 1, 5, 37, 0, 128, 2, 19]  # empty, 1-row and 5-row groups among larger ones
D, I = 256, 128


def reference(x_AD, counts, w13_E2ID, w2_EDI):
    """SwiGLU expert e on its rows, one expert at a time, in fp32."""
    outs, start = [], 0
    for e, n in enumerate(counts):
        x = x_AD[start : start + n].float()
        gate, up = (x @ w13_E2ID[e].float().t()).chunk(2, dim=-1)
        outs.append((F.silu(gate) * up) @ w2_EDI[e].float().t())
        start += n
    return torch.cat(outs)


def inputs(device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    E, A = len(COUNTS), sum(COUNTS)
    x = torch.randn(A, D, generator=g).to(device, dtype).requires_grad_()
    w13 = (torch.randn(E, 2 * I, D, generator=g) * D**-0.5).to(device, dtype).requires_grad_()
    w2 = (torch.randn(E, D, I, generator=g) * I**-0.5).to(device, dtype).requires_grad_()
    return x, torch.tensor(COUNTS, device=device), w13, w2


def relative(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()


def check_against_reference(device, dtype, impl, tol, fn=run_experts, repeats=3):
    """Forward + backward `repeats` times; each time output and gradients within `tol` (relative)
    of the fp32 reference, and the empty experts' weight gradients exactly zero."""
    x, counts, w13, w2 = inputs(device, dtype)
    want = reference(x, COUNTS, w13, w2)
    want_grads = torch.autograd.grad(want.square().sum(), (x, w13, w2))
    for _ in range(repeats):
        got = fn(x, counts, w13, w2, impl)
        assert got.shape == want.shape and torch.isfinite(got).all()
        grads = torch.autograd.grad(got.float().square().sum(), (x, w13, w2))
        assert relative(got, want) < tol, relative(got, want)
        for name, g, w in zip(("x", "w13", "w2"), grads, want_grads):
            assert torch.isfinite(g).all(), name
            assert relative(g, w) < tol, (name, relative(g, w))
        for e, n in enumerate(COUNTS):
            if n == 0:
                assert not grads[1][e].any() and not grads[2][e].any(), f"expert {e} (0 rows)"


def test_cpu_grouped_and_loop_match_the_reference():
    """The CPU run of the checks below (fp32, CPU eager: the grouped GEMM takes fp32 there)."""
    for impl in ("grouped", "loop"):
        check_against_reference("cpu", torch.float32, impl, 1e-5, repeats=1)


def test_the_reference_check_can_fail():
    """A wrong expert order is caught (the check compares per group, not just in total)."""

    def swapped(x, counts, w13, w2, impl):
        return run_experts(x, counts, w13.flip(0), w2.flip(0), impl)

    with pytest.raises(AssertionError):
        check_against_reference("cpu", torch.float32, "grouped", 1e-5, fn=swapped, repeats=1)


# bf16 inputs, fp32 reference on the same bf16 values: bf16 output rounding and accumulation.
BF16_TOL = 2e-2


@pytest.mark.gpu
def test_grouped_bf16_eager_with_empty_and_small_groups():
    check_against_reference("cuda", torch.bfloat16, "grouped", BF16_TOL)


@pytest.mark.gpu
def test_grouped_bf16_compiled_with_empty_and_small_groups():
    compiled = torch.compile(run_experts, fullgraph=True)
    check_against_reference("cuda", torch.bfloat16, "grouped", BF16_TOL, fn=compiled)


@pytest.mark.gpu
def test_loop_bf16_matches_the_reference():
    check_against_reference("cuda", torch.bfloat16, "loop", BF16_TOL)
