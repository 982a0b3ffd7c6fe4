"""CheckpointManager: when to save, the atomic save itself (sync or async), and resume.

The trainer builds it once everything Stateful exists, calls ``load()`` at the start of ``train()``,
``after_step(step, last=...)`` after every global step and ``close()`` at the end. See layout.py
for the folder, state.py for what is saved, resolve.py for which checkpoint is loaded.

Saved: "model" and "optimizer" (state.py), every object of ``states`` under its name (lr
schedule, data loader, spike guard, train state; each a state_dict/load_state_dict object) and
"rng". All of it is world-size independent: tensors by parameter name with global shapes, the
data cursor is global, the rest is replicated (DCP writes one copy).

RNG: the LOOM step draws no random numbers (no dropout; routing and capacity are
deterministic; the init uses its own per-parameter generators), so RNG does not shape the
trajectory today. Every rank seeds torch identically, so the saved RNG is one stream (torch's
CPU generator, plus the current CUDA generator on GPUs) restored on every rank; per-rank streams
are not kept, which is what makes it loadable at another world size.

The class is split by what each part does: saving.py (what is saved, the sync/async write and
its commit), proof.py (the pure proof policy: PROVE_STEPS healthy steps before a checkpoint may
prune older ones), pruning.py (the pruning it allows), loading.py (which checkpoint is resumed, the fallback, the restore).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchtitan_loom.components.checkpoint import layout, resolve
from torchtitan_loom.components.checkpoint.loading import LoadMixin
from torchtitan_loom.components.checkpoint.manager_parts import PendingSave
from torchtitan_loom.components.checkpoint.proof import PROVE_STEPS, ProofPolicy
from torchtitan_loom.components.checkpoint.pruning import PruneMixin
from torchtitan_loom.components.checkpoint.saving import SaveMixin, make_stager
from torchtitan_loom.components.runtime import safe_files

__all__ = ["ASYNC_MODES", "PROVE_STEPS", "CheckpointManager"]

from torchtitan_loom.components.checkpoint.modes import ASYNC_MODES


class CheckpointManager(PruneMixin, SaveMixin, LoadMixin):
    """Owns the run's checkpoint folder. A disabled manager (``cfg.enable`` false) does nothing.

    Args:
        cfg: the ``[checkpoint]`` config section.
        dump_folder: ``job.dump_folder``; checkpoints go to ``<dump_folder>/<cfg.folder>``.
        model, optimizer: saved through torch's DCP state-dict API (reshardable).
        states: name → object with ``state_dict()`` / ``load_state_dict()``, saved under its name.
        model_args, model_name, flavor: written next to each checkpoint and checked on load.
        config_toml: the resolved config, saved as ``config.toml`` in each checkpoint.
        total_steps: ``training.steps`` (the step whose checkpoint index.json calls "final").
    """

    def __init__(
        self,
        cfg: Any,
        *,
        dump_folder: str,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        states: dict[str, Any],
        model_args: Any,
        model_name: str,
        flavor: str,
        config_toml: str,
        total_steps: int,
        device: torch.device,
        rank: int = 0,
        world_size: int = 1,
        log: Callable[[str], None] = print,
    ) -> None:
        self.cfg, self.enabled = cfg, bool(cfg.enable)
        # Held from here: a folder swapped mid-run (a link to elsewhere) is refused, not written.
        self.root = safe_files.HeldFolder(
            resolve.checkpoint_root(dump_folder, cfg.folder),
            within=dump_folder if isinstance(dump_folder, safe_files.HeldFolder) else None,
        )
        self.model, self.optimizer, self.states = model, optimizer, dict(states)
        self.model_args, self.model_name, self.flavor = model_args, model_name, flavor
        self.config_toml, self.total_steps = config_toml, total_steps
        self.device, self.rank, self.world_size = torch.device(device), rank, world_size
        self._log = log
        self._distributed = (
            dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        )
        self._pending: PendingSave | None = None
        self.loaded_total_steps: int | None = None
        self.loaded_world_size: int | None = None  # the world size that saved the resumed step
        self._saved: dict[
            str, int
        ] = {}  # kind → the step last saved (or in flight) by this process
        self.proof = ProofPolicy()  # which checkpoint may prune older ones (pure, proof.py)
        self._pruned_for: int | None = None
        self._pg = None
        self._async = self.enabled and cfg.async_mode != "disabled"
        if self._async and self._distributed:
            self._pg = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=600))
        self.stager = None  # async_with_pinned_mem: the reused staging buffers
        if self._async and cfg.async_mode == "async_with_pinned_mem":
            self.stager = make_stager(self.device)

    # ------------------------------------------------------------------------------------ helpers
    def _barrier(self) -> None:
        if self._distributed:
            dist.barrier()

    def _policy(self) -> dict[str, Any]:
        c = self.cfg
        return {
            "interval": c.interval,
            "keep_latest_k": c.keep_latest_k,
            "snapshot_interval": c.snapshot_interval,
            "snapshot_keep": c.snapshot_keep,
            "async_mode": c.async_mode,
        }

    # ---------------------------------------------------------------------------------- save path
    def after_step(
        self,
        step: int,
        *,
        last: bool = False,
        stopping: bool = False,
        healthy: bool = False,
        loss: float | None = None,
    ) -> str | None:
        """Save what the policy asks for after global step ``step``; ``last``: no step follows in
        this process; ``stopping``: the run stops now (the stop signals decided), so this step is
        saved and the save finished; ``healthy`` and ``loss`` (the step's global loss): whether
        the step proves the checkpoints before it (proof.py). Returns the folder of that final
        save, else None."""
        if not self.enabled:
            return None
        self._note(step, healthy, loss)
        self._poll()
        c = self.cfg
        # One save per step: a stop that follows this step's save (a signal during it) saves nothing more.
        periodic = (
            bool(last or stopping or step % c.interval == 0) and self._saved.get("periodic") != step
        )
        snapshot = (
            bool(c.snapshot_interval and step % c.snapshot_interval == 0)
            and self._saved.get("snapshot") != step
        )
        if periodic or snapshot:
            self.save(step, periodic=periodic, snapshot=snapshot)
        if not stopping:
            return None
        self.wait()
        return layout.final_dir(self.root, step, "periodic")

    def newest(self) -> str | None:
        """The newest complete checkpoint on disk (rank 0's view), None when there is none."""
        entry = layout.scan(self.root).newest() if self.enabled else None
        return None if entry is None else entry.path

    def close(self) -> None:
        """Finish any in-flight save."""
        if self.enabled:
            self.wait()
        if self.stager is not None:
            self.stager.close()
            self.stager = None

    # ---------------------------------------------------------------------------------- load path
    def load(self) -> int | None:
        """Resume (or warm-start) as configured; returns the step resumed from, else None."""
        if not self.enabled:
            return None
        return self._load()
