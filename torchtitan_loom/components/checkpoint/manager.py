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

Async (``checkpoint.async_mode = "async"``): ``dcp.async_save`` copies the state to CPU memory
before it returns (so the next optimizer step cannot race the staging) and writes in a background
thread over its own gloo group (a save on the default group while training runs collectives on
it aborts gloo). ``async_with_pinned_mem`` stages through one ``DefaultStager`` owned by the manager:
its CPU copies are allocated on the first save and reused by every later one (page-locked on CUDA,
filled by non-blocking copies), instead of fresh CPU tensors per save. At most one save is in flight; rank 0 commits it (marker + rename) once its
future is done, which DCP reports only after every rank's data and the metadata are written.

Pruning (``keep_latest_k``, ``snapshot_keep``) waits for proof: a checkpoint may make older ones
go only once the PROVE_STEPS steps right after it were healthy (StepResult.healthy: every segment
stepped, nothing non-finite, no spike rule broken, warm-up included). The newest proven
checkpoint and everything after it always stay, so a finite explosion that gets saved (inside
the spike guard's warm-up, say) never takes the last good checkpoint with it. A run that stops
discards a save still in flight when it stopped for divergence or an error (``discard``): nothing
is committed or pruned after it.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import (
    CheckpointException,
)  # a BaseException, not an Exception

from torchtitan_loom.components.runtime import safe_files
from torchtitan_loom.components.checkpoint import integrity, layout, resolve
from torchtitan_loom.components.checkpoint import state as ckstate


ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")
PROVE_STEPS = 2
"""Healthy steps that must follow a checkpoint before it may prune older ones: the first one's
loss is computed from exactly the saved weights, the second is the first update made from the
saved optimizer state (its moments). A step beyond them no longer tests what was saved."""


class _CommittedButIncomplete(Exception):
    """Rank 0 committed the checkpoint, then a later part of the save (its snapshot copy, the
    index, pruning) failed; ``what`` says exactly what is on disk."""

    def __init__(self, what: str, cause: BaseException) -> None:
        super().__init__(what)
        self.what, self.cause = what, cause


@dataclass
class _Pending:
    future: Any
    step: int
    kind: str
    snapshot_too: bool
    started: float


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
    ) -> None:
        self.cfg, self.enabled = cfg, bool(cfg.enable)
        self.root = resolve.checkpoint_root(dump_folder, cfg.folder)
        self.model, self.optimizer, self.states = model, optimizer, dict(states)
        self.model_args, self.model_name, self.flavor = model_args, model_name, flavor
        self.config_toml, self.total_steps = config_toml, total_steps
        self.device, self.rank, self.world_size = torch.device(device), rank, world_size
        self._log = log
        self._distributed = (
            dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        )
        self._pending: _Pending | None = None
        self.loaded_total_steps: int | None = None
        self.loaded_world_size: int | None = None  # the world size that saved the resumed step
        self._saved: dict[
            str, int
        ] = {}  # kind → the step last saved (or in flight) by this process
        self._unproven: dict[int, int] = {}  # saved step → healthy steps since (all so far)
        self._proven: int | None = None  # the newest checkpoint proven by PROVE_STEPS healthy steps
        self._pruned_for: int | None = None
        self._last_noted = 0
        self._pg = None
        self._async = self.enabled and cfg.async_mode != "disabled"
        if self._async and self._distributed:
            self._pg = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=600))
        self.stager = None  # async_with_pinned_mem: the reused staging buffers
        if self._async and cfg.async_mode == "async_with_pinned_mem":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = self.device.type == "cuda"
            self.stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda,
                    use_shared_memory=False,
                    use_async_staging=False,
                    use_non_blocking_copy=cuda,
                )
            )

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

    def _collect(self) -> dict[str, Any]:
        """The state to save (tensors alias live ones; DCP or its stager copies them)."""
        sd: dict[str, Any] = {
            "model": ckstate.model_state(self.model),
            "optimizer": ckstate.optimizer_state(self.model, self.optimizer),
        }
        for name, obj in self.states.items():
            sd[name] = obj.state_dict()
        sd["rng"] = ckstate.rng_state(self.device)
        return sd

    def _write_sidecars(self, tmp: str, step: int) -> None:
        """Rank 0: the human/tool-readable files next to the DCP data."""
        safe_files.atomic_write(os.path.join(tmp, "config.toml"), self.config_toml)
        layout.write_json(
            os.path.join(tmp, resolve.MODEL_ARGS_FILE),
            {
                "name": self.model_name,
                "flavor": self.flavor,
                "args": dataclasses.asdict(self.model_args),
            },
        )
        ts = self.states.get("train_state")
        layout.write_json(
            os.path.join(tmp, "meta.json"),
            {
                "step": step,
                "world_size": self.world_size,
                "torch": torch.__version__,
                "total_steps": self.total_steps,
                "train_state": ts.state_dict() if ts is not None else None,
            },
        )

    # ---------------------------------------------------------------------------------- save path
    def after_step(
        self, step: int, *, last: bool = False, stopping: bool = False, healthy: bool = False
    ) -> str | None:
        """Save what the policy asks for after global step ``step``; ``last``: no step follows in
        this process; ``stopping``: the run stops now (the stop signals decided), so this step is
        saved and the save finished; ``healthy``: the step proves the checkpoints before it.
        Returns the folder of that final save, else None."""
        if not self.enabled:
            return None
        self._note(step, healthy)
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

    def save(self, step: int, *, periodic: bool = True, snapshot: bool = False) -> None:
        """Save global step ``step`` as a periodic checkpoint and/or a snapshot (atomic). A model
        with a non-finite weight is never saved (logged instead). A failed write removes the
        temporary directory, keeps every older checkpoint and raises CheckpointSaveError."""
        self.wait()  # one save in flight at most
        bad = integrity.model_finite(self.model)
        if bad:
            self._log(f"warning: not saving step {step}: non-finite weights ({', '.join(bad)})")
            return
        kind = "periodic" if periodic else "snapshot"
        tmp = layout.temp_dir(self.root, step, kind)
        try:
            self._save(step, kind, tmp, periodic, snapshot)
            self._unproven[step] = 0
            self._saved.update(
                {k: step for k, on in (("periodic", periodic), ("snapshot", snapshot)) if on}
            )
        except (ckstate.CheckpointError, ckstate.CheckpointSaveError):
            self._pending = None  # already said on every rank (_agree)
            raise
        except (
            Exception,
            CheckpointException,
        ) as exc:  # any write failure: clean up, say why, keep the rest
            self._pending = None
            self._failed(step, tmp, exc)

    def _needed_bytes(self) -> int:
        """About what a checkpoint takes: the newest one on disk, else this rank's state × ranks."""
        newest = layout.scan(self.root).newest()
        if newest is not None:
            return layout.dir_bytes(newest.path)
        local = sum(ckstate.local_nbytes(v) for v in self._collect().values())
        return local * self.world_size

    def _failed(self, step: int, tmp: str, exc: BaseException) -> None:
        """A save failed: remove its temporary directory and raise CheckpointSaveError when the
        disk was full, CheckpointError when a planted link was refused (else re-raise)."""
        final = self._final_error(step, tmp, exc)
        if final is exc:
            raise exc
        raise final from None

    def _final_error(self, step: int, tmp: str, exc: BaseException) -> BaseException:
        """What ``_failed`` raises for ``exc`` (after removing the temporary directory)."""
        if isinstance(exc, _CommittedButIncomplete):
            refused = isinstance(exc.cause, safe_files.UnsafePathError)
            return (ckstate.CheckpointError if refused else ckstate.CheckpointSaveError)(exc.what)
        if isinstance(exc, safe_files.UnsafePathError):
            return ckstate.CheckpointError(
                f"checkpoint step {step} not saved: {exc}; nothing pruned, the previous "
                f"checkpoints in {self.root} are untouched"
            )
        reason = layout.explain_write_failure(tmp, exc, self._needed_bytes())
        if self.rank == 0:
            try:
                safe_files.remove_dir(tmp, self.root)
            except OSError:
                pass  # a link or an unremovable directory: a .tmp- name is never loaded
        if reason is None:
            return exc
        return ckstate.CheckpointSaveError(
            f"checkpoint step {step} not saved: {reason}; the previous "
            f"checkpoints in {self.root} are untouched"
        )

    def _agree(self, error: BaseException | None) -> None:
        """Rank 0's outcome of a part of a save only it does (preparing the directory, the
        commit) on every rank, in place of a barrier: the same error is raised everywhere, so no
        rank is left waiting at the next collective for a rank 0 that stopped."""
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

    def _save(self, step: int, kind: str, tmp: str, periodic: bool, snapshot: bool) -> None:
        error = None
        if self.rank == 0:
            try:
                safe_files.remove_dir(tmp, self.root)  # left by a save of this step that died
                safe_files.make_dirs(tmp, self.root)  # refuses a link on the way (snapshots/)
                self._write_sidecars(tmp, step)
            except (Exception, CheckpointException) as exc:
                error = self._final_error(step, tmp, exc)
        self._agree(error)  # the directory exists (and is clean) before any rank writes into it
        started = time.perf_counter()
        sd = self._collect()
        no_dist = not self._distributed
        if self._async:
            with ckstate.single_process_quiet():
                future = dcp.async_save(
                    sd,
                    checkpoint_id=tmp,
                    process_group=self._pg,
                    no_dist=no_dist,
                    async_stager=self.stager,
                )
            if not isinstance(future, Future):  # AsyncSaveResponse: make staging finish now too
                future.staging_completion.result()
                future = future.upload_completion
            self._pending = _Pending(future, step, kind, periodic and snapshot, started)
            return
        with ckstate.single_process_quiet():
            dcp.save(sd, checkpoint_id=tmp, no_dist=no_dist)
        self._barrier()  # every rank finished writing
        error = None
        if self.rank == 0:
            try:
                self._commit(step, kind, periodic and snapshot, started)
            except (Exception, CheckpointException) as exc:
                error = self._final_error(step, tmp, exc)
        self._agree(error)  # committed (or failed, on every rank) before anyone goes on

    def _commit(self, step: int, kind: str, snapshot_too: bool, started: float) -> None:
        """Rank 0: marker + rename, the snapshot copy, index (pruning waits for proof: _prune)."""
        marker = {
            "step": step,
            "kind": kind,
            "world_size": self.world_size,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        final = layout.final_dir(self.root, step, kind)
        layout.commit(layout.temp_dir(self.root, step, kind), final, marker)
        where, snap_exc = [final], None
        if snapshot_too:
            snap, snap_tmp = (
                f(self.root, step, "snapshot") for f in (layout.final_dir, layout.temp_dir)
            )
            try:
                safe_files.make_dirs(os.path.dirname(snap), self.root)
                layout.clone(final, snap_tmp, snap, dict(marker, kind="snapshot"))
                where.append(snap)
            except (Exception, CheckpointException) as exc:
                snap_exc = exc
                try:
                    safe_files.remove_dir(snap_tmp, self.root)
                except OSError:
                    pass  # a link (refused) or unremovable: a .tmp- name is never loaded
        try:  # pruning is not part of a commit: it waits for proof (_prune)
            layout.write_index(self.root, self._policy(), final_step=self.total_steps)
        except (Exception, CheckpointException) as exc:
            raise _CommittedButIncomplete(
                self._incomplete_message(final, step, "index", exc, snap_exc), exc
            ) from exc
        if snap_exc is not None:
            self._unproven.pop(step, None)  # a save that did not finish prunes nothing
            raise _CommittedButIncomplete(
                self._incomplete_message(final, step, "done", None, snap_exc), snap_exc
            )
        took = time.perf_counter() - started
        self._log(f"checkpoint step {step} saved to {', '.join(where)} in {took:.1f} s")

    def _incomplete_message(
        self,
        final: str,
        step: int,
        stage: str,
        exc: BaseException | None,
        snap_exc: BaseException | None,
    ) -> str:
        """Exactly what is on disk after a save whose commit succeeded and a later part failed
        (``stage``: "index" when the index could not be written, "done" when it was)."""
        parts = [f"checkpoint step {step} saved to {final} (complete: a resume loads it)"]
        if snap_exc is not None:
            parts.append(f"its snapshot was not saved ({snap_exc})")
        files = f"{layout.INDEX} and {layout.LAYOUT_MD}"
        if stage == "index":
            parts.append(f"{files} not rewritten ({exc}): they do not list step {step}")
        else:
            parts.append(f"{files} rewritten")
        parts += [
            "nothing pruned",
            "a resume reads the folder, not the index: fix that, then relaunch to resume from "
            f"step {step}",
        ]
        return "; ".join(parts)

    def _poll(self) -> None:
        if self._pending is not None and self._pending.future.done():
            self.wait()

    def wait(self) -> None:
        """Block until the in-flight async save (if any) is written and committed."""
        p, self._pending = self._pending, None
        if p is None:
            return
        tmp = layout.temp_dir(self.root, p.step, p.kind)
        try:
            p.future.result()  # re-raises a failed save
            if self.rank == 0:
                self._commit(p.step, p.kind, p.snapshot_too, p.started)
        except (Exception, CheckpointException) as exc:  # as in save()
            self._failed(p.step, tmp, exc)

    def discard(self, *, wait: bool = False) -> int | None:
        """Never commit the save in flight (the run stops for divergence or an error); returns its
        step. ``wait``: let its writes end first, then remove its temporary folder (rank 0);
        without, a ``.tmp-`` folder may stay, which is never loaded."""
        p, self._pending = self._pending, None
        if p is None:
            return None
        self._unproven.pop(p.step, None)
        if wait:
            try:
                p.future.result()
            except (Exception, CheckpointException):
                pass  # discarded either way
            if self.rank == 0:
                try:
                    safe_files.remove_dir(layout.temp_dir(self.root, p.step, p.kind), self.root)
                except OSError:
                    pass  # a link or an unremovable folder: a .tmp- name is never loaded
        return p.step

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
    def _decide(
        self, exclude: dict[str, str]
    ) -> tuple[Any, list[layout.Entry], list[str], str | None]:
        """Rank 0 picks (and verifies) the checkpoint; every rank gets the same answer or error."""
        payload: list[Any] = [None]
        if self.rank == 0:
            try:
                choice, found, skipped = resolve.choose(
                    self.root, self.cfg.load_step, self.cfg.initial_load_path, exclude=exclude
                )
                payload = [(choice, found.incomplete, skipped, None)]
            except ValueError as exc:
                payload = [(None, [], [], str(exc))]
        if self._distributed:
            dist.broadcast_object_list(payload, src=0)
        return payload[0]

    def load(self) -> int | None:
        """Resume (or warm-start) as configured; returns the step resumed from, else None."""
        if not self.enabled:
            return None
        return self._load()

    def _load(self) -> int | None:
        """Newest checkpoint that verifies (checksums, then finite weights once loaded); a failing
        one is skipped with a warning naming the file, unless it was asked for by load_step."""
        exclude: dict[str, str] = {}  # path → why it was refused once loading it began
        warned: set[str] = set()
        while True:
            choice, incomplete, skipped, error = self._decide(dict(exclude))
            if error:
                raise ckstate.CheckpointError(error)
            for line in [layout.incomplete_warning(incomplete)] + skipped:
                if line and line not in warned:  # each once, though the choice may be made again
                    warned.add(line)
                    self._log("warning: " + line)
            if choice is None:
                self._log(f"no checkpoint in {self.root}: starting from scratch")
                return None
            key = "initial_load_path" if choice.model_only else "load_step"
            asked = self.cfg.load_step >= 0 or choice.model_only  # no other one to fall back on
            self._log(f"loading checkpoint {choice.path} ...")
            try:
                step = self._load_choice(choice)
            except ckstate.CheckpointUnreadable as exc:  # a refused entry, a read that failed
                if asked:
                    raise ckstate.CheckpointError(f"checkpoint.{key}: {exc}; refused") from None
                exclude[choice.path] = str(exc)
                continue
            bad = integrity.model_finite(self.model)
            if not bad:
                break
            if asked:
                raise ckstate.CheckpointError(
                    f"checkpoint.{key}: {choice.path} holds non-finite weights "
                    f"({', '.join(bad)}); refused"
                )
            exclude[choice.path] = "refused after loading (non-finite weights)"
        if step is not None:
            self._unproven[step], self._last_noted = 0, step  # the steps after it prove it
        if step is not None and self.rank == 0:
            moved = layout.abandon_newer(self.root, step)
            if moved:
                self._log(
                    f"moved the checkpoints newer than step {step} ({', '.join(moved)}) to "
                    f"{os.path.join(self.root, layout.ABANDONED)}: kept, never loaded or overwritten"
                )
        return step

    def _load_choice(self, choice: resolve.LoadChoice) -> int | None:
        started = time.perf_counter()
        meta = ckstate.read_metadata(choice.path)
        lines = resolve.compat_errors(
            choice.path,
            self.model_name,
            self.flavor,
            self.model_args,
            ckstate.model_shapes(self.model),
            resume=not choice.model_only,
        )
        if lines:
            raise ckstate.CheckpointError(
                resolve.explain(choice.path, choice.step, lines, resume=not choice.model_only)
            )
        if choice.model_only:
            self._load_model_only(choice.path)
            self._log(
                f"warm start: model weights from {choice.path} (optimizer, schedule, data and step "
                f"start fresh) in {time.perf_counter() - started:.1f} s"
            )
            return None
        self._load_full(choice.path, meta)
        saved = layout.read_json(os.path.join(choice.path, "meta.json")) or {}
        self.loaded_total_steps = saved.get(
            "total_steps"
        )  # training.steps of the run that saved it
        ws = self.loaded_world_size = saved.get("world_size")
        moved = (
            f", saved at {ws} ranks, now {self.world_size}" if ws and ws != self.world_size else ""
        )
        self._log(
            f"resumed from {choice.path} (step {choice.step}{moved}) "
            f"in {time.perf_counter() - started:.1f} s"
        )
        return choice.step

    def _load_model_only(self, path: str) -> None:
        sd = {"model": ckstate.model_state(self.model)}
        ckstate.dcp_load(sd, path, no_dist=not self._distributed)
        ckstate.set_model_state(self.model, sd["model"])

    def _load_full(self, path: str, meta: dict[str, Any]) -> None:
        keys = set(meta)
        opt = ckstate.OptimizerLoad(self.model, self.optimizer, keys, "optimizer.")
        sd: dict[str, Any] = {"model": ckstate.model_state(self.model), "optimizer": opt.template()}
        for name, obj in self.states.items():
            # Keys a newer version added are left at their defaults (load_state_dict handles them).
            tmpl = {
                k: v
                for k, v in obj.state_dict().items()
                if f"{name}.{k}" in keys or any(x.startswith(f"{name}.{k}.") for x in keys)
            }
            if not tmpl:
                raise ckstate.CheckpointError(f"checkpoint {path} holds no '{name}' state")
            sd[name] = tmpl
        sd["rng"] = {k: v for k, v in ckstate.rng_state(self.device).items() if f"rng.{k}" in keys}
        ckstate.dcp_load(sd, path, no_dist=not self._distributed)
        ckstate.set_model_state(self.model, sd["model"])
        opt.apply(sd["optimizer"])
        for name, obj in self.states.items():
            try:
                obj.load_state_dict(sd[name])
            except (
                ValueError,
                KeyError,
            ) as exc:  # e.g. the data loader refuses another global batch size
                raise ckstate.CheckpointError(
                    f"checkpoint {path}: cannot restore '{name}': {exc}"
                ) from None
        # The trainer loads right before its loop, so nothing after this can advance the stream.
        ckstate.set_rng_state(sd["rng"], self.device)
