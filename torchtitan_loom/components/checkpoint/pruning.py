"""CheckpointManager's pruning: once the proof policy (proof.py) has proven a committed checkpoint,
rank 0 prunes what ``keep_latest_k`` and ``snapshot_keep`` let go of older than it, and every
rank agrees on the outcome.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from torch.distributed.checkpoint.api import (
    CheckpointException,
)  # a BaseException, not an Exception

from torchtitan_loom.components.checkpoint import state as ckstate
from torchtitan_loom.components.checkpoint import tree
from torchtitan_loom.components.checkpoint.manager_parts import ManagerParts
from torchtitan_loom.components.checkpoint.proof import PROVE_STEPS
from torchtitan_loom.components.checkpoint.saving import Writer
from torchtitan_loom.components.runtime import safe_files


class Pruner:
    """CheckpointManager's pruning over the shared parts ``p`` and the ``writer`` (a save in
    flight is committed before anything older is pruned)."""

    def __init__(self, parts: ManagerParts, writer: Writer) -> None:
        self.p, self.writer = parts, writer
        self.pruned_for: int | None = None  # the proven step pruning last ran for

    def note(self, step: int, healthy: bool, losses: Sequence[float] = ()) -> None:
        """Step ``step`` went as ``healthy`` and ``losses`` (its segment losses) say: tell the
        proof policy, then prune up to what it has proven."""
        self.p.proof.note(step, healthy, losses)
        self._prune()

    def _prune(self) -> None:
        """Once a committed checkpoint is proven, rank 0 prunes what is older than it. Every rank
        reaches the same decision (the health flags are agreed), so only a prune costs a
        broadcast: its outcome, agreed as a save's is."""
        p = self.p.proof.proven
        if p is None or p == self.pruned_for:
            return
        self.pruned_for = p
        if self.writer.pending is not None and self.writer.pending.target.step <= p:
            self.writer.wait()  # its async save committed first (no collective: ranks may differ here)
        error = None
        if self.p.rank == 0:
            try:
                self._prune_upto(p)
            except (ckstate.CheckpointError, ckstate.CheckpointSaveError) as exc:
                error = exc
        self.p._agree(error)

    def _prune_upto(self, p: int) -> None:
        c = self.p.cfg
        try:
            deleted = tree.prune(self.p.root, c.keep_latest_k, c.snapshot_keep, upto_step=p)
        except safe_files.UnsafePathError as exc:
            raise ckstate.CheckpointError(f"nothing pruned: {exc}") from None
        if not deleted:
            return
        rel = ", ".join(os.path.relpath(d, self.p.root) for d in deleted)
        try:
            tree.write_index(self.p.root, self.p._policy(), final_step=self.p.total_steps)
        except (Exception, CheckpointException) as exc:
            refused = isinstance(exc, safe_files.UnsafePathError)
            raise (ckstate.CheckpointError if refused else ckstate.CheckpointSaveError)(
                f"pruned {rel} (checkpoint step {p} was proven by {PROVE_STEPS} healthy steps); "
                f"{tree.INDEX} and {tree.LAYOUT_MD} not rewritten after that ({exc}): they "
                f"still list {rel}; a resume reads the folder, not the index"
            ) from None
        self.p._log_routine(
            p, f"checkpoint step {p} proven by {PROVE_STEPS} healthy steps: pruned {rel}"
        )
