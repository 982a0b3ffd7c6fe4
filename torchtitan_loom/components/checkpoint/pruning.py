"""The proof policy of CheckpointManager: when a checkpoint may prune older ones.

Pruning (``keep_latest_k``, ``snapshot_keep``) waits for proof: a checkpoint may make older ones
go only once the PROVE_STEPS steps right after it were healthy (StepResult.healthy: every segment
stepped, nothing non-finite, no spike rule broken, warm-up included). The newest proven
checkpoint and everything after it always stay, so a finite explosion that gets saved (inside
the spike guard's warm-up, say) never takes the last good checkpoint with it.
"""

from __future__ import annotations

import os

from torch.distributed.checkpoint.api import (
    CheckpointException,
)  # a BaseException, not an Exception

from torchtitan_loom.components.runtime import safe_files
from torchtitan_loom.components.checkpoint import layout
from torchtitan_loom.components.checkpoint import state as ckstate


PROVE_STEPS = 2
"""Healthy steps that must follow a checkpoint before it may prune older ones: the first one's
loss is computed from exactly the saved weights, the second is the first update made from the
saved optimizer state (its moments). A step beyond them no longer tests what was saved."""


class ProofMixin:
    """CheckpointManager's proof bookkeeping and pruning (uses its _unproven, _proven,
    _pruned_for, _last_noted and _pending, and the save path's wait() and _agree())."""

    def _note(self, step: int, healthy: bool) -> None:
        """Count step ``step`` for every checkpoint still waiting for proof (each step once)."""
        if step <= self._last_noted:
            return
        self._last_noted = step
        for saved in [s for s in self._unproven if s < step]:
            if not healthy:  # a checkpoint followed by an unhealthy step never prunes
                del self._unproven[saved]
                continue
            self._unproven[saved] += 1
            if self._unproven[saved] >= PROVE_STEPS:
                del self._unproven[saved]
                self._proven = max(self._proven or 0, saved)
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
        deleted = layout.prune(self.root, c.keep_latest_k, c.snapshot_keep, upto_step=p)
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
