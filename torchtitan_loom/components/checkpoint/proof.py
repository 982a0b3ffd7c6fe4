"""The proof policy, pure: which checkpoint has been proven by the steps after it, so that it may
prune older ones. No files, no collectives: the CheckpointManager tells it what was saved (or
resumed, or dropped) and how each step went, and prunes up to ``proven`` (pruning.py).

A checkpoint is proven once the PROVE_STEPS steps right after it were healthy
(StepResult.healthy: every segment stepped, nothing non-finite, no spike rule broken, warm-up
included) AND their losses stayed within PROOF_LOSS_RATIO of a reference that an explosion cannot
raise: the loss of the steps that proved the newest proven checkpoint, or, before any proof in
this launch, the loss of its first step (computed from the weights it started with: the resumed
checkpoint's, or the init's). The spike guard's running average is no such reference: a finite
explosion inside its warm-up feeds the average and is judged healthy. The newest proven
checkpoint and everything after it always stay, so a saved explosion never takes the last good
checkpoint with it.
"""

from __future__ import annotations

PROVE_STEPS = 2
"""Healthy steps that must follow a checkpoint before it may prune older ones: the first one's
loss is computed from exactly the saved weights, the second is the first update made from the
saved optimizer state (its moments). A step beyond them no longer tests what was saved."""


PROOF_LOSS_RATIO = 1.5
"""A proving step's loss above this multiple of the reference proves nothing. Training noise at a
fixed lr moves the loss by a few percent and a warm-up or decay by tens of percent; an explosion
multiplies it (seen: 3 -> 69). Above the ratio older checkpoints are only kept longer, never lost."""


class ProofPolicy:
    """Bookkeeping of the checkpoints waiting for proof, fed in step order; every rank feeds the
    same agreed values and so reaches the same ``proven``."""

    def __init__(self) -> None:
        self.unproven: dict[int, int] = {}  # saved step -> healthy steps since (all so far)
        self.proven: int | None = None  # the newest checkpoint proven by PROVE_STEPS steps
        self.reference_loss: float | None = None  # what a proving step's loss is held against
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

    def note(self, step: int, healthy: bool, loss: float | None) -> None:
        """Count step ``step`` (its global loss ``loss``) for every checkpoint still waiting, each
        step once; a checkpoint followed by an unhealthy or exploded step never proves."""
        if step <= self.last_noted:
            return
        self.last_noted = step
        if self.reference_loss is None and loss is not None:
            self.reference_loss = loss  # the launch's first step: its starting weights' loss
        within = loss is not None and loss <= PROOF_LOSS_RATIO * (self.reference_loss or loss)
        for saved in [s for s in self.unproven if s < step]:
            if not (healthy and within):
                del self.unproven[saved]
                continue
            self.unproven[saved] += 1
            if self.unproven[saved] >= PROVE_STEPS:
                del self.unproven[saved]
                if saved >= (self.proven or 0):
                    self.proven, self.reference_loss = saved, loss
