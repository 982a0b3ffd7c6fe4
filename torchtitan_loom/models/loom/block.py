"""One LOOM block (layer l, loop t), LOOM_SPEC.md §4.4-§4.5:

    o = gamma * GatedAttention(RMS(x))
    x = x + r_H + r_L            (Looping Residual; plain x + o when switched off)
    x = x + gamma * RMS_w(MoE(RMS(x); router_t))
    x = RMS(x)                   (per_layer_out_norm)

Everything that depends on the loop (router weight, gamma, the memories) is a tensor argument,
so one compiled block serves all loops.

Legend: B batch rows, S sequence length, D model dim, E routed experts, K routed top-k.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from torchtitan_loom.loop_request import KVAppender
from torchtitan_loom.models.loom.args import LoomModelArgs
from torchtitan_loom.models.loom.attention import AttentionMask, GatedAttention
from torchtitan_loom.models.loom.looping_residual import Memory, looping_residual_write
from torchtitan_loom.models.loom.moe import LoomMoE


def rms_norm(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim (times `weight` if given), computed in fp32."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


class RMSNormAffine(nn.Module):
    """RMS_w: RMSNorm with a learnable per-channel weight (initialised to ones)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.eps, self.weight)


class BlockInput(NamedTuple):
    """What a block reads besides the stream, the two memories and its loop's router: the call's
    RoPE tables and mask, the residual gain `gamma` (0-d fp32), this (layer, loop)'s K/V slot (a
    decoding cache's or an exit hold's; None in training), and what to hand out besides."""

    rope: tuple[torch.Tensor, torch.Tensor]
    attn_mask: AttentionMask
    gamma: torch.Tensor
    kv_slot: KVAppender | None = None
    return_topk: bool = False
    return_branches: bool = False


class BlockOutput(NamedTuple):
    """What a block hands to the next: stream, both memories, kept counts [E], z-loss term, the
    stream's per-token RMS [B, S, 1] before any output norm (fp32, values only: the eval's stream
    statistic), the chosen expert ids [B, S, K] when asked (return_topk), and when asked
    (return_branches) the branch outputs (attention, MoE) as their modules return them, else None."""

    x_BSD: torch.Tensor
    l_mem: Memory
    h_mem: Memory
    kept_E: torch.Tensor
    z_sq: torch.Tensor
    rms_BS1: torch.Tensor
    expert_BSK: torch.Tensor | None = None
    branches: tuple[torch.Tensor, torch.Tensor] | None = None


# The names of BlockOutput.branches, in order: what the model reports it observes.
BRANCHES = ("attention", "moe")


class LoomBlock(nn.Module):
    """Gated GQA attention with the Looping Residual, then the gamma-scaled MoE half."""

    def __init__(self, args: LoomModelArgs):
        super().__init__()
        self.eps = args.norm_eps
        self.looping_residual = args.looping_residual
        self.beta = args.looping_residual_beta
        self.per_layer_out_norm = args.per_layer_out_norm
        self.attention = GatedAttention(args)
        self.moe = LoomMoE(args)
        self.ffn_branch_norm: RMSNormAffine | None
        if args.ffn_branch_rms == "affine":
            self.ffn_branch_norm = RMSNormAffine(args.dim, args.norm_eps)
        else:
            self.ffn_branch_norm = None

    def forward(
        self,
        x_BSD: torch.Tensor,
        l_mem: Memory,
        h_mem: Memory,
        router_w_ED: torch.Tensor,
        inp: BlockInput,
    ) -> BlockOutput:
        """Run the block once (layer l, loop t). `router_w_ED` is loop t's router, a tensor argument
        of its own: a parallelize hook may replace it (models/loom/infra/parallelize.py)."""
        gamma = inp.gamma
        a_BSD = self.attention(rms_norm(x_BSD, self.eps), inp.rope, inp.attn_mask, inp.kv_slot)
        o_BSD = gamma * a_BSD
        if self.looping_residual:
            r_BSD, l_mem, h_mem = looping_residual_write(o_BSD, l_mem, h_mem, self.beta)
            x_BSD = x_BSD + r_BSD.to(x_BSD.dtype)
        else:
            x_BSD = x_BSD + o_BSD
        moe_in_BSD = rms_norm(x_BSD, self.eps)
        m_BSD, kept_E, z_sq = self.moe(moe_in_BSD, router_w_ED)
        expert_BSK = self.moe.select(moe_in_BSD, router_w_ED) if inp.return_topk else None
        # Values only: observing must not add outputs to the autograd graph (nor FSDP's hooks on them).
        branches = (a_BSD.detach(), m_BSD.detach()) if inp.return_branches else None
        if self.ffn_branch_norm is not None:
            m_BSD = self.ffn_branch_norm(m_BSD)
        x_BSD = x_BSD + gamma * m_BSD
        # Before the norm, where the stream's size can move (after it, it is 1 by construction);
        # detached, so no graph keeps the stream for it (compiled, the norm's own sum is shared).
        rms_BS1 = x_BSD.detach().float().pow(2).mean(dim=-1, keepdim=True).sqrt()
        if self.per_layer_out_norm:
            x_BSD = rms_norm(x_BSD, self.eps)
        return BlockOutput(
            x_BSD=x_BSD,
            l_mem=l_mem,
            h_mem=h_mem,
            kept_E=kept_E,
            z_sq=z_sq,
            rms_BS1=rms_BS1,
            expert_BSK=expert_BSK,
            branches=branches,
        )
