"""CheckpointManager: when to save, the atomic save itself (sync or async), and resume.

The trainer builds it once everything Stateful exists, calls ``load()`` at the start of ``train()``,
``after_step(step, last=...)`` after every global step and ``close()`` at the end. See tree.py
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

The manager is a facade over objects that each do one thing, over the state they share
(manager_parts.ManagerParts): the writer (saving.py: what is saved, the sync/async write and its
commit), the resumer (loading.py: which checkpoint is resumed, the fallback, the restore), the
pruner (pruning.py: the pruning a proof allows) and the pure proof policy (proof.py: PROVE_STEPS
healthy steps before a checkpoint may prune older ones).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchtitan_loom.components.checkpoint import resolve, tree
from torchtitan_loom.components.checkpoint.loading import Resumer
from torchtitan_loom.components.checkpoint.manager_parts import ManagerParts
from torchtitan_loom.components.checkpoint.modes import ASYNC_MODES
from torchtitan_loom.components.checkpoint.proof import PROVE_STEPS, ProofPolicy
from torchtitan_loom.components.checkpoint.pruning import Pruner
from torchtitan_loom.components.checkpoint.saving import Writer
from torchtitan_loom.components.runtime import safe_files

__all__ = ["ASYNC_MODES", "PROVE_STEPS", "CheckpointManager"]


class CheckpointManager:
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
        log_every: int = 1,
    ) -> None:
        self.parts = ManagerParts(
            cfg=cfg,
            enabled=bool(cfg.enable),
            # Held from here: a folder swapped mid-run (a link to elsewhere) is refused, not written.
            root=safe_files.HeldFolder(
                resolve.checkpoint_root(dump_folder, cfg.folder),
                within=dump_folder if isinstance(dump_folder, safe_files.HeldFolder) else None,
            ),
            model=model,
            optimizer=optimizer,
            states=dict(states),
            model_args=model_args,
            model_name=model_name,
            flavor=flavor,
            config_toml=config_toml,
            total_steps=total_steps,
            device=torch.device(device),
            rank=rank,
            world_size=world_size,
            _log=log,
            _distributed=dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size() > 1,
            log_every=log_every,
            proof=ProofPolicy(),  # which checkpoint may prune older ones (pure, proof.py)
        )
        self.writer = Writer(self.parts)
        self.resumer = Resumer(self.parts)
        self.pruner = Pruner(self.parts, self.writer)

    # ------------------------------------------------------------------- what callers read
    @property
    def enabled(self) -> bool:
        return self.parts.enabled

    @property
    def root(self) -> safe_files.HeldFolder:
        return self.parts.root

    @property
    def loaded_total_steps(self) -> int | None:
        return self.parts.loaded_total_steps

    @property
    def loaded_world_size(self) -> int | None:
        """The world size that saved the resumed step."""
        return self.parts.loaded_world_size

    @property
    def stager(self) -> Any:
        return self.writer.stager

    # ---------------------------------------------------------------------------------- save path
    def after_step(
        self,
        step: int,
        *,
        last: bool = False,
        stopping: bool = False,
        healthy: bool = False,
        losses: Sequence[float] = (),
    ) -> str | None:
        """Save what the policy asks for after global step ``step``; ``last``: no step follows in
        this process; ``stopping``: the run stops now (the stop signals decided), so this step is
        saved and the save finished; ``healthy`` and ``losses`` (the step's global segment
        losses, in order): whether the step proves the checkpoints before it (proof.py). Returns the folder of that final
        save, else None."""
        if not self.enabled:
            return None
        self.pruner.note(step, healthy, losses)
        w = self.writer
        w.poll()
        c = self.parts.cfg
        # One save per step: a stop that follows this step's save (a signal during it) saves nothing more.
        periodic = (
            bool(last or stopping or step % c.interval == 0) and w.saved.get("periodic") != step
        )
        snapshot = (
            bool(c.snapshot_interval and step % c.snapshot_interval == 0)
            and w.saved.get("snapshot") != step
        )
        if periodic or snapshot:
            w.save(step, periodic=periodic, snapshot=snapshot)
        if not stopping:
            return None
        w.wait()
        return tree.SaveTarget.of(self.root, step, "periodic").final

    def save(self, step: int, *, periodic: bool = True, snapshot: bool = False) -> None:
        """Save step ``step`` now (saving.Writer.save)."""
        self.writer.save(step, periodic=periodic, snapshot=snapshot)

    def wait(self) -> None:
        """Block until the in-flight async save (if any) is written and committed."""
        self.writer.wait()

    def discard(self, *, wait: bool = False) -> int | None:
        """Never commit the save in flight (saving.Writer.discard); returns its step."""
        return self.writer.discard(wait=wait)

    def newest(self) -> str | None:
        """The newest complete checkpoint on disk (rank 0's view), None when there is none."""
        entry = tree.scan(self.root).newest() if self.enabled else None
        return None if entry is None else entry.path

    def close(self) -> None:
        """Finish any in-flight save."""
        self.writer.close()

    # ---------------------------------------------------------------------------------- load path
    def load(self) -> int | None:
        """Resume (or warm-start) as configured; returns the step resumed from, else None."""
        if not self.enabled:
            return None
        return self.resumer.load()
