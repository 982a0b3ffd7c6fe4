"""What a training step leaves behind: the counters that survive a restart (TrainState, saved in
every checkpoint) and one step's record (StepResult, filled in as the step runs). The backprop
segments of the loops are ``protocols.segments``.

Legend: L layers, H loops, E routed experts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class StepAbandoned(Exception):
    """A stop signal was agreed before the step's first optimizer update."""


class TrainState:
    """Step counters that must survive a restart (Stateful). ``consecutive_skips`` is the spike
    guard's streak of skipped steps (optim/divergence.py): saved, so a resume does not reset it."""

    def __init__(self) -> None:
        self.step = 0
        self.tokens_seen = 0
        self.skipped_segments = 0
        self.consecutive_skips = 0

    def state_dict(self) -> dict[str, int]:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "skipped_segments": self.skipped_segments,
            "consecutive_skips": self.consecutive_skips,
        }

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.step, self.tokens_seen = int(sd["step"]), int(sd["tokens_seen"])
        # Absent from checkpoints written before the counters existed: they start at 0.
        self.skipped_segments = int(sd.get("skipped_segments", 0))
        self.consecutive_skips = int(sd.get("consecutive_skips", 0))


@dataclass
class StepResult:
    """What one global step did (``Trainer.train_step``), filled in segment by segment."""

    counts_LHE: torch.Tensor
    """int64 kept assignments per layer, loop and expert, summed over micro-batches and ranks."""
    lr: float
    seg_losses: list[float] = field(default_factory=list)
    """Global token-mean loss of every segment that ran (a skipped one included, then none after it)."""
    grad_norm: float | None = None
    """Pre-clip gradient norm of the last segment that stepped; None when no segment stepped."""
    skip_reason: str | None = None
    """Why a segment was skipped (the rest of the step with it), None when every segment stepped."""
    n_valid: float = 0.0
    """Valid target tokens of the global batch."""
    non_finite: str | None = None
    """Which statistic of which segment was non-finite (the run stops), None when all were finite."""
    healthy: bool = True
    """Every segment stepped and none broke a spike rule, warm-up or not: a step that proves the
    checkpoint before it (components/checkpoint/proof.py)."""
    diag: dict[str, float | None] | None = None
    """The branch diagnostics of a diagnostic step (components/observability/diagnostics.py), else None."""
    exit_scores: dict[str, torch.Tensor] | None = None
    """The learned exit head's loss and accuracy over the step (device tensors;
    components/exit_training.ExitTraining.scalars), None without a head."""
