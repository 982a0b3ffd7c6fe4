"""What LoomTransformer's loops read and hand back, by name (model.py: ``_run_loop`` for one loop,
``_run_loops`` for the range of one forward call), instead of positional tuples.

Legend: B batch rows, S sequence length, D model dim, L layers, T loops of the range, E routed
experts, K routed top-k, N observed branches per layer, X router z-loss terms (L per loop).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from torchtitan_loom.loop_request import KVAppender, KVStore, LoopRequest
from torchtitan_loom.models.loom.attention import AttentionMask
from torchtitan_loom.models.loom.block import BlockInput
from torchtitan_loom.models.loom.looping_residual import Memory


class LoopCall(NamedTuple):
    """What every loop of one forward call reads: the embedding (re-injected from loop 2 on), the
    RoPE tables, mask and residual gain gamma (0-d fp32) every block shares, where the attention
    calls put their K/V (the request's hold, else its cache, else None) and the request."""

    e_BSD: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor]
    attn_mask: AttentionMask
    gamma: torch.Tensor
    kv: KVStore | None
    request: LoopRequest

    def block_input(self, kv_slot: KVAppender | None) -> BlockInput:
        """One block's input in this call, given its K/V slot."""
        return BlockInput(
            self.rope,
            self.attn_mask,
            self.gamma,
            kv_slot=kv_slot,
            return_topk=self.request.return_topk,
            return_branches=self.request.observe is not None,
        )


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
