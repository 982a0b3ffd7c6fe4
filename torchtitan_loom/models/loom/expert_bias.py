"""The auxiliary-loss-free expert-bias update (LOOM_SPEC §5.2), model math applied once per step.

Legend: L MoE layers, E routed experts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate


@torch.no_grad()
def update_expert_bias(moe_layers: Iterable[nn.Module], counts_LE: torch.Tensor, lr: float) -> None:
    """b_l ← b_l + lr·sign(mean_e(load_l) − load_l,e) for every MoE layer l (§5.2).

    ``counts_LE`` are kept-assignment counts already summed by the caller over loops,
    micro-batches and data-parallel ranks, so every rank applies the same update. The sign is
    computed exactly in integers: sign(mean − load_e) = sign(Σ_e load − E·load_e), which avoids
    float rounding of large counts. No-op when ``lr == 0``.

    Each module's ``expert_bias`` buffer [E] is updated in place. FSDP2 leaves buffers as plain
    tensors; if the buffer is a DTensor it must be replicated, and the update is applied to its
    local tensor (the full vector on every rank), so all replicas stay identical.
    """
    if lr == 0:
        return
    layers = list(moe_layers)
    if counts_LE.dim() != 2 or counts_LE.shape[0] != len(layers):
        raise ValueError(
            f"update_expert_bias: counts_LE must be [L={len(layers)}, E], "
            f"got shape {tuple(counts_LE.shape)}"
        )
    counts_LE = counts_LE.to(torch.int64)
    n_experts = counts_LE.shape[1]
    sign_LE = torch.sign(counts_LE.sum(dim=1, keepdim=True) - n_experts * counts_LE)
    for l, layer in enumerate(layers):
        bias_E = cast(torch.Tensor, layer.expert_bias)  # a buffer (nn.Module types Tensor | Module)
        if isinstance(bias_E, DTensor):
            if not all(isinstance(p, Replicate) for p in bias_E.placements):
                raise ValueError(
                    f"update_expert_bias: layer {l} expert_bias must be replicated, "
                    f"got placements {bias_E.placements}"
                )
            bias_E = bias_E.to_local()
        if bias_E.shape != (n_experts,):
            raise ValueError(
                f"update_expert_bias: layer {l} expert_bias has shape "
                f"{tuple(bias_E.shape)}, counts give E={n_experts}"
            )
        bias_E.add_(sign_LE[l].to(device=bias_E.device, dtype=bias_E.dtype), alpha=lr)
