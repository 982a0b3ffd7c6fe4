"""What a training step leaves behind: the counters that survive a restart (TrainState, saved in
every checkpoint) and one step's result (StepResult). The backprop segments of the loops are
``protocols.segments``.

Legend: L layers, H loops, E routed experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class StepAbandoned(Exception):
    """A stop signal arrived before the step's first optimizer update."""


class TrainState:
    """Step counters that must survive a restart (Stateful)."""

    def __init__(self) -> None:
        self.step = 0
        self.tokens_seen = 0
        self.skipped_segments = 0

    def state_dict(self) -> dict[str, int]:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "skipped_segments": self.skipped_segments,
        }

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.step, self.tokens_seen = int(sd["step"]), int(sd["tokens_seen"])
        self.skipped_segments = int(sd.get("skipped_segments", 0))


@dataclass
class StepResult:
    """What one global step did (``Trainer.train_step``)."""

    seg_losses: list[float]
    """Global token-mean loss of every segment that ran (a skipped one included, then none after it)."""
    grad_norm: float | None
    """Pre-clip gradient norm of the last segment that stepped; None when no segment stepped."""
    lr: float
    skip_reason: str | None
    """Why a segment was skipped (the rest of the step with it), None when every segment stepped."""
    counts_LHE: torch.Tensor
    """int64 kept assignments per layer, loop and expert, summed over micro-batches and ranks."""
    n_valid: float
    """Valid target tokens of the global batch."""
    non_finite: str | None = None
    """Which statistic of which segment was non-finite (the run stops), None when all were finite."""
    diag: dict[str, float | None] | None = None
    """The branch diagnostics of a diagnostic step (components/observability/diagnostics.py), else None."""
