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

from torchtitan_loom.components.checkpoint import CheckpointError, layout
from torchtitan_loom.components.checkpoint.resolve import checkpoint_root
from torchtitan_loom.components.checkpoint.state import CheckpointSaveError
from torchtitan_loom.components.data import PackError
from torchtitan_loom.components.observability.progress import final_line
from torchtitan_loom.components.runtime import exit_codes
from torchtitan_loom.components.runtime.messages import shorten_line
from torchtitan_loom.components.runtime.preemption import ElasticRestarts
from torchtitan_loom.components.runtime.run_folder import (
    RunFolderError,
    RunLock,
    new_run_id,
    record_launch,
    replace_old_run,
)
from torchtitan_loom.components.runtime.safe_files import UnsafePathError
from torchtitan_loom.config import ConfigError, help_text, load_config, to_toml
from torchtitan_loom.config.validate import load_and_resolve, resolve
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
    checks = [a for a in argv if a == "--check-config" or a.startswith("--check-config=")]
    argv = [a for a in argv if a not in checks]
    try:
        if checks and checks[-1].startswith("--check-config="):
            return _check_world_sizes(argv, checks[-1].split("=", 1)[1])
        cfg, resolved = load_and_resolve(
            argv, lambda c: c.parallelism.dry_run_world_size or dist_utils.world_size_from_env()
        )
    except ConfigError as exc:
        return _errors("config", exc)
    if checks:  # run_train.sh checks the config for the whole world before starting ranks
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
                elastic_run=ElasticRestarts.from_env(os.environ).elastic_run,
            )
            replace_old_run(cfg)
        except (RunFolderError, OSError) as exc:
            if lock is not None:
                lock.release()
            print(shorten_line(f"run folder error: {exc}"), file=sys.stderr)
            return exit_codes.BAD_INPUT
    info = dist_utils.init_distributed(cfg.training.device, timeout_s=cfg.comm.init_timeout_seconds)
    peers_alive = False
    try:
        if info.world_size > 1:  # rank 0's launch id for every rank's metrics
            run_id = dist_utils.broadcast_object(run_id)
        code, peers_alive = _train(cfg, resolved, info, run_id, trainer_cls)
        return code
    finally:  # no barrier with a lost peer, nor after an error (the others may never reach it)
        dist_utils.destroy_distributed(wait_for_all=peers_alive)
        if lock is not None:
            lock.release()


def _check_world_sizes(argv: list[str], sizes: str) -> int:
    """``--check-config=W,W,...`` (run_train.sh's elastic mode): the config at every world size a
    restart may bring, before any rank starts; on success prints the absolute dump folder (the
    default rendezvous id is derived from it)."""
    try:
        worlds = [int(w) for w in sizes.split(",")]
    except ValueError:
        worlds = []
    if not worlds or min(worlds) < 1:
        print(
            f"config error: --check-config={sizes}: expected world sizes ≥ 1, e.g. 8,16",
            file=sys.stderr,
        )
        return exit_codes.BAD_INPUT
    try:
        cfg = load_config(argv)
    except ConfigError:  # every problem of the keys and values at once, as for one world size
        return _errors("config", _config_error(argv, worlds[0]))
    if cfg.job.overwrite:
        print(
            "config error: job.overwrite: an elastic run would move its own files aside at every "
            "restart; start a fresh run in a new job.dump_folder instead",
            file=sys.stderr,
        )
        return exit_codes.BAD_INPUT
    failed = 0
    for world in worlds:
        try:
            resolve(cfg, world)
        except ConfigError as exc:
            failed += 1
            for line in str(exc).splitlines():
                print(shorten_line(f"config error: at world size {world}: {line}"), file=sys.stderr)
            if failed == 3:
                break
    if failed:
        print(
            "config error: an elastic run restarts at any of the world sizes "
            f"{', '.join(map(str, worlds))}: leave the degrees free (parallelism.dp_shard = -1) "
            "and make training.global_batch_size divisible at each",
            file=sys.stderr,
        )
        return exit_codes.BAD_INPUT
    print(os.path.abspath(cfg.job.dump_folder))
    return exit_codes.OK


def _config_error(argv: list[str], world: int) -> ConfigError:
    try:
        load_and_resolve(argv, lambda _: world)
    except ConfigError as exc:
        return exc
    raise AssertionError("load_config refused what load_and_resolve accepts")


def _train(
    cfg: Any, resolved: Any, info: dist_utils.DistInfo, run_id: str, trainer_cls: Any
) -> tuple[int, bool]:
    """Train; returns the exit code and whether every peer is still there to say goodbye to."""
    os.makedirs(cfg.job.dump_folder, exist_ok=True)
    if cfg.job.print_config and info.rank == cfg.metrics.log_rank:
        print(to_toml(cfg))
    trainer = None
    try:
        trainer = trainer_cls(cfg, resolved, info, run_id=run_id)
        trainer.resume()
        _log_elastic_restart(trainer, info)
        code = trainer.train()
    except CheckpointError as exc:  # a checkpoint that does not fit this run
        _record_end(
            trainer, "failed"
        )  # a refused resume recorded nothing: run.json stays as it was
        return _errors("checkpoint", exc), False
    except UnsafePathError as exc:  # a link planted where the run writes, since the launch check
        _record_end(trainer, "failed")
        return _errors("run folder", exc), False
    except PackError as exc:  # a pack that does not fit this run
        _record_end(trainer, "failed")
        return _errors("data", exc), False
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
            return exit_codes.INTERRUPTED, False
        _record_end(trainer, "failed")
        print(
            shorten_line(f"checkpoint error: {exc}"), file=sys.stderr
        )  # the older checkpoints are untouched
        return exit_codes.FAILED, False
    except Exception as exc:
        why = dist_utils.lost_peer(exc)
        if why is None:
            _record_end(trainer, "failed")
            raise
        return _lost_peer(trainer, cfg, why), False
    except BaseException:
        _record_end(trainer, "failed")
        raise
    trainer.log(final_line(trainer.state.step, code, cfg.job.dump_folder, trainer.held_out.last))
    done = code == exit_codes.OK and trainer.state.step >= cfg.training.steps
    # train() returns BAD_INPUT only for a divergence abort (every other refusal is an exception).
    _record_end(
        trainer, "finished" if done else "diverged" if code == exit_codes.BAD_INPUT else "stopped"
    )
    return code, True


def _log_elastic_restart(trainer: Any, info: dist_utils.DistInfo) -> None:
    """Under torchrun's elastic agent, the one line that says how this round resumed."""
    elastic = ElasticRestarts.from_env(os.environ)
    if not (elastic.run_id and elastic.max_restarts > 0 and trainer.resumed_from is not None):
        return
    was = trainer.checkpointer.loaded_world_size or "unknown"
    trainer.log(
        f"elastic (run {elastic.run_id}, restart {elastic.restart_count} of "
        f"{elastic.max_restarts}): world size was {was}, now {info.world_size}, resumed from "
        f"step {trainer.resumed_from}"
    )


def _steps(first: int, last: int) -> str:
    return f"step {first} is" if first == last else f"steps {first}-{last} are"


def _lost_peer(trainer: Any, cfg: Any, why: str) -> int:
    """A collective failed because a peer is gone: one line, no traceback, and the exit code that
    makes an elastic agent restart the group (1 without restarts left: relaunch by hand)."""
    elastic = ElasticRestarts.from_env(os.environ)
    code = exit_codes.RESTART if elastic.restarts_left else exit_codes.FAILED
    step = 0
    if trainer is not None:  # no waiting on an in-flight save: its collective has a lost peer too
        trainer.stop_signals.close()
        trainer.metrics.close()
        step = trainer.state.step
    newest = layout.scan(checkpoint_root(cfg.job.dump_folder, cfg.checkpoint.folder))
    newest = newest.newest() if cfg.checkpoint.enable else None
    resume = (
        f"resumes from step {newest.step} ({_steps(newest.step + 1, step)} trained again)"
        if newest is not None and newest.step < step
        else f"resumes from step {newest.step}"
        if newest is not None
        else "starts again from step 0 (no checkpoint)"
    )
    then = (
        f"{elastic.describe()} restarts the workers at the new world size and the run {resume}"
        if code == exit_codes.RESTART
        else f"relaunch to continue; the run {resume}"
    )
    _record_end(trainer, "stopped" if code == exit_codes.RESTART else "failed")
    print(
        shorten_line(f"lost a peer during step {step + 1} ({why}): exiting {code}; {then}"),
        file=sys.stderr,
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
