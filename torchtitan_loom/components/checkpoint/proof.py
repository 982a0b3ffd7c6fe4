"""The proof policy, pure: which checkpoint has been proven by the steps after it, so that it may
prune older ones. No files, no collectives: the CheckpointManager tells it what was saved (or
resumed, or dropped) and how each step went, and prunes up to ``proven`` (pruning.py).

A checkpoint is proven once the PROVE_STEPS steps right after it were healthy
(StepResult.healthy: every segment stepped, nothing non-finite, no spike rule broken, warm-up
included) AND every segment loss of theirs stayed within PROOF_LOSS_RATIO of a reference that an
explosion cannot raise: a loss measured before any update it could come from. Before any proof in
this launch that is the first segment's loss of the launch's first step (computed from the
weights it started with, the resumed checkpoint's or the init's, before the launch's first
update); after a proof, the first segment's loss of the step that completed it (computed from
weights that were just proven). A step's last segment is no such reference: with several
backprop segments it comes after the step's own updates (an lr-10 resume: segments 3.4 / 362 /
285). Nor is the spike guard's running average: a finite explosion inside its warm-up feeds it.
The newest proven checkpoint and everything after it always stay, so a saved explosion never
takes the last good checkpoint with it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

PROVE_STEPS = 2
"""Healthy steps that must follow a checkpoint before it may prune older ones: the first one's
loss is computed from exactly the saved weights, the second is the first update made from the
saved optimizer state (its moments). A step beyond them no longer tests what was saved."""


PROOF_LOSS_RATIO = 1.5
"""A proving step whose worst segment loss is above this multiple of the reference proves nothing.
Batch-to-batch noise moves the loss by a few percent at a large batch and by ~25% at 4 rows of 64
tokens, a warm-up or decay by tens of percent; an explosion multiplies it (seen: 3 -> 69,
3.4 -> 362). Above the ratio older checkpoints are only kept longer, never lost."""


class ProofPolicy:
    """Bookkeeping of the checkpoints waiting for proof, fed in step order; every rank feeds the
    same agreed values and so reaches the same ``proven``."""

    def __init__(self) -> None:
        self.unproven: dict[int, int] = {}  # saved step -> healthy steps since (all so far)
        self.proven: int | None = None  # the newest checkpoint proven by PROVE_STEPS steps
        self.reference_loss: float | None = None  # what a proving step's losses are held against
        self.last_noted = 0

    def saved(self, step: int) -> None:
        """A checkpoint of ``step`` was written (or is being written): the steps after it prove it."""
        self.unproven[step] = 0

    def dropped(self, step: int) -> None:
        """The save of ``step`` did not finish: it proves and prunes nothing."""
        self.unproven.pop(step, None)

    def resumed(self, step: int) -> None:
        """This launch starts from the checkpoint of ``step``: the steps after it prove it."""
        self.unproven[step], self.last_noted = 0, step

    def note(self, step: int, healthy: bool, losses: Sequence[float]) -> None:
        """Count step ``step`` for every checkpoint still waiting, each step once; ``losses``: the
        step's global segment losses in order (the first computed before any update of the step).
        A checkpoint followed by an unhealthy or exploded step never proves."""
        if step <= self.last_noted:
            return
        self.last_noted = step
        start = losses[0] if losses else None
        if self.reference_loss is None and start is not None and math.isfinite(start):
            self.reference_loss = start  # the launch's first step, before the launch's first update
        ref = self.reference_loss
        within = bool(losses) and ref is not None and max(losses) <= PROOF_LOSS_RATIO * ref
        for saved in [s for s in self.unproven if s < step]:
            if not (healthy and within):
                del self.unproven[saved]
                continue
            self.unproven[saved] += 1
            if self.unproven[saved] >= PROVE_STEPS:
                del self.unproven[saved]
                if saved >= (self.proven or 0):
                    self.proven, self.reference_loss = saved, start
