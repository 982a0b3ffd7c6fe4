"""What a CheckpointManager is made of, declared once: the attributes manager.py sets and the
methods each part (saving.py, loading.py, pruning.py) offers the others. The parts derive from
``ManagerParts``, so each one reads only what is declared here (a type checker holds them to it).

Legend: none (no tensors here).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchtitan_loom.components.checkpoint.proof import ProofPolicy
from torchtitan_loom.components.runtime.safe_files import HeldFolder


@dataclass
class PendingSave:
    """The async save in flight: its future and what it saves (committed when it completes)."""

    future: Any
    step: int
    kind: str
    snapshot_too: bool
    started: float


class ManagerParts:
    """The state shared by the save, load and prune paths (set in CheckpointManager.__init__)."""

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
    _pending: PendingSave | None  # the async save in flight
    loaded_total_steps: int | None
    loaded_world_size: int | None  # the world size that saved the resumed step
    _saved: dict[str, int]  # kind -> the step last saved (or in flight) by this process
    proof: ProofPolicy  # which checkpoint may prune older ones
    _pruned_for: int | None
    _pg: Any  # the async save's own gloo group, or None
    _async: bool
    stager: Any  # async_with_pinned_mem: the reused staging buffers, or None

    # Offered by one part to the others (manager.py, saving.py).
    def _barrier(self) -> None:
        raise NotImplementedError

    def _policy(self) -> dict[str, Any]:
        raise NotImplementedError

    def wait(self) -> None:
        raise NotImplementedError

    def _agree(self, error: BaseException | None) -> None:
        raise NotImplementedError
