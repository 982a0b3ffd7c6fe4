"""Per-segment loss-spike guard (LOOM_SPEC §7.4, with the §14 decision to checkpoint its state).

For each segment index j the guard keeps the loss of the last accepted step (prev_j) and an EMA
of accepted losses (ema_j). A segment whose loss jumps above its own EMA is skipped by the
trainer (gradients dropped, remaining segments abandoned, expert-bias update discarded).

The decision is a pure function of (loss, step, state), so every rank that feeds it the same
all-reduced loss reaches the same answer. Non-finite statistics never reach it: the run stops on
them first (optim/divergence.py, ``non_finite_statistic``, the one owner of that rule).
"""

from __future__ import annotations

from typing import Any


class SpikeGuard:
    """Decides whether a segment's optimizer step is taken; ``Stateful`` for DCP.

    Built from the ``[spike_guard]`` config section (its values and defaults are documented there):
    ``enable`` false = ``check`` always accepts; ``delta`` the
    absolute floor and ``rel`` the relative part of the adaptive threshold; skip when loss ≥
    base·(1 + ``ratio``) or loss − base ≥ ``hard``; ``ema`` the EMA decay (ema ← ema·decay +
    (1 − decay)·loss); for global steps ≤ ``warmup_steps`` nothing is skipped (the baselines are
    still updated by ``accept``, and ``breach`` still answers: a warm-up step that breaks a rule
    does not prove the checkpoint before it).
    """

    def __init__(self, section: Any) -> None:
        enabled, delta, rel, ratio = section.enable, section.delta, section.rel, section.ratio
        hard, ema, warmup_steps = section.hard, section.ema, section.warmup_steps
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"spike_guard.ema must be in [0, 1), got {ema}")
        if warmup_steps < 0:
            raise ValueError(f"spike_guard.warmup_steps must be >= 0, got {warmup_steps}")
        self.enabled = enabled
        self.delta, self.rel, self.ratio, self.hard = delta, rel, ratio, hard
        self.ema_decay = ema
        self.warmup_steps = warmup_steps
        self.prev: dict[int, float] = {}  # segment index → loss of the last accepted step
        self.ema: dict[int, float] = {}  # segment index → EMA of accepted losses

    def check(self, segment: int, loss: float, step: int) -> str | None:
        """Return None to accept the segment's step (always during warm-up), else a short reason
        for skipping it. ``loss`` is finite (the non-finite rule ran first)."""
        return None if step <= self.warmup_steps else self.breach(segment, loss)

    def breach(self, segment: int, loss: float) -> str | None:
        """The first rule a finite ``loss`` breaks, warm-up or not (§7.4; None: none, or disabled,
        or the first time this segment is seen). With base = ema (or prev) and Δ = loss − base:
        Δ ≥ hard; loss ≥ base·(1 + ratio); Δ ≥ max(delta, rel·base)."""
        _check_segment(segment)
        if not self.enabled:
            return None
        loss = float(loss)
        base = self.ema.get(segment, self.prev.get(segment))
        if base is None:
            return None  # no baseline yet for this segment
        d = loss - base
        if d >= self.hard:
            return f"hard: Δ={d:.4f}≥{self.hard}"
        if loss >= base * (1.0 + self.ratio):
            return f"ratio: loss={loss:.4f}≥{base * (1.0 + self.ratio):.4f}"
        limit = max(self.delta, self.rel * base)
        if d >= limit:
            return f"adaptive: Δ={d:.4f}≥{limit:.4f} (base {base:.4f})"
        return None

    def accept(self, segment: int, loss: float) -> None:
        """Record an accepted step (a finite loss): prev_j = loss, ema_j = decay·ema_j +
        (1 − decay)·loss. The EMA starts at the first accepted loss."""
        _check_segment(segment)
        loss = float(loss)
        self.prev[segment] = loss
        old = self.ema.get(segment)
        decay = self.ema_decay
        self.ema[segment] = loss if old is None else decay * old + (1.0 - decay) * loss

    def state_dict(self) -> dict[str, Any]:
        """Plain-python state: per-segment lists indexed by segment (None where unseen).

        Lists of floats are single leaves for DCP, so a fresh guard's (empty) state dict is a
        valid load template: the keys are fixed whatever segments have been seen. A dict keyed
        by segment would not reload, because DCP only fills keys present in the template.
        """
        n = 1 + max(list(self.prev) + list(self.ema), default=-1)
        return {
            "prev": [self.prev.get(j) for j in range(n)],
            "ema": [self.ema.get(j) for j in range(n)],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore baselines saved by ``state_dict`` (thresholds come from the config)."""
        for key in ("prev", "ema"):
            if key not in state_dict:
                raise KeyError(
                    f"spike guard state is missing {key!r}; got keys {sorted(state_dict)}"
                )
        self.prev = {j: float(v) for j, v in enumerate(state_dict["prev"]) if v is not None}
        self.ema = {j: float(v) for j, v in enumerate(state_dict["ema"]) if v is not None}


def _check_segment(segment: int) -> None:
    if not isinstance(segment, int) or segment < 0:
        raise ValueError(f"spike guard segment index must be an int >= 0, got {segment!r}")
