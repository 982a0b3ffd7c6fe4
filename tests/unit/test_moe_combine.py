"""The lean MoE combine: LoomMoE.forward weights the expert outputs by their gates and adds them
into [N, D] (no [N, K, D] copy; rows gathered in the experts' compute dtype; the gate weighting
and the SwiGLU as the autograd functions of models/loom/swiglu.py). Against `before_forward` of
benchmarks/moe_layer.py (the benchmark's reference: the same routing with the plain chunk / silu /
mul SwiGLU and a plain gate multiply + index_add_): the same output and gradients to fp32
rounding, and fewer bytes allocated per forward + backward.

Tolerance: the gates' gradient is a row-wise dot product instead of a sum over D, so fp32 results
move by a few ulps (relative 1e-6 bounds it with room; a wrong weight or a lost term moves them by
~1e-1). Under autocast, gradients pass through bf16 GEMMs whose inputs differ by those ulps.
"""

import importlib.util
from pathlib import Path

import pytest
import torch
from test_model_moe import small_moe  # next to this file

ROOT = Path(__file__).resolve().parents[2]


def bench():
    spec = importlib.util.spec_from_file_location(
        "moe_layer_bench", ROOT / "benchmarks" / "moe_layer.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("capacity_factor", [0.0, 1.0])
@pytest.mark.parametrize("precision", ["float32", "autocast"])
def test_lean_combine_matches_the_old_one_and_allocates_less(capacity_factor, precision):
    b = bench()
    moe = small_moe(capacity_factor=capacity_factor)
    router_w = moe.routers[0].detach().clone().requires_grad_(True)
    x = torch.randn(2, 96, 64, generator=torch.Generator().manual_seed(1))
    grad_y = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    y0, g0 = b.fwd_bwd(b.before_forward, moe, x, router_w, grad_y, precision)
    y1, g1 = b.fwd_bwd(b.after_forward, moe, x, router_w, grad_y, precision)
    # fp32: a few ulps. autocast: the outputs are fp32 sums of bf16 expert outputs (same few ulps);
    # gradients pass through bf16 GEMMs whose inputs differ by those ulps, so bf16 rounding (2^-8).
    grad_tol = 1e-6 if precision == "float32" else 1e-2
    assert ((y1 - y0).abs().max() / y0.abs().max()).item() <= 1e-6
    for a, c in zip(g0, g1):
        if a is not None:
            assert ((c - a).abs().max() / a.abs().max()).item() <= grad_tol
    before, _ = b.allocation_profile(b.before_forward, moe, x, router_w, grad_y, precision)
    after, _ = b.allocation_profile(b.after_forward, moe, x, router_w, grad_y, precision)
    A, D = x.shape[0] * x.shape[1] * moe.top_k, x.shape[-1]
    # At least one [A, D] fp32 product of the combine's backward is gone (both in fp32 runs;
    # under autocast the bf16 outputs are cast to fp32 once for the gates' gradient).
    assert before - after >= A * D * 4, (before, after)
