"""What LoomTransformer's loops hand back, by name (model.py: ``_run_loop`` for one loop,
``_run_loops`` for the range of one forward call), instead of positional tuples.

Legend: B batch rows, S sequence length, D model dim, L layers, T loops of the range, E routed
experts, K routed top-k, N observed branches per layer, X router z-loss terms (L per loop).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from torchtitan_loom.models.loom.looping_residual import Memory


class OneLoop(NamedTuple):
    """Loop t: the stream after its closing RMSNorm, the carried H-axis memory, and per layer the
    kept assignments per expert, the router z-loss terms, the expert ids (or None) and what
    ``observe`` made of each branch (or None); the stream's per-token RMS after the last block's
    update, before any norm (fp32, no autograd history: the eval's stream statistic, where it can
    move)."""

    z_BSD: torch.Tensor
    h_mem: Memory
    counts_LE: torch.Tensor
    z_sq_L: torch.Tensor
    topk_LBSK: torch.Tensor | None
    observed_LNK: torch.Tensor | None
    rms_BS1: torch.Tensor


class LoopRange(NamedTuple):
    """Loops [loop_start, loop_end]: the last loop's stream, memory and pre-norm RMS, and the
    per-loop values stacked along T (z-loss terms concatenated, L per loop)."""

    z_BSD: torch.Tensor
    h_mem: Memory
    counts_LTE: torch.Tensor
    z_sq_X: torch.Tensor
    topk_LTBSK: torch.Tensor | None
    observed_LTNK: torch.Tensor | None
    rms_BS1: torch.Tensor
