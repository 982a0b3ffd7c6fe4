"""Looping Residual (the "dual-axis carry" of LOOM_SPEC.md §4.4 steps 8-11).

Two normalised exponential moving averages per token, all in fp32:
- the L-axis memory, reset at the start of every loop, fed with the attention output o;
- the H-axis memory, one for the whole network (all layers and loops, carried across segments),
  fed with the L-axis readout r_L.
The attention write is x <- x + r_H + r_L.

A memory is a plain (numerator, denominator) pair of tensors. Starting from zeros gives exactly
the spec's "if empty: N = o, D = 1" rule, because beta*0 + o = o and beta*0 + 1 = 1, so no
Python branch (and no recompile) is needed for the first write.

Legend: B batch rows, S sequence length, D model dim.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

DEN_FLOOR = 1e-6  # readout = num / max(den, 1e-6), spec §4.4 steps 8-9


class LoopCarry(NamedTuple):
    """LOOM's state handed from one loop range to the next: the stream and the H-axis memory (fp32),
    and the stream's per-token RMS in the last loop before any norm (fp32; read by the eval's
    stream statistic, not by the next loop)."""

    z_BSD: torch.Tensor
    h_num_BSD: torch.Tensor
    h_den_BS1: torch.Tensor
    rms_BS1: torch.Tensor
    entropy_BS: torch.Tensor | None = None
    """The last loop's prediction entropy (fp32, no gradient): the learned exit head reads it
    (models/loom/exit_head.py); None on a model without the head."""

    def detach(self) -> LoopCarry:
        """Values only, no autograd history (segment boundary of truncated backprop)."""
        e = self.entropy_BS
        return LoopCarry(
            self.z_BSD.detach(),
            self.h_num_BSD.detach(),
            self.h_den_BS1.detach(),
            self.rms_BS1.detach(),
            None if e is None else e.detach(),
        )


class Memory(NamedTuple):
    """One EMA memory: numerator [B, S, D] and denominator [B, S, 1], both fp32."""

    num_BSD: torch.Tensor
    den_BS1: torch.Tensor


def empty_memory(x_BSD: torch.Tensor) -> Memory:
    """An empty memory shaped like the stream `x_BSD` (zeros, fp32, same device)."""
    B, S, D = x_BSD.shape
    return Memory(
        x_BSD.new_zeros(B, S, D, dtype=torch.float32),
        x_BSD.new_zeros(B, S, 1, dtype=torch.float32),
    )


def ema_write(mem: Memory, value_BSD: torch.Tensor, beta: float) -> tuple[Memory, torch.Tensor]:
    """Write `value_BSD` (fp32) with weight 1: N <- beta N + v, D <- beta D + 1; return (memory, readout)."""
    num_BSD = beta * mem.num_BSD + value_BSD
    den_BS1 = beta * mem.den_BS1 + 1.0
    readout_BSD = num_BSD / den_BS1.clamp_min(DEN_FLOOR)
    return Memory(num_BSD, den_BS1), readout_BSD


def looping_residual_write(
    o_BSD: torch.Tensor, l_mem: Memory, h_mem: Memory, beta: float
) -> tuple[torch.Tensor, Memory, Memory]:
    """Feed the attention output o to the L memory, r_L to the H memory; return (r_H + r_L, L, H).

    The returned write r is fp32; the caller casts it once to the stream dtype (spec §14,
    precision notes: memories and the sum stay in fp32).
    """
    l_mem, r_L_BSD = ema_write(l_mem, o_BSD.float(), beta)
    h_mem, r_H_BSD = ema_write(h_mem, r_L_BSD, beta)
    return r_H_BSD + r_L_BSD, l_mem, h_mem
