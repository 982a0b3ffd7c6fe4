"""Learning-rate schedules: warmup-stable-decay (LOOM_SPEC §7.1) and warmup + cosine.

Both are expressed as a multiplier of the peak learning rate, ``lr_scale(s)``, for the 1-based
index ``s`` of the global step being computed. The trainer sets the lr once per global step;
every segment of that step uses the same lr.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from torchtitan_loom.components.optim.choices import LR_KINDS as VALID_KINDS


def lr_scale(
    step: int,
    *,
    total_steps: int,
    warmup_ratio: float,
    decay_ratio: float,
    min_ratio: float,
    kind: str = "wsd",
) -> float:
    """Multiplier of the peak lr for the 1-based global step ``step``.

    With T = total_steps, W_u = max(1, round(T·warmup_ratio)), D = round(T·decay_ratio):

    - both kinds: s < W_u → s / W_u (the first step already uses 1/W_u).
    - ``"wsd"`` (§7.1): with start = max(T − D, W_u), for s ≥ start the scale falls linearly
      from 1 to ``min_ratio`` at s = T (p = clamp((s − start)/(T − start), 0, 1),
      scale = 1 + (min_ratio − 1)·p); in between it is 1.
    - ``"cosine"``: for s ≥ W_u, p = clamp((s − W_u)/(T − W_u), 0, 1) and
      scale = min_ratio + (1 − min_ratio)·(1 + cos(π·p))/2, i.e. a half cosine from the peak at
      s = W_u to ``min_ratio`` at s = T. ``decay_ratio`` is not used by the cosine kind.

    Steps past T hold ``min_ratio``.
    """
    if kind not in VALID_KINDS:
        raise ValueError(f"lr_scheduler.kind must be one of {VALID_KINDS}, got {kind!r}")
    if total_steps < 1:
        raise ValueError(f"training.steps (total_steps) must be >= 1, got {total_steps}")
    if step < 1:
        raise ValueError(f"lr_scale step is 1-based, got {step}")

    warmup = max(1, round(total_steps * warmup_ratio))
    if step < warmup:
        return step / warmup

    if kind == "wsd":
        start = max(total_steps - round(total_steps * decay_ratio), warmup)
        if step < start:
            return 1.0
        p = _progress(step, start, total_steps)
        return 1.0 + (min_ratio - 1.0) * p

    p = _progress(step, warmup, total_steps)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))


def _progress(step: int, start: int, end: int) -> float:
    """Fraction of the way from ``start`` to ``end``, clamped to [0, 1]."""
    if end <= start:  # empty decay window: the schedule is already at its end
        return 1.0
    return min(1.0, max(0.0, (step - start) / (end - start)))


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    total_steps: int,
    warmup_ratio: float,
    decay_ratio: float,
    min_ratio: float,
    kind: str = "wsd",
) -> LambdaLR:
    """Wrap ``lr_scale`` in a ``LambdaLR`` over the optimizer's current lr (the peak).

    LambdaLR's internal counter starts at 0 and counts ``.step()`` calls, i.e. completed global
    steps, so the multiplier for counter c is ``lr_scale(c + 1)``: right after construction the
    optimizer holds peak·scale(1), and after the trainer calls ``.step()`` at the end of global
    step s it holds peak·scale(s + 1) for the next step.

    The schedule's shape comes from the arguments (the config) and is not saved: the lambda is a
    plain closure, so ``state_dict()`` holds only LambdaLR's own progress fields (last_epoch,
    base_lrs, _last_lr, ...), all plain python.
    """
    # Validate eagerly so a bad kind fails at build time, not at the first step.
    lr_scale(
        1,
        total_steps=total_steps,
        warmup_ratio=warmup_ratio,
        decay_ratio=decay_ratio,
        min_ratio=min_ratio,
        kind=kind,
    )

    def multiplier(completed_steps: int) -> float:
        return lr_scale(
            completed_steps + 1,
            total_steps=total_steps,
            warmup_ratio=warmup_ratio,
            decay_ratio=decay_ratio,
            min_ratio=min_ratio,
            kind=kind,
        )

    return LambdaLR(optimizer, lr_lambda=multiplier)


def extension_note(section: Any, saved_total: int, total: int, next_step: int) -> str:
    """One line for a resume whose training.steps changed: the schedule is a function of the total, so
    the next step's lr comes from the schedule over the new total (``section``: ``[lr_scheduler]``)."""
    shape = dict(
        warmup_ratio=section.warmup_ratio,
        decay_ratio=section.decay_ratio,
        min_ratio=section.min_ratio,
        kind=section.kind,
    )
    new = lr_scale(next_step, total_steps=total, **shape)
    old = lr_scale(next_step, total_steps=saved_total, **shape)  # past its total: the final lr
    return (
        f"resume: training.steps {saved_total} → {total}: the {section.kind} lr schedule is recomputed over "
        f"{total} steps, so step {next_step} runs at {new:.3g} × the peak lr (the saved schedule was at "
        f"{old:.3g} ×; its warmup and decay phases move with the new total)"
    )
