"""Compiled blocks give every parameter the gradient eager gives it (issue 33).

On torch 2.11 a ``torch.autograd.Function`` whose forward returns a tensor it mutated in place
gets zero input gradients under torch.compile, silently (pytorch/pytorch#180642): the losses of
the first segment still match, so a loss-only comparison misses it. Here one segmented forward and
backward (two segments, the second on the detached carry) runs eager and compiled from the same
weights, and the gradient of every parameter is compared, name by name: a parameter without a
gradient, or with a zero one where eager has a non-zero one, fails on any torch version.

The backends run the same aten ops as eager (``eager``: dynamo's graphs run as traced;
``aot_eager``: AOT autograd's joint graph, which is where the bug lives). The differences left are
the compiled branches of models/loom/swiglu.py (the gates' gradient as a sum instead of a row-wise
GEMM): fp32 rounding of one reduction over D = 128, carried back through the loops. Measured on
torch 2.13: at most 4e-7 of each tensor's largest entry (the routers); the bound is 2e-6 of it,
where a zeroed or missing gradient is off by the whole of it.

Legend: B batch, S sequence.
"""

import copy
import importlib.util

import pytest
import torch
from batches import two_document_batch  # tests/unit/batches.py
from test_float8 import converted  # tests/unit/test_float8.py

from torchtitan_loom.components.loss import token_ce_sum
from torchtitan_loom.distributed.model_wrappers import apply_compile
from torchtitan_loom.models.loom import LoomTransformer, loom_flavors

SEGMENTS = ((1, 2), (3, 4))  # H = 4 in two segments: a fresh start and a carried one


def _grads(model: LoomTransformer) -> dict[str, torch.Tensor | None]:
    tokens_BS, positions_BS, doc_ids_BS = two_document_batch(B=2, S=32)
    carry = None
    for start, end in SEGMENTS:
        out = model(tokens_BS, positions_BS, doc_ids_BS, start, end, carry=carry)
        token_ce_sum(out.logits_BSV, tokens_BS).backward()
        carry = out.carry.detach()
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _model(float8: bool) -> LoomTransformer:
    torch.manual_seed(0)
    model = LoomTransformer(loom_flavors["debug"].replace(num_loops=4))
    model.init_weights()
    if float8:  # dense linears tensorwise and the routed experts, emulated (test_float8's helper)
        converted(model, experts=True)
    return model


CASES = [
    pytest.param("eager", False, id="eager-backend"),
    pytest.param("aot_eager", False, id="aot_eager"),
    pytest.param(
        "aot_eager",
        True,
        id="aot_eager-float8",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("torchao") is None, reason="torchao not installed"
        ),
    ),
]


@pytest.mark.parametrize("backend, float8", CASES)
def test_every_parameter_gets_its_eager_gradient_under_compile(backend, float8):
    eager_model = _model(float8)
    compiled_model = copy.deepcopy(eager_model)
    want = _grads(eager_model)
    torch._dynamo.reset()
    try:
        apply_compile(list(compiled_model.layers), backend=backend, fullgraph=True)
        got = _grads(compiled_model)
    finally:
        torch._dynamo.reset()
    assert got.keys() == want.keys()
    missing = [n for n, g in got.items() if g is None and want[n] is not None]
    zeroed = [
        n
        for n, g in got.items()
        if g is not None and want[n] is not None and not g.any() and want[n].any()
    ]
    assert not missing and not zeroed, f"no gradient: {missing}; zero under compile: {zeroed}"
    # Every parameter trains in eager (a parameter that never does would make the check blind).
    assert all(g is not None and g.any() for g in want.values()), [
        n for n, g in want.items() if g is None or not g.any()
    ]
    for name, g in want.items():
        scale = g.abs().max().item()
        torch.testing.assert_close(got[name], g, rtol=0, atol=2e-6 * scale, msg=name)
