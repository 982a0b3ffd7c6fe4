"""What the parts of a CheckpointManager share, declared once: the run's checkpoint folder, what
is saved, the rank, the proof policy, and rank 0's outcome agreed on every rank. The manager
(manager.py) builds one and hands it to its writer (saving.py), resumer (loading.py) and pruner
(pruning.py), each an object over it; none of them derives from another.

Legend: none (no tensors here).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchtitan_loom.components.checkpoint import state as ckstate
from torchtitan_loom.components.checkpoint.proof import ProofPolicy
from torchtitan_loom.components.checkpoint.tree import SaveTarget
from torchtitan_loom.components.runtime.safe_files import HeldFolder


@dataclass
class PendingSave:
    """The async save in flight: its future and what it saves (committed when it completes)."""

    future: Any
    target: SaveTarget
    snapshot_too: bool
    started: float


@dataclass
class ManagerParts:
    """The state the save, load and prune paths share (built in CheckpointManager.__init__)."""

    cfg: Any  # the [checkpoint] config section
    enabled: bool
    root: HeldFolder  # <dump_folder>/<cfg.folder>, held from the launch
    model: nn.Module
    optimizer: torch.optim.Optimizer
    states: dict[str, Any]  # name -> a state_dict()/load_state_dict() object
    model_args: Any
    model_name: str
    flavor: str
    config_toml: str
    total_steps: int
    device: torch.device
    rank: int
    world_size: int
    _log: Callable[[str], None]
    _distributed: bool
    proof: ProofPolicy  # which checkpoint may prune older ones
    loaded_total_steps: int | None = None
    log_every: int = 1  # metrics.log_freq: the steps whose routine save and prune lines are said
    loaded_world_size: int | None = None  # the world size that saved the resumed step

    def _log_routine(self, step: int, line: str) -> None:
        """A periodic save or a prune that went as planned: said when saves are no more frequent
        than the step lines, else only at a step the console logs and the last step (a short study
        saving every 2 steps would bury its step lines); index.json lists every save."""
        every = self.log_every
        periodic = step % max(self.cfg.interval, 1) == 0 and step != self.total_steps
        if not periodic or every <= self.cfg.interval or step % every == 0:
            self._log(line)

    def _barrier(self) -> None:
        if self._distributed:
            dist.barrier()

    def _policy(self) -> dict[str, Any]:
        """The keep/interval settings index.json records."""
        c = self.cfg
        return {
            "interval": c.interval,
            "keep_latest_k": c.keep_latest_k,
            "snapshot_interval": c.snapshot_interval,
            "snapshot_keep": c.snapshot_keep,
            "async_mode": c.async_mode,
        }

    def _agree(self, error: BaseException | None) -> None:
        """Rank 0's outcome of a part of a save only it does (preparing the directory, the
        commit, a prune) on every rank, in place of a barrier: the same error is raised
        everywhere, so no rank is left waiting at the next collective for a rank 0 that stopped."""
        said = [None if error is None else (type(error).__name__, str(error))]
        if self._distributed:
            dist.broadcast_object_list(said, src=0)
        if error is not None:
            raise error
        if said[0] is not None:
            kind, msg = said[0]
            raise (
                ckstate.CheckpointSaveError
                if kind == "CheckpointSaveError"
                else ckstate.CheckpointError
            )(msg if kind.startswith("Checkpoint") else f"rank 0 failed to save: {kind}: {msg}")
