"""The optimizers of the table (choices.OPTIMIZERS: AdamW, LOOM_SPEC §7.2; Lion) built from the
[optimizer] section, and the config-wins rule for their hyper-parameters on resume (§7.7)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torchtitan_loom.components.optim.choices import OPTIMIZERS, VALID_IMPLEMENTATIONS
from torchtitan_loom.components.optim.lion import Lion

# Device types with fused AdamW kernels in torch 2.11+ (torch checks this lazily at step()).
FUSED_DEVICE_TYPES = ("cuda", "cpu", "mps", "xpu", "hpu")


def build_optimizer(model: nn.Module, section: Any) -> torch.optim.Optimizer:
    """``optimizer.name`` over ONE parameter group holding every trainable parameter (§7.2), with
    the values of the ``[optimizer]`` section the optimizer reads (choices.OPTIMIZERS)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("build_optimizer: the model has no trainable parameters")
    if section.name not in BUILDERS:
        raise ValueError(f"optimizer.name must be one of {tuple(BUILDERS)}, got {section.name!r}")
    return BUILDERS[section.name](params, section)


def _lion(params: list[nn.Parameter], section: Any) -> Lion:
    """Lion with lr, (beta1, beta2) and weight_decay (lion.py); eps and implementation unused."""
    return Lion(
        [{"params": params}],
        lr=section.lr,
        betas=(section.beta1, section.beta2),
        weight_decay=section.weight_decay,
    )


def _adamw(params: list[nn.Parameter], section: Any) -> torch.optim.AdamW:
    """AdamW with lr, beta1, beta2, eps, weight_decay and implementation.

    Embeddings, head, routers and norm weights all get weight decay, as in the recipe. A
    parameter whose ``.grad`` is None at ``step()`` is skipped by AdamW entirely (no moment
    update, no decay, no step count), which is what leaves the routers of loops outside the
    current segment untouched (§6 item 4).

    ``implementation``: "foreach" (multi-tensor kernels), "fused" (single fused kernel, only
    where torch supports it for the parameters' device and dtype) or "for-loop" (reference
    per-parameter loop). All three compute the same update up to rounding.
    """
    lr, betas, eps, weight_decay = (
        section.lr,
        (section.beta1, section.beta2),
        section.eps,
        section.weight_decay,
    )
    implementation = section.implementation
    if implementation not in VALID_IMPLEMENTATIONS:
        raise ValueError(
            f"optimizer.implementation must be one of {VALID_IMPLEMENTATIONS}, got {implementation!r}"
        )
    if implementation == "fused":
        _check_fused_supported(params)
    return torch.optim.AdamW(
        [{"params": params}],
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        foreach=implementation == "foreach",
        fused=implementation == "fused",
    )


# How each optimizer of the table is built (its other facts: choices.OPTIMIZERS, same names).
BUILDERS = {"AdamW": _adamw, "Lion": _lion}


def _check_fused_supported(params: list[nn.Parameter]) -> None:
    """Fail at build time; torch itself only checks fused support at the first ``step()``."""
    bad = sorted(
        {
            f"{p.device.type}/{p.dtype}"
            for p in params
            if p.device.type not in FUSED_DEVICE_TYPES or not torch.is_floating_point(p)
        }
    )
    if bad:
        raise ValueError(
            f"optimizer.implementation='fused' needs floating-point parameters on one of "
            f"{FUSED_DEVICE_TYPES}; found {bad}. Use 'foreach' or 'for-loop'."
        )


def apply_config_hyperparameters(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, section: Any
) -> list[str]:
    """After a resume, make the current config win over the checkpoint (LOOM_SPEC §7.7).

    A loaded optimizer brings its saved hyper-parameters (those of its table entry: betas, eps,
    weight decay), and the schedule its saved peak lr (``base_lrs``); each is replaced by the
    config's value and the lr of the restored schedule position is recomputed. The schedule's
    shape (steps, ratios) is a closure over the config and is never restored. Returns one line per
    value that changed.
    """
    keys = OPTIMIZERS[section.name].hyper_keys
    lr = section.lr
    wanted: dict[str, Any] = {"lr": lr}
    if "beta1" in keys:
        wanted["betas"] = (section.beta1, section.beta2)
    wanted.update({k: getattr(section, k) for k in ("eps", "weight_decay") if k in keys})
    group0 = optimizer.param_groups[0]
    saved = {"lr": scheduler.base_lrs[0], **{k: group0[k] for k in wanted if k != "lr"}}
    if "betas" in saved:
        saved["betas"] = tuple(saved["betas"])
    changes = [
        f"optimizer.{key}: checkpoint {saved[key]} -> config {value}"
        for key, value in wanted.items()
        if saved[key] != value
    ]
    scheduler.base_lrs = [lr for _ in optimizer.param_groups]
    others = {k: v for k, v in wanted.items() if k != "lr"}
    for group, lr_lambda in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group.update(initial_lr=lr, lr=lr * lr_lambda(scheduler.last_epoch), **others)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    return changes
