"""models/loom/swiglu.py against the plain compositions it replaces, and what it saves.

- swiglu_activation: forward and the [M, 2I] gradient bitwise those of chunk / F.silu / mul
  (the same kernels on the same operands), fp32 and bf16, eager and compiled (dynamo + AOT
  autograd, no graph break); its backward allocates one [M, 2I] buffer, the plain one 2.5 times
  that.
- gate_combine: forward and the outputs' gradient bitwise those of out * gate + index_add_; the
  gates' gradient is a row-wise dot product instead of a sum over D of grad * out: fp32 rounding
  (relative 1e-6 bounds a few ulps of a sum of 64 terms; a wrong or lost term moves it by ~1e-1).
- The eager MoE layer (benchmarks/moe_layer.py's counter, by aten op): the fused functions
  allocate at least 4 [rows, I] per SwiGLU call and 2 [A, D] in the combine less than the plain
  composition, outside the GEMMs, with the same GEMM bytes.
"""

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_model_moe import small_moe
from torch._dynamo.utils import counters

from torchtitan_loom.models.loom.swiglu import gate_combine, swiglu_activation

ROOT = Path(__file__).resolve().parents[2]


def bench():
    spec = importlib.util.spec_from_file_location(
        "moe_layer_bench", ROOT / "benchmarks" / "moe_layer.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plain_swiglu(h_M2I):
    gate_MI, up_MI = h_M2I.chunk(2, dim=-1)
    return F.silu(gate_MI) * up_MI


def plain_combine(out_AD, gate_A, token_A, num_tokens):
    weighted_AD = out_AD * gate_A.unsqueeze(-1)
    return weighted_AD.new_zeros(num_tokens, out_AD.shape[-1]).index_add_(0, token_A, weighted_AD)


def grads(fn, *inputs, grad_out):
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in leaves if t.requires_grad]


def _h(dtype, rows=37, inter=24):
    g = torch.Generator().manual_seed(0)
    h = (3 * torch.randn(rows, 2 * inter, generator=g)).to(dtype)
    return h, torch.randn(rows, inter, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_swiglu_is_bitwise_the_plain_composition(dtype, compiled):
    h, grad = _h(dtype)
    fn = swiglu_activation
    if compiled:
        torch._dynamo.reset()
        counters.clear()
        fn = torch.compile(swiglu_activation, backend="aot_eager", fullgraph=True)
    y, (dh,) = grads(fn, h, grad_out=grad)
    y0, (dh0,) = grads(plain_swiglu, h, grad_out=grad)
    assert torch.equal(y, y0) and torch.equal(dh, dh0)
    assert y.dtype == dh.dtype == dtype
    if compiled:
        assert dict(counters["graph_break"]) == {}
        torch._dynamo.reset()


def test_swiglu_backward_allocates_one_gradient():
    b = bench()
    h, grad = _h(torch.float32, rows=64, inter=32)

    def backward_allocations(fn):
        leaf = h.clone().requires_grad_(True)
        out = fn(leaf)
        with b.OpWrites() as counter:
            out.backward(grad)
        return sum(entry[1] for entry in counter.by_op.values())

    one_gradient = h.numel() * 4
    assert backward_allocations(swiglu_activation) == one_gradient
    # chunk's backward alone (cat) is one [M, 2I]; the plain form adds three [M, I].
    assert backward_allocations(plain_swiglu) == 2.5 * one_gradient


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16_out"])
def test_gate_combine_matches_the_plain_combine(out_dtype):
    g = torch.Generator().manual_seed(3)
    A, N, D = 90, 30, 64
    out = torch.randn(A, D, generator=g).to(out_dtype)
    gate = torch.rand(A, generator=g)
    gate[::7] = 0.0  # dropped assignments
    token = torch.randint(0, N, (A,), generator=g)
    grad_y = torch.randn(N, D, generator=g)
    y, (d_out, d_gate) = grads(
        lambda o, w, t: gate_combine(o, w, t, N), out, gate, token, grad_out=grad_y
    )
    y0, (d_out0, d_gate0) = grads(
        lambda o, w, t: plain_combine(o, w, t, N), out, gate, token, grad_out=grad_y
    )
    assert torch.equal(y, y0)
    assert torch.equal(d_out, d_out0) and d_out.dtype == out_dtype
    rel = ((d_gate - d_gate0).abs().max() / d_gate0.abs().max()).item()
    assert rel <= 1e-6, rel


def test_gate_combine_compiles_without_a_break():
    g = torch.Generator().manual_seed(4)
    out, gate = torch.randn(40, 16, generator=g), torch.rand(40, generator=g)
    token, grad_y = torch.randint(0, 10, (40,), generator=g), torch.randn(10, 16, generator=g)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(gate_combine, backend="aot_eager", fullgraph=True)
    y, (d_out, d_gate) = grads(
        lambda o, w, t: compiled(o, w, t, 10), out, gate, token, grad_out=grad_y
    )
    y0, (d_out0, d_gate0) = grads(
        lambda o, w, t: gate_combine(o, w, t, 10), out, gate, token, grad_out=grad_y
    )
    assert dict(counters["graph_break"]) == {}
    torch._dynamo.reset()
    assert torch.equal(y, y0) and torch.equal(d_out, d_out0)
    rel = ((d_gate - d_gate0).abs().max() / d_gate0.abs().max()).item()
    assert rel <= 1e-6, rel  # eager: the row-wise dot product; compiled: the plain sum


def test_eager_moe_layer_allocates_less_outside_the_gemms():
    b = bench()
    moe = small_moe(capacity_factor=1.0)
    router_w = moe.routers[0].detach().clone().requires_grad_(True)
    x = torch.randn(2, 96, 64, generator=torch.Generator().manual_seed(1))
    grad_y = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))

    def split(by_op):
        outside = sum(v[1] for op, v in by_op.items() if op not in b.GEMMS)
        return outside, sum(v[1] for op, v in by_op.items() if op in b.GEMMS)

    before, gemm_before = split(b.op_writes(b.before_forward, moe, x, router_w, grad_y))
    after, gemm_after = split(b.op_writes(b.after_forward, moe, x, router_w, grad_y))
    N, D, I, K = 2 * 96, 64, moe.experts.w2.shape[-1], moe.top_k
    A, shared = N * K, len(moe.shared_experts)
    saved = 4 * ((A + shared * N) * I * 4) + 2 * A * D * 4  # fp32 bytes
    assert gemm_after == gemm_before + A * 4  # + the gates' dot products (bmm), [A] fp32
    assert before - after >= saved, (before, after, saved)
