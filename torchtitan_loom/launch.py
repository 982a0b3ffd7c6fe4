"""A launch of the trainer, around the Trainer: arguments → config → checks → run folder → process
group → train, and every exception that is a known way to end mapped to its Outcome
(``outcome_of``: status, exit code from components/runtime/exit_codes.py, message).

``run(argv, trainer_cls)`` is what ``python -m torchtitan_loom.train`` calls. Errors of what the run
was given (config, data, checkpoint, run folder) print one line per problem on stderr, prefixed by
their kind, and exit 2 before or instead of training. Once the trainer exists, ``Trainer.train``
ends the launch itself from its Outcome; ``record_end`` writes run.json's final status for it.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Any

from torchtitan_loom.components.checkpoint import CheckpointError
from torchtitan_loom.components.checkpoint.state import CheckpointSaveError
from torchtitan_loom.components.data import PackError
from torchtitan_loom.components.runtime import exit_codes
from torchtitan_loom.components.runtime.outcome import Outcome, Status
from torchtitan_loom.components.runtime.messages import shorten, shorten_line
from torchtitan_loom.components.runtime.safe_files import UnsafePathError
from torchtitan_loom.components.runtime.run_folder import (
    RunFolderError,
    RunLock,
    new_run_id,
    record_launch,
    replace_old_run,
)
from torchtitan_loom.config import ConfigError, help_text, to_toml
from torchtitan_loom.config.validate import load_and_resolve
from torchtitan_loom.distributed import utils as dist_utils


def _errors(kind: str, exc: BaseException) -> int:
    for line in str(exc).splitlines():
        print(shorten_line(f"{kind} error: {line}"), file=sys.stderr)
    return exit_codes.BAD_INPUT


def run(argv: list[str], trainer_cls: Any) -> int:
    """Check, launch and train; returns the process exit code."""
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return exit_codes.OK
    check_only = "--check-config" in argv
    argv = [a for a in argv if a != "--check-config"]
    try:
        cfg, resolved = load_and_resolve(
            argv, lambda c: c.parallelism.dry_run_world_size or dist_utils.world_size_from_env()
        )
    except ConfigError as exc:
        return _errors("config", exc)
    if check_only:  # run_train.sh checks the config for the whole world before starting ranks
        return exit_codes.OK
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if cfg.parallelism.dry_run:  # the layout for world_size ranks, in this one process
        from torchtitan_loom.distributed.dry_run import dry_run

        if rank0:
            print(dry_run(cfg, *resolved))
        return exit_codes.OK
    run_id, lock = new_run_id(), None
    if rank0:  # before any process group: one live run per folder
        try:
            os.makedirs(cfg.job.dump_folder, exist_ok=True)
            lock = RunLock(
                cfg.job.dump_folder,
                run_id,
                log=lambda m: print(f"[torchtitan_loom] {m}", flush=True),
            )
            replace_old_run(cfg)
        except (RunFolderError, OSError) as exc:
            if lock is not None:
                lock.release()
            print(shorten_line(f"run folder error: {exc}"), file=sys.stderr)
            return exit_codes.BAD_INPUT
    info = dist_utils.init_distributed(cfg.training.device, timeout_s=cfg.comm.init_timeout_seconds)
    finished = False
    try:
        if info.world_size > 1:  # rank 0's launch id for every rank's metrics
            run_id = dist_utils.broadcast_object(run_id)
        code = _train(cfg, resolved, info, run_id, trainer_cls)
        finished = True
        return code
    finally:
        dist_utils.destroy_distributed(wait_for_all=finished)
        if lock is not None:
            lock.release()


def _train(
    cfg: Any, resolved: Any, info: dist_utils.DistInfo, run_id: str, trainer_cls: Any
) -> int:
    os.makedirs(cfg.job.dump_folder, exist_ok=True)
    if cfg.job.print_config and info.rank == cfg.metrics.log_rank:
        print(to_toml(cfg))
    try:
        trainer = trainer_cls(cfg, resolved, info, run_id=run_id)
    except BaseException as exc:  # before run.json says running: it stays as it was
        outcome = outcome_of(exc)
        if outcome is None:
            raise
        print(outcome.message, file=sys.stderr)
        return outcome.exit_code
    return trainer.train()  # ends the launch itself: its last line and run.json's status


def _lines(kind: str, exc: BaseException) -> str:
    return "\n".join(shorten_line(f"{kind} error: {line}") for line in str(exc).splitlines())


def outcome_of(exc: BaseException) -> Outcome | None:
    """The Outcome of an exception that ends a launch in a known way; None for anything else (a
    bug: the caller re-raises it, with its traceback)."""
    if isinstance(exc, CheckpointSaveError):  # disk full during a save: older checkpoints stay
        msg = shorten_line(f"checkpoint error: {exc}")
        return Outcome(Status.FAILED, exit_codes.FAILED, msg, error=True)
    if isinstance(exc, CheckpointError):  # a checkpoint that does not fit this run
        return Outcome(Status.FAILED, exit_codes.BAD_INPUT, _lines("checkpoint", exc), error=True)
    if isinstance(exc, UnsafePathError):  # a link planted where the run writes, since the launch
        return Outcome(Status.FAILED, exit_codes.BAD_INPUT, _lines("run folder", exc), error=True)
    if isinstance(exc, PackError):  # a pack that does not fit this run
        return Outcome(Status.FAILED, exit_codes.BAD_INPUT, _lines("data", exc), error=True)
    if isinstance(exc, KeyboardInterrupt):  # SIGINT twice, or once with checkpoints off
        msg = "interrupted (SIGINT): stopped without saving"
        return Outcome(Status.STOPPED, exit_codes.INTERRUPTED, msg, error=True)
    if isinstance(exc, OSError):  # a file of the run could not be written: a full disk, say
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        what = "disk full" if full else "i/o error"
        where = f" writing {shorten(exc.filename)}" if exc.filename else ""
        msg = f"{what}{where}: {exc.strerror or exc}"
        return Outcome(Status.FAILED, exit_codes.FAILED, msg, error=True)
    return None


def record_end(cfg: Any, run_id: str, status: str, step: int) -> None:
    """run.json's status at the end of a launch that recorded itself as running (rank 0)."""
    try:
        record_launch(cfg, run_id, status, step)
    except OSError as exc:  # the disk that ended the run is still full: say so, keep the exit code
        print(f"warning: run.json not updated to {status!r}: {exc}", file=sys.stderr)
