"""A launch of the trainer, around the Trainer: arguments → config → checks → run folder → process
group → train, and every way it ends mapped to its exit code (components/runtime/exit_codes.py).

``run(argv, trainer_cls)`` is what ``python -m torchtitan_loom.train`` calls. Errors of what the run
was given (config, data, checkpoint, run folder) print one line per problem on stderr, prefixed by
their kind, and exit 2 before or instead of training.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from torchtitan_loom.components.runtime import exit_codes
from torchtitan_loom.components.checkpoint import CheckpointError
from torchtitan_loom.components.checkpoint.state import CheckpointSaveError
from torchtitan_loom.components.data import PackError
from torchtitan_loom.components.observability.progress import final_line
from torchtitan_loom.components.runtime.messages import shorten_line
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
    trainer = None
    try:
        trainer = trainer_cls(cfg, resolved, info, run_id=run_id)
        code = trainer.train()
    except CheckpointError as exc:  # a checkpoint that does not fit this run
        _record_end(
            trainer, "failed"
        )  # a refused resume recorded nothing: run.json stays as it was
        return _errors("checkpoint", exc)
    except UnsafePathError as exc:  # a link planted where the run writes, since the launch check
        _record_end(trainer, "failed")
        return _errors("run folder", exc)
    except PackError as exc:  # a pack that does not fit this run
        _record_end(trainer, "failed")
        return _errors("data", exc)
    except (
        CheckpointSaveError,
        KeyboardInterrupt,
    ) as exc:  # disk full; or SIGINT twice / checkpoints off
        if (
            trainer is not None
        ):  # no waiting on an in-flight save: put the handlers back, close the files
            trainer.stop_signals.close()
            trainer.metrics.close()
        if isinstance(exc, KeyboardInterrupt):
            _record_end(trainer, "stopped")
            print("interrupted (SIGINT): stopped without saving", file=sys.stderr)
            return exit_codes.INTERRUPTED
        _record_end(trainer, "failed")
        print(
            shorten_line(f"checkpoint error: {exc}"), file=sys.stderr
        )  # the older checkpoints are untouched
        return exit_codes.FAILED
    except BaseException:
        _record_end(trainer, "failed")
        raise
    trainer.log(final_line(trainer.state.step, code, cfg.job.dump_folder, trainer.held_out.last))
    done = code == exit_codes.OK and trainer.state.step >= cfg.training.steps
    # train() returns BAD_INPUT only for a divergence abort (every other refusal is an exception).
    _record_end(
        trainer, "finished" if done else "diverged" if code == exit_codes.BAD_INPUT else "stopped"
    )
    return code


def _record_end(trainer: Any, status: str) -> None:
    """run.json's status at the end of a launch that recorded itself as running (rank 0): finished,
    stopped (resumable: a signal, exit_after_step, Ctrl-C twice), diverged (exit 2) or failed."""
    if trainer is None or not trainer.launch_recorded:
        return
    try:
        record_launch(trainer.cfg, trainer.run_id, status, trainer.state.step)
    except (
        OSError
    ) as exc:  # e.g. the disk that ended the run is still full: say so, keep the exit code
        print(f"warning: run.json not updated to {status!r}: {exc}", file=sys.stderr)
