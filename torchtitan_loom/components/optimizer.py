"""AdamW (LOOM_SPEC §7.2) and the auxiliary-loss-free expert-bias update (§5.2).

Legend: L MoE layers, E routed experts.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

VALID_IMPLEMENTATIONS = ("foreach", "fused", "for-loop")
# Device types with fused AdamW kernels in torch 2.11+ (torch checks this lazily at step()).
FUSED_DEVICE_TYPES = ("cuda", "cpu", "mps", "xpu", "hpu")


def build_optimizer(
    model: nn.Module,
    *,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.1,
    implementation: str = "foreach",
) -> torch.optim.AdamW:
    """AdamW over ONE parameter group holding every trainable parameter (§7.2).

    Embeddings, head, routers and norm weights all get weight decay, as in the recipe. A
    parameter whose ``.grad`` is None at ``step()`` is skipped by AdamW entirely (no moment
    update, no decay, no step count), which is what leaves the routers of loops outside the
    current segment untouched (§6 item 4).

    ``implementation``: "foreach" (multi-tensor kernels), "fused" (single fused kernel, only
    where torch supports it for the parameters' device and dtype) or "for-loop" (reference
    per-parameter loop). All three compute the same update up to rounding.
    """
    if implementation not in VALID_IMPLEMENTATIONS:
        raise ValueError(
            f"optimizer.implementation must be one of {VALID_IMPLEMENTATIONS}, got {implementation!r}")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("build_optimizer: the model has no trainable parameters")
    if implementation == "fused":
        _check_fused_supported(params)
    return torch.optim.AdamW(
        [{"params": params}], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay,
        foreach=implementation == "foreach", fused=implementation == "fused")


def _check_fused_supported(params: list[nn.Parameter]) -> None:
    """Fail at build time; torch itself only checks fused support at the first ``step()``."""
    bad = sorted({f"{p.device.type}/{p.dtype}" for p in params
                  if p.device.type not in FUSED_DEVICE_TYPES or not torch.is_floating_point(p)})
    if bad:
        raise ValueError(
            f"optimizer.implementation='fused' needs floating-point parameters on one of "
            f"{FUSED_DEVICE_TYPES}; found {bad}. Use 'foreach' or 'for-loop'.")


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
        raise ValueError(f"update_expert_bias: counts_LE must be [L={len(layers)}, E], "
                         f"got shape {tuple(counts_LE.shape)}")
    counts_LE = counts_LE.to(torch.int64)
    n_experts = counts_LE.shape[1]
    sign_LE = torch.sign(counts_LE.sum(dim=1, keepdim=True) - n_experts * counts_LE)
    for l, layer in enumerate(layers):
        bias_E = layer.expert_bias
        if isinstance(bias_E, DTensor):
            if not all(isinstance(p, Replicate) for p in bias_E.placements):
                raise ValueError(f"update_expert_bias: layer {l} expert_bias must be replicated, "
                                 f"got placements {bias_E.placements}")
            bias_E = bias_E.to_local()
        if bias_E.shape != (n_experts,):
            raise ValueError(f"update_expert_bias: layer {l} expert_bias has shape "
                             f"{tuple(bias_E.shape)}, counts give E={n_experts}")
        bias_E.add_(sign_LE[l].to(device=bias_E.device, dtype=bias_E.dtype), alpha=lr)
