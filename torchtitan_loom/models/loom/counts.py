"""Parameter and FLOP counts of a LoomTransformer, from the parts model.py hands in (this file
sits below it): what the start line, the metrics' MFU and the cost model read (LOOM_SPEC.md §2
"active incl. head and embedding").

Legend: L layers, H loops, E routed experts, k routed top-k, V vocab, D model dim.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from torchtitan_loom.models.loom.args import LoomModelArgs
from torchtitan_loom.models.loom.block import LoomBlock


def count_params(
    params: Iterable[nn.Parameter], blocks: Iterable[LoomBlock], outer_VD: Iterable[torch.Tensor]
) -> dict[str, int]:
    """{"total", "active"}: total = every parameter in `params` (all H routers included).

    active = per token: for each of the L `blocks` the attention (wqkv, wo), k of the E routed
    experts, the shared experts, ONE router and the ffn_branch_rms weight; plus the embedding
    row and the output head (`outer_VD`: their weights, V*D each, spec §2 "active incl. head and
    embedding").
    """
    total = sum(p.numel() for p in params)
    per_layer = sum(_active_matmul_params(layer) + _norm_params(layer) for layer in blocks)
    return {"total": total, "active": per_layer + sum(w.numel() for w in outer_VD)}


def count_flops_per_token(
    args: LoomModelArgs,
    blocks: Iterable[LoomBlock],
    head_VD: torch.Tensor,
    seq_len: int,
    head_calls: int = 1,
) -> float:
    """Training FLOPs per token (forward + backward) over all H loops:

        6 * (P_loop * H + V * D * head_calls) + 12 * L * H * n_heads * head_dim * seq_len

    P_loop = matmul parameters a token uses in one loop, summed over the L layers (attention
    wqkv + wo, k routed experts, shared experts, one router); V*D = output head, applied once
    per forward (pass head_calls = number of segments for segmented training). The last term is
    attention scores and values (QK^T and AV, 2 matmuls x 2 FLOPs x 3 for fwd+bwd, no causal
    discount, TorchTitan convention). The embedding lookup and the norms are not counted.
    """
    p_loop = sum(_active_matmul_params(layer) for layer in blocks)
    head = head_VD.numel()
    attention = 12 * args.n_layers * args.num_loops * args.n_heads * args.head_dim * seq_len
    return float(6 * (p_loop * args.num_loops + head * head_calls) + attention)


def _active_matmul_params(layer: LoomBlock) -> int:
    moe = layer.moe
    attention = sum(p.numel() for p in layer.attention.parameters())
    routed = (moe.experts.w13.numel() + moe.experts.w2.numel()) * moe.top_k // moe.num_experts
    shared = sum(p.numel() for p in moe.shared_experts.parameters())
    router: nn.Parameter = moe.routers[0]  # ParameterList indexing is untyped
    return attention + routed + shared + router.numel()


def _norm_params(layer: LoomBlock) -> int:
    return 0 if layer.ffn_branch_norm is None else layer.ffn_branch_norm.weight.numel()
