"""The save path of CheckpointManager: what is saved, the atomic write (sync or async), the commit.

A save writes into a temporary folder (layout.temp_dir) and is committed by rank 0 (marker +
rename, the snapshot copy, the index) once every rank's data is written; a failed write removes
the temporary folder, keeps every older checkpoint and raises CheckpointSaveError. Pruning is not
part of a save: it waits for proof (proof.py).

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
import os
import time
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import (
    CheckpointException,
)  # a BaseException, not an Exception

from torchtitan_loom.components.checkpoint import integrity, layout, resolve
from torchtitan_loom.components.checkpoint import state as ckstate
from torchtitan_loom.components.checkpoint.manager_parts import ManagerParts, PendingSave
from torchtitan_loom.components.checkpoint.safe_write import SafeWriter
from torchtitan_loom.components.runtime import safe_files


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


class SaveMixin(ManagerParts):
    """CheckpointManager's save path (manager.py builds the attributes it uses: cfg, root, model,
    optimizer, states, rank, world_size, _pending, _saved, proof, _pg, stager, _log, ...)."""

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
                "optimizer": type(self.optimizer).__name__,  # a resume under another is refused
                "train_state": ts.state_dict() if ts is not None else None,
            },
        )

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
            self.proof.saved(step)
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
        reason: str | None  # None: not a failure we can explain; the original error is raised
        if isinstance(exc, layout.IncompleteSave):  # its message says what is missing and why
            reason = str(exc)
        else:
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
            if self.stager is not None and STAGER_SINGLE_USE:
                self.stager.close()
                self.stager = make_stager(self.device)
            with ckstate.single_process_quiet():
                future = dcp.async_save(
                    sd,
                    checkpoint_id=tmp,
                    storage_writer=SafeWriter(tmp),
                    process_group=self._pg,
                    no_dist=no_dist,
                    async_stager=self.stager,
                )
            if not isinstance(future, Future):  # AsyncSaveResponse: make staging finish now too
                future.staging_completion.result()
                future = future.upload_completion
            self._pending = PendingSave(future, step, kind, periodic and snapshot, started)
            return
        with ckstate.single_process_quiet():
            dcp.save(sd, checkpoint_id=tmp, storage_writer=SafeWriter(tmp), no_dist=no_dist)
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
        safe_files.check_held(self.root)  # the folder this run started in, not one swapped in since
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
            self.proof.dropped(step)  # a save that did not finish prunes nothing
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
        self.proof.dropped(p.step)
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
