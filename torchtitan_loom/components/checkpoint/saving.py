"""The save path of CheckpointManager: what is saved, the atomic write (sync or async), the commit.

A save writes into a temporary folder and is committed by rank 0 (marker + rename, the snapshot
copy, the index) once every rank's data is written: its paths are one tree.SaveTarget, computed
once and carried from the write to the commit. A failed write removes the temporary folder, keeps
every older checkpoint and raises CheckpointSaveError. Pruning is not part of a save: it waits for
proof (proof.py).

Async (``checkpoint.async_mode = "async"``): ``dcp.async_save`` copies the state to CPU memory
before it returns (so the next optimizer step cannot race the staging) and writes in a background
thread over its own gloo group (a save on the default group while training runs collectives on
it aborts gloo). ``async_with_pinned_mem`` stages through one ``DefaultStager`` owned by the manager:
its CPU copies are allocated on the first save and reused by every later one (page-locked on CUDA,
filled by non-blocking copies), instead of fresh CPU tensors per save (on torch 2.11 a new stager
per save: see STAGER_SINGLE_USE). At most one save is in flight; rank 0 commits it (marker + rename) once its
future is done, which DCP reports only after every rank's data and the metadata are written.
A run that stops discards a save still in flight when it stopped for divergence or an error
(``discard``): nothing is committed or pruned after it.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import time
from concurrent.futures import Future
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import (
    CheckpointException,
)  # a BaseException, not an Exception

from torchtitan_loom.components.checkpoint import disk_space, integrity, names, resolve, tree
from torchtitan_loom.components.checkpoint import state as ckstate
from torchtitan_loom.components.checkpoint.manager_parts import ManagerParts, PendingSave
from torchtitan_loom.components.checkpoint.safe_write import SafeWriter
from torchtitan_loom.components.runtime import format_version, safe_files

_E = TypeVar("_E", bound=BaseException)


def found_in(exc: BaseException, kind: type[_E]) -> _E | None:
    """The first ``kind`` among ``exc``, its causes and contexts, and the failures DCP's
    CheckpointException carries (each rank's exception, which it wraps, never chains)."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, kind):
            return e
        if isinstance(e, CheckpointException):
            todo += [f[0] for f in e.failures.values() if isinstance(f, tuple) and f]
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
    return None


class _CommittedButIncomplete(Exception):
    """Rank 0 committed the checkpoint, then a later part of the save (its snapshot copy, the
    index, pruning) failed; ``what`` says exactly what is on disk."""

    def __init__(self, what: str, cause: BaseException) -> None:
        super().__init__(what)
        self.what, self.cause = what, cause


# torch 2.11's DefaultStager closes its StateDictStager after every stage, which empties the
# stager's copy table: a second save through it fails with KeyError: <class 'type'>. There each
# save gets a new stager (no buffer reuse); 2.13 reuses one across saves.
STAGER_SINGLE_USE = tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13)


def make_stager(device: torch.device):
    """The DCP stager of async_with_pinned_mem: page-locked, non-blocking copies on CUDA."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = device.type == "cuda"
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=cuda,
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=cuda,
        )
    )


class Writer:
    """CheckpointManager's save path over the manager's shared parts ``p``: it owns the save in
    flight (``pending``), the step last saved per kind, the async save's process group and the
    pinned-memory stager."""

    def __init__(self, parts: ManagerParts) -> None:
        self.p = parts
        self.pending: PendingSave | None = None  # the async save in flight
        self.saved: dict[str, int] = {}  # kind -> the step last saved (or in flight) here
        self.is_async = parts.enabled and parts.cfg.async_mode != "disabled"
        self.pg = None  # the async save's own gloo group (a save on the default group aborts gloo)
        if self.is_async and parts._distributed:
            self.pg = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=600))
        self.stager = None  # async_with_pinned_mem: the reused staging buffers
        if self.is_async and parts.cfg.async_mode == "async_with_pinned_mem":
            self.stager = make_stager(parts.device)

    def close(self) -> None:
        """Finish any in-flight save; release the stager."""
        if self.p.enabled:
            self.wait()
        if self.stager is not None:
            self.stager.close()
            self.stager = None

    def _collect(self) -> dict[str, Any]:
        """The state to save (tensors alias live ones; DCP or its stager copies them)."""
        sd: dict[str, Any] = {
            "model": ckstate.model_state(self.p.model),
            "optimizer": ckstate.optimizer_state(self.p.model, self.p.optimizer),
        }
        for name, obj in self.p.states.items():
            sd[name] = obj.state_dict()
        sd["rng"] = ckstate.rng_state(self.p.device)
        return sd

    def _write_sidecars(self, tmp: str, step: int) -> None:
        """Rank 0: the human/tool-readable files next to the DCP data."""
        safe_files.atomic_write(os.path.join(tmp, names.CONFIG_TOML), self.p.config_toml)
        tree.write_json(
            os.path.join(tmp, names.MODEL_ARGS_JSON),
            {
                "name": self.p.model_name,
                "flavor": self.p.flavor,
                "args": dataclasses.asdict(self.p.model_args),
            },
        )
        ts = self.p.states.get("train_state")
        tree.write_json(
            os.path.join(tmp, names.META_JSON),
            {
                format_version.KEY: resolve.FORMAT_VERSION,
                "step": step,
                "world_size": self.p.world_size,
                "torch": torch.__version__,
                "total_steps": self.p.total_steps,
                "optimizer": type(self.p.optimizer).__name__,  # a resume under another is refused
                "train_state": ts.state_dict() if ts is not None else None,
            },
        )

    def save(self, step: int, *, periodic: bool = True, snapshot: bool = False) -> None:
        """Save global step ``step`` as a periodic checkpoint and/or a snapshot (atomic). A model
        with a non-finite weight is never saved (logged instead). A failed write removes the
        temporary directory, keeps every older checkpoint and raises CheckpointSaveError."""
        self.wait()  # one save in flight at most
        bad = integrity.model_finite(self.p.model)
        if bad:
            self.p._log(f"warning: not saving step {step}: non-finite weights ({', '.join(bad)})")
            return
        target = tree.SaveTarget.of(self.p.root, step, "periodic" if periodic else "snapshot")
        try:
            self._save(target, periodic and snapshot)
            self.p.proof.saved(step)
            self.saved.update(
                {k: step for k, on in (("periodic", periodic), ("snapshot", snapshot)) if on}
            )
        except (ckstate.CheckpointError, ckstate.CheckpointSaveError):
            self.pending = None  # already said on every rank (_agree)
            raise
        except (
            Exception,
            CheckpointException,
        ) as exc:  # any write failure: clean up, say why, keep the rest
            self.pending = None
            self._failed(step, target.tmp, exc)

    def _needed_bytes(self) -> int:
        """About what a checkpoint takes: the newest one on disk, else this rank's state × ranks."""
        newest = tree.scan(self.p.root).newest()
        if newest is not None:
            return disk_space.dir_bytes(newest.path)
        local = sum(ckstate.local_nbytes(v) for v in self._collect().values())
        return local * self.p.world_size

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
        if found_in(exc, KeyboardInterrupt) is not None:  # Ctrl-C again mid-write: as promised,
            if self.p.rank == 0:  # stop without saving (launch.outcome_of: exit 130, stopped)
                try:
                    safe_files.remove_dir(tmp, self.p.root)
                except OSError:
                    pass  # a link or an unremovable directory: a .tmp- name is never loaded
            return KeyboardInterrupt()
        exc = found_in(exc, safe_files.UnsafePathError) or exc  # a link refused inside DCP's write
        if isinstance(exc, safe_files.UnsafePathError):
            return ckstate.CheckpointError(
                f"checkpoint step {step} not saved: {exc}; nothing pruned, the previous "
                f"checkpoints in {self.p.root} are untouched"
            )
        reason: str | None  # None: not a failure we can explain; the original error is raised
        if isinstance(exc, tree.IncompleteSave):  # its message says what is missing and why
            reason = str(exc)
        else:
            reason = disk_space.explain_write_failure(tmp, exc, self._needed_bytes())
        if self.p.rank == 0:
            try:
                safe_files.remove_dir(tmp, self.p.root)
            except OSError:
                pass  # a link or an unremovable directory: a .tmp- name is never loaded
        if reason is None:
            return exc
        return ckstate.CheckpointSaveError(
            f"checkpoint step {step} not saved: {reason}; the previous "
            f"checkpoints in {self.p.root} are untouched"
        )

    def _save(self, target: tree.SaveTarget, snapshot_too: bool) -> None:
        step, tmp = target.step, target.tmp
        error = None
        if self.p.rank == 0:
            try:
                safe_files.remove_dir(tmp, self.p.root)  # left by a save of this step that died
                safe_files.make_dirs(tmp, self.p.root)  # refuses a link on the way (snapshots/)
                self._write_sidecars(tmp, step)
            except (Exception, CheckpointException) as exc:
                error = self._final_error(step, tmp, exc)
        self.p._agree(error)  # the directory exists (and is clean) before any rank writes into it
        started = time.perf_counter()
        sd = self._collect()
        no_dist = not self.p._distributed
        if self.is_async:
            if self.stager is not None and STAGER_SINGLE_USE:
                self.stager.close()
                self.stager = make_stager(self.p.device)
            with ckstate.single_process_quiet():
                future = dcp.async_save(
                    sd,
                    checkpoint_id=tmp,
                    storage_writer=SafeWriter(tmp),
                    process_group=self.pg,
                    no_dist=no_dist,
                    async_stager=self.stager,
                )
            if not isinstance(future, Future):  # AsyncSaveResponse: make staging finish now too
                future.staging_completion.result()
                future = future.upload_completion
            self.pending = PendingSave(future, target, snapshot_too, started)
            return
        with ckstate.single_process_quiet():
            dcp.save(sd, checkpoint_id=tmp, storage_writer=SafeWriter(tmp), no_dist=no_dist)
        self.p._barrier()  # every rank finished writing
        error = None
        if self.p.rank == 0:
            try:
                self._commit(target, snapshot_too, started)
            except (Exception, CheckpointException) as exc:
                error = self._final_error(step, tmp, exc)
        self.p._agree(error)  # committed (or failed, on every rank) before anyone goes on

    def _commit(self, target: tree.SaveTarget, snapshot_too: bool, started: float) -> None:
        """Rank 0: marker + rename, the snapshot copy, index (pruning waits for proof: _prune)."""
        safe_files.check_held(
            self.p.root
        )  # the folder this run started in, not one swapped in since
        step = target.step
        marker = {
            "step": step,
            "kind": target.kind,
            "world_size": self.p.world_size,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        final = target.final
        tree.commit(target.tmp, final, marker)
        where, snap_exc = [final], None
        if snapshot_too:
            copy = tree.SaveTarget.of(self.p.root, step, "snapshot")
            snap, snap_tmp = copy.final, copy.tmp
            try:
                safe_files.make_dirs(os.path.dirname(snap), self.p.root)
                tree.clone(final, snap_tmp, snap, dict(marker, kind="snapshot"))
                where.append(snap)
            except (Exception, CheckpointException) as exc:
                snap_exc = exc
                try:
                    safe_files.remove_dir(snap_tmp, self.p.root)
                except OSError:
                    pass  # a link (refused) or unremovable: a .tmp- name is never loaded
        try:  # pruning is not part of a commit: it waits for proof (_prune)
            tree.write_index(self.p.root, self.p._policy(), final_step=self.p.total_steps)
        except (Exception, CheckpointException) as exc:
            raise _CommittedButIncomplete(
                self._incomplete_message(final, step, "index", exc, snap_exc), exc
            ) from exc
        if snap_exc is not None:
            self.p.proof.dropped(step)  # a save that did not finish prunes nothing
            raise _CommittedButIncomplete(
                self._incomplete_message(final, step, "done", None, snap_exc), snap_exc
            )
        took = time.perf_counter() - started
        self.p._log_routine(
            step, f"checkpoint step {step} saved to {', '.join(where)} in {took:.1f} s"
        )

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
        files = f"{tree.INDEX} and {tree.LAYOUT_MD}"
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

    def poll(self) -> None:
        if self.pending is not None and self.pending.future.done():
            self.wait()

    def wait(self) -> None:
        """Block until the in-flight async save (if any) is written and committed."""
        p, self.pending = self.pending, None
        if p is None:
            return
        try:
            p.future.result()  # re-raises a failed save
            if self.p.rank == 0:
                self._commit(p.target, p.snapshot_too, p.started)
        except (Exception, CheckpointException) as exc:  # as in save()
            self._failed(p.target.step, p.target.tmp, exc)

    def discard(self, *, wait: bool = False) -> int | None:
        """Never commit the save in flight (the run stops for divergence or an error); returns its
        step. ``wait``: let its writes end first, then remove its temporary folder (rank 0);
        without, a ``.tmp-`` folder may stay, which is never loaded."""
        p, self.pending = self.pending, None
        if p is None:
            return None
        self.p.proof.dropped(p.target.step)
        if wait:
            try:
                p.future.result()
            except (Exception, CheckpointException):
                pass  # discarded either way
            if self.p.rank == 0:
                try:
                    safe_files.remove_dir(p.target.tmp, self.p.root)
                except OSError:
                    pass  # a link or an unremovable folder: a .tmp- name is never loaded
        return p.target.step
