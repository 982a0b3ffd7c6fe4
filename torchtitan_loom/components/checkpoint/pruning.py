"""The proof policy of CheckpointManager: when a checkpoint may prune older ones.

Pruning (``keep_latest_k``, ``snapshot_keep``) waits for proof: a checkpoint may make older ones
go only once the PROVE_STEPS steps right after it were healthy (StepResult.healthy: every segment
stepped, nothing non-finite, no spike rule broken, warm-up included) AND their losses stayed
within PROOF_LOSS_RATIO of a reference that an explosion cannot raise: the loss of the steps that
proved the newest proven checkpoint, or, before any proof in this launch, the loss of its first
step (computed from the weights it started with: the resumed checkpoint's, or the init's). The
spike guard's running average is no such reference: a finite explosion inside its warm-up feeds
the average and is judged healthy. The newest proven checkpoint and everything after it always
stay, so a saved explosion never takes the last good checkpoint with it.
"""

from __future__ import annotations

import os

from torch.distributed.checkpoint.api import (
    CheckpointException,
)  # a BaseException, not an Exception

from torchtitan_loom.components.checkpoint import layout
from torchtitan_loom.components.checkpoint import state as ckstate
from torchtitan_loom.components.runtime import safe_files

PROVE_STEPS = 2
"""Healthy steps that must follow a checkpoint before it may prune older ones: the first one's
loss is computed from exactly the saved weights, the second is the first update made from the
saved optimizer state (its moments). A step beyond them no longer tests what was saved."""


PROOF_LOSS_RATIO = 1.5
"""A proving step's loss above this multiple of the reference proves nothing. Training noise at a
fixed lr moves the loss by a few percent and a warm-up or decay by tens of percent; an explosion
multiplies it (seen: 3 -> 69). Above the ratio older checkpoints are only kept longer, never lost."""


class ProofMixin:
    """CheckpointManager's proof bookkeeping and pruning (uses its _unproven, _proven,
    _reference_loss, _pruned_for, _last_noted and _pending, and the save path's wait() and
    _agree())."""

    def _note(self, step: int, healthy: bool, loss: float | None = None) -> None:
        """Count step ``step`` (its global loss ``loss``) for every checkpoint still waiting for
        proof, each step once; every rank sees the same agreed values and decides alike."""
        if step <= self._last_noted:
            return
        self._last_noted = step
        if self._reference_loss is None and loss is not None:
            self._reference_loss = loss  # the launch's first step: its starting weights' loss
        within = loss is not None and loss <= PROOF_LOSS_RATIO * (self._reference_loss or loss)
        for saved in [s for s in self._unproven if s < step]:
            if not (healthy and within):  # a checkpoint followed by such a step never prunes
                del self._unproven[saved]
                continue
            self._unproven[saved] += 1
            if self._unproven[saved] >= PROVE_STEPS:
                del self._unproven[saved]
                if saved >= (self._proven or 0):
                    self._proven, self._reference_loss = saved, loss
        self._prune()

    def _prune(self) -> None:
        """Once a committed checkpoint is proven, rank 0 prunes what is older than it. Every rank
        reaches the same decision (the health flags are agreed), so only a prune costs a
        broadcast: its outcome, agreed as a save's is."""
        p = self._proven
        if p is None or p == self._pruned_for:
            return
        self._pruned_for = p
        if self._pending is not None and self._pending.step <= p:
            self.wait()  # its async save committed first (no collective: ranks may differ here)
        error = None
        if self.rank == 0:
            try:
                self._prune_upto(p)
            except (ckstate.CheckpointError, ckstate.CheckpointSaveError) as exc:
                error = exc
        self._agree(error)

    def _prune_upto(self, p: int) -> None:
        c = self.cfg
        try:
            deleted = layout.prune(self.root, c.keep_latest_k, c.snapshot_keep, upto_step=p)
        except safe_files.UnsafePathError as exc:
            raise ckstate.CheckpointError(f"nothing pruned: {exc}") from None
        if not deleted:
            return
        rel = ", ".join(os.path.relpath(d, self.root) for d in deleted)
        try:
            layout.write_index(self.root, self._policy(), final_step=self.total_steps)
        except (Exception, CheckpointException) as exc:
            refused = isinstance(exc, safe_files.UnsafePathError)
            raise (ckstate.CheckpointError if refused else ckstate.CheckpointSaveError)(
                f"pruned {rel} (checkpoint step {p} was proven by {PROVE_STEPS} healthy steps); "
                f"{layout.INDEX} and {layout.LAYOUT_MD} not rewritten after that ({exc}): they "
                f"still list {rel}; a resume reads the folder, not the index"
            ) from None
        self._log(f"checkpoint step {p} proven by {PROVE_STEPS} healthy steps: pruned {rel}")
