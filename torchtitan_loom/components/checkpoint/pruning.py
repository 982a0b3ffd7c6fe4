"""CheckpointManager's pruning: once the proof policy (proof.py) has proven a committed checkpoint,
rank 0 prunes what ``keep_latest_k`` and ``snapshot_keep`` let go of older than it, and every
rank agrees on the outcome.
"""

from __future__ import annotations

import os

from torch.distributed.checkpoint.api import (
    CheckpointException,
)  # a BaseException, not an Exception

from torchtitan_loom.components.checkpoint import layout
from torchtitan_loom.components.checkpoint import state as ckstate
from torchtitan_loom.components.checkpoint.manager_parts import ManagerParts
from torchtitan_loom.components.checkpoint.proof import PROVE_STEPS
from torchtitan_loom.components.runtime import safe_files


class PruneMixin(ManagerParts):
    """CheckpointManager's pruning (uses its proof policy, _pruned_for and _pending, and the save
    path's wait() and _agree())."""

    def _note(self, step: int, healthy: bool, loss: float | None = None) -> None:
        """Step ``step`` went as ``healthy`` and ``loss`` say: tell the proof policy, then prune
        up to what it has proven."""
        self.proof.note(step, healthy, loss)
        self._prune()

    def _prune(self) -> None:
        """Once a committed checkpoint is proven, rank 0 prunes what is older than it. Every rank
        reaches the same decision (the health flags are agreed), so only a prune costs a
        broadcast: its outcome, agreed as a save's is."""
        p = self.proof.proven
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
