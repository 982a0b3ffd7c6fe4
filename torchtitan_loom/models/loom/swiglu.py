"""The experts' elementwise math as two autograd functions that write less than their plain
compositions (the routed and the shared SwiGLU experts, and the gate-weighted combine of LoomMoE).

``swiglu_activation(h_M2I)`` = silu(gate) * up, with gate and up the two halves of the [M, 2I] output of the
first GEMM. It saves only that GEMM output (which exists anyway) and recomputes silu(gate) in
backward, which writes the [M, 2I] gradient straight into one buffer: no ``chunk`` backward
(``cat``), no saved silu(gate). The plain ``F.silu(g) * u`` allocates [M, I] twice in forward and
[M, I] three times plus the [M, 2I] ``cat`` in backward; this allocates [M, I] once in forward and
the [M, 2I] gradient once in backward. Forward and gradient are bitwise those of the plain
composition: the same kernels (silu, mul, silu_backward) on the same operands.

``gate_combine(out_AD, gate_A, token_A, N)`` = zeros(N, D).index_add_(0, token_A, out_AD * gate_A):
the gate weighting of the routed outputs and their sum into their tokens' rows. Its backward
gathers the output gradient's rows once and scales them in place (the plain composition writes
[A, D] three times there: the gather, the gradient of the outputs, and grad * out for the gates'
gradient); the gates' gradient is, in eager, a row-wise dot product (a batched GEMM of [A, 1, D]
by [A, D, 1]), fp32 rounding away from the plain sum over D; every other value is bitwise the
same. Compiled, it is the plain product and sum, which inductor fuses into one reduction.

Traced by torch.compile, both forwards are out of place: torch 2.11 silently gives a Function
whose forward returns a tensor it mutated zero input gradients (pytorch/pytorch#180642).
Both are plain autograd functions of aten ops, so torch.compile traces them (no graph break;
SwiGLU's compiled backward is the functional form, which inductor fuses into one kernel) and
activation checkpointing recomputes them like any op.

Legend: M rows (assignments A, or tokens N), I expert width, D model dim, A assignments, N tokens.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_M2I: torch.Tensor) -> torch.Tensor:
        gate_MI, up_MI = h_M2I.chunk(2, dim=-1)
        ctx.save_for_backward(h_M2I)
        if torch.compiler.is_compiling():
            # Out of place when traced: on torch 2.11 a Function whose forward returns a tensor it
            # mutated in place gets zero input gradients under compile (pytorch/pytorch#180642,
            # fixed in 2.13 by #180921). Inductor fuses the product into one kernel anyway.
            return torch.nn.functional.silu(gate_MI) * up_MI
        act_MI = torch.nn.functional.silu(gate_MI)
        act_MI.mul_(up_MI)  # in place: the product needs no buffer of its own
        return act_MI

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_MI: torch.Tensor) -> torch.Tensor:
        (h_M2I,) = ctx.saved_tensors
        gate_MI, up_MI = h_M2I.chunk(2, dim=-1)
        if torch.compiler.is_compiling():
            # Dynamo takes no out= into a strided half; inductor fuses this into one kernel that
            # writes the [M, 2I] gradient once anyway.
            d_gate_MI = torch.ops.aten.silu_backward(grad_MI * up_MI, gate_MI)
            return torch.cat([d_gate_MI, grad_MI * torch.nn.functional.silu(gate_MI)], dim=-1)
        grad_h_M2I = torch.empty_like(h_M2I, memory_format=torch.contiguous_format)
        d_gate_MI, d_up_MI = grad_h_M2I.chunk(2, dim=-1)
        # d up = grad * silu(gate): silu recomputed into its half, then scaled in place.
        torch.ops.aten.silu.out(gate_MI, out=d_up_MI)
        d_up_MI.mul_(grad_MI)
        # d gate = silu'(gate) * grad * up: the product in its half, silu_backward over it in place.
        torch.mul(grad_MI, up_MI, out=d_gate_MI)
        torch.ops.aten.silu_backward.grad_input(d_gate_MI, gate_MI, grad_input=d_gate_MI)
        return grad_h_M2I


def swiglu_activation(h_M2I: torch.Tensor) -> torch.Tensor:
    """silu(h[:, :I]) * h[:, I:] for the [M, 2I] output of a SwiGLU's first GEMM (see the module)."""
    return _SwiGLU.apply(h_M2I)


class _GateCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out_AD, gate_A, token_A, num_tokens: int):
        weighted_AD = out_AD * gate_A.unsqueeze(-1)
        y_ND = weighted_AD.new_zeros(num_tokens, out_AD.shape[-1])
        ctx.save_for_backward(out_AD, gate_A, token_A)
        if torch.compiler.is_compiling():
            # Out of place when traced: pytorch/pytorch#180642 (see _SwiGLU.forward).
            return y_ND.index_add(0, token_A, weighted_AD)
        y_ND.index_add_(0, token_A, weighted_AD)
        return y_ND

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_ND):
        out_AD, gate_A, token_A = ctx.saved_tensors
        grad_AD = grad_ND.index_select(0, token_A)
        grad_gate_A = None
        if ctx.needs_input_grad[1]:
            # Under autocast the outputs are bf16 and the combine fp32: one cast of them here.
            if torch.compiler.is_compiling():  # inductor fuses the product into the reduction
                grad_gate_A = (grad_AD * out_AD).sum(-1).to(gate_A.dtype)
            else:
                rows_A1D, out_AD1 = grad_AD.unsqueeze(1), out_AD.to(grad_AD.dtype).unsqueeze(2)
                grad_gate_A = torch.bmm(rows_A1D, out_AD1).view(-1).to(gate_A.dtype)
        grad_out_AD = None
        if ctx.needs_input_grad[0]:
            grad_out_AD = grad_AD.mul_(gate_A.unsqueeze(-1)).to(out_AD.dtype)
        return grad_out_AD, grad_gate_A, None, None


def gate_combine(
    out_AD: torch.Tensor, gate_A: torch.Tensor, token_A: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """[num_tokens, D]: row token_A[a] receives out_AD[a] * gate_A[a], summed (see the module)."""
    return _GateCombine.apply(out_AD, gate_A, token_A, num_tokens)
