"""Per-segment loss-spike guard (LOOM_SPEC §7.4, with the §14 decision to checkpoint its state,
and one departure: a rise inside the loss's own noise is no spike).

For each segment index j the guard keeps the loss of the last accepted step (prev_j), an EMA of
accepted losses (ema_j), and the loss's batch-to-batch noise σ_j: var_j, an EMA of half the
squared change between consecutive accepted losses (n_j changes in it). The change, not the
deviation from ema_j: a steady descent keeps the loss below its lagging EMA by ~9 steps' worth of
the descent, which would read as noise; the change between two steps carries one step's worth. A segment whose loss jumps above its
own EMA is skipped by the trainer (gradients dropped, remaining segments abandoned, expert-bias
update discarded).

Why the noise: the spec's thresholds are fixed fractions of the EMA, tuned for 1M-token batches,
where the loss moves by ~1% from batch to batch. At 4 rows of 64 tokens it moves by ~25% (σ 0.25
at loss 1.1), so the fixed rules skipped ordinary batches, the skips slowed learning, and a
healthy run was stopped as diverged. The ratio and adaptive rules now skip only a rise of at
least ``noise_sigmas``·σ_j as well; at a large batch k·σ is below the fixed thresholds and the
rules are the spec's. The hard rule ignores the noise: an explosion (a rise ≥ ``hard``) is
skipped however noisy the loss.

The decision is a pure function of (loss, step, state), so every rank that feeds it the same
all-reduced loss reaches the same answer. Non-finite statistics never reach it: the run stops on
them first (optim/divergence.py, ``non_finite_statistic``, the one owner of that rule).
"""

from __future__ import annotations

import math
from typing import Any


class SpikeGuard:
    """Decides whether a segment's optimizer step is taken; ``Stateful`` for DCP.

    Built from the ``[spike_guard]`` config section (its values and defaults are documented there):
    ``enable`` false = ``check`` always accepts; ``delta`` the
    absolute floor and ``rel`` the relative part of the adaptive threshold; skip when loss ≥
    base·(1 + ``ratio``) or loss − base ≥ ``hard``; ``ema`` the EMA decay (ema ← ema·decay +
    (1 − decay)·loss); ``noise_sigmas`` k and ``noise_ema`` the noise floor k·σ under the ratio
    and adaptive rules; for global steps ≤ ``warmup_steps`` nothing is skipped (the baselines are
    still updated by ``accept``, and ``breach`` still answers: a warm-up step that breaks a rule
    does not prove the checkpoint before it).
    """

    def __init__(self, section: Any) -> None:
        enabled, delta, rel, ratio = section.enable, section.delta, section.rel, section.ratio
        hard, ema, warmup_steps = section.hard, section.ema, section.warmup_steps
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"spike_guard.ema must be in [0, 1), got {ema}")
        if not 0.0 <= section.noise_ema < 1.0:
            raise ValueError(f"spike_guard.noise_ema must be in [0, 1), got {section.noise_ema}")
        if warmup_steps < 0:
            raise ValueError(f"spike_guard.warmup_steps must be >= 0, got {warmup_steps}")
        self.enabled = enabled
        self.delta, self.rel, self.ratio, self.hard = delta, rel, ratio, hard
        self.ema_decay = ema
        self.sigmas, self.noise_decay = section.noise_sigmas, section.noise_ema
        self.warmup_steps = warmup_steps
        self.prev: dict[int, float] = {}  # segment index → loss of the last accepted step
        self.ema: dict[int, float] = {}  # segment index → EMA of accepted losses
        self.var: dict[int, float] = {}  # segment index → EMA of (loss − prev)²/2, from 0
        self.n: dict[int, int] = {}  # segment index → changes in var (its start bias removed)

    def check(self, segment: int, loss: float, step: int) -> str | None:
        """Return None to accept the segment's step (always during warm-up), else a short reason
        for skipping it. ``loss`` is finite (the non-finite rule ran first)."""
        return None if step <= self.warmup_steps else self.breach(segment, loss)

    def noise(self, segment: int) -> float:
        """σ_j: the segment loss's measured batch-to-batch noise (0 before two accepted losses).
        For independent noise of σ, consecutive losses differ by σ·√2 (hence the half)."""
        n = self.n.get(segment, 0)
        if n == 0:
            return 0.0
        return math.sqrt(self.var[segment] / (1.0 - self.noise_decay**n))

    def breach(self, segment: int, loss: float) -> str | None:
        """The first rule a finite ``loss`` breaks, warm-up or not (§7.4; None: none, or disabled,
        or the first time this segment is seen). With base = ema (or prev), Δ = loss − base and
        the noise floor f = k·σ: Δ ≥ hard; loss ≥ base·(1 + ratio) and Δ ≥ f;
        Δ ≥ max(delta, rel·base, f)."""
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
        floor = self.sigmas * self.noise(segment)
        noise = f", {self.sigmas:g}σ={floor:.4f}" if floor > 0 else ""
        if loss >= base * (1.0 + self.ratio) and d >= floor:
            return f"ratio: loss={loss:.4f}≥{base * (1.0 + self.ratio):.4f}{noise}"
        limit = max(self.delta, self.rel * base, floor)
        if d >= limit:
            return f"adaptive: Δ={d:.4f}≥{limit:.4f} (base {base:.4f}{noise})"
        return None

    def accept(self, segment: int, loss: float) -> None:
        """Record an accepted step (a finite loss): prev_j = loss, ema_j = decay·ema_j +
        (1 − decay)·loss, and (loss − the old prev_j)²/2 into var_j. The EMA starts at the first
        accepted loss, var_j at 0 (``noise`` removes that start's bias)."""
        _check_segment(segment)
        loss = float(loss)
        last = self.prev.get(segment)
        self.prev[segment] = loss
        old = self.ema.get(segment)
        decay = self.ema_decay
        self.ema[segment] = loss if old is None else decay * old + (1.0 - decay) * loss
        if last is not None:
            v, nd = self.var.get(segment, 0.0), self.noise_decay
            self.var[segment] = nd * v + (1.0 - nd) * 0.5 * (loss - last) ** 2
            self.n[segment] = self.n.get(segment, 0) + 1

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
            "var": [self.var.get(j) for j in range(n)],
            "n": [self.n.get(j) for j in range(n)],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore baselines saved by ``state_dict`` (thresholds come from the config). A
        checkpoint from before the noise was measured has no ``var``/``n``: it is measured anew."""
        for key in ("prev", "ema"):
            if key not in state_dict:
                raise KeyError(
                    f"spike guard state is missing {key!r}; got keys {sorted(state_dict)}"
                )
        self.prev = {j: float(v) for j, v in enumerate(state_dict["prev"]) if v is not None}
        self.ema = {j: float(v) for j, v in enumerate(state_dict["ema"]) if v is not None}
        var, n = state_dict.get("var", []), state_dict.get("n", [])
        self.var = {j: float(v) for j, v in enumerate(var) if v is not None}
        self.n = {j: int(c) for j, c in enumerate(n) if c is not None and j in self.var}
        self.var = {j: v for j, v in self.var.items() if j in self.n}


def _check_segment(segment: int) -> None:
    if not isinstance(segment, int) or segment < 0:
        raise ValueError(f"spike guard segment index must be an int >= 0, got {segment!r}")
