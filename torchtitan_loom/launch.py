"""A launch of the trainer, around the Trainer: arguments → config → checks → run folder → process
group → train, and every exception that is a known way to end mapped to its Outcome
(``outcome_of``: status, exit code from components/runtime/exit_codes.py, message).

``run(argv, trainer_cls)`` is what ``python -m torchtitan_loom.train`` calls. Errors of what the run
was given (config, data, checkpoint, run folder) print one line per problem on stderr, prefixed by
their kind, and exit 2 before or instead of training. Once the trainer exists, ``Trainer.run``
ends the launch itself from its Outcome; ``record_end`` writes run.json's final status for it.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torchtitan_loom.components.checkpoint import CheckpointError, tree
from torchtitan_loom.components.checkpoint.resolve import checkpoint_root
from torchtitan_loom.components.checkpoint.state import CheckpointSaveError
from torchtitan_loom.components.data import PackError
from torchtitan_loom.components.runtime import exit_codes, safe_files
from torchtitan_loom.components.runtime.messages import shorten, shorten_line
from torchtitan_loom.components.runtime.outcome import Outcome, Status
from torchtitan_loom.components.runtime.preemption import ElasticRestarts
from torchtitan_loom.components.runtime.run_folder import (
    RunFolderError,
    RunLock,
    live_run,
    new_run_id,
    record_launch,
    replace_old_run,
)
from torchtitan_loom.components.runtime.safe_files import UnsafePathError
from torchtitan_loom.config import ConfigError, help_requested, help_text, load_config, to_toml
from torchtitan_loom.config.gates import gated_problems
from torchtitan_loom.config.validate import load_and_resolve, resolve
from torchtitan_loom.distributed import utils as dist_utils

if TYPE_CHECKING:
    from torch import nn


def _errors(kind: str, exc: BaseException) -> int:
    for line in str(exc).splitlines():
        print(shorten_line(f"{kind} error: {line}"), file=sys.stderr)
    return exit_codes.BAD_INPUT


def run(argv: list[str], trainer_cls: Any) -> int:
    """Check, launch and train; returns the process exit code."""
    wanted, rest_of_argv = help_requested(argv)
    if wanted:
        print(help_text(rest_of_argv))
        return exit_codes.OK
    checks = [a for a in argv if a == "--check-config" or a.startswith("--check-config=")]
    argv = [a for a in argv if a not in checks]
    try:
        if checks and checks[-1].startswith("--check-config="):
            return _check_world_sizes(argv, checks[-1].split("=", 1)[1])
        live = None if checks else _live_run(argv)
        if live:  # the cause of whatever else this launch would be refused for: said first, alone
            print(shorten_line(f"run folder error: {live}"), file=sys.stderr)
            return exit_codes.BAD_INPUT
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
            print(dry_run(cfg, *resolved, convert=_float8_conversion(cfg)))
        return exit_codes.OK
    run_id, lock = new_run_id(), None
    # The run folder is held from here (safe_files.HeldFolder): every write, rename and removal
    # under it checks that the name still leads to this directory, so a folder swapped mid-run
    # stops the run instead of taking its checkpoints, index and run.json elsewhere.
    cfg.job.dump_folder = safe_files.HeldFolder(cfg.job.dump_folder)
    if rank0:  # before any process group: one live run per folder
        log = lambda m: print(f"[torchtitan_loom] {m}", flush=True)  # noqa: E731
        for note in gated_problems(cfg)[1]:  # a preset's keys that this command turned off
            log(note)
        try:
            os.makedirs(cfg.job.dump_folder, exist_ok=True)
            cfg.job.dump_folder.check()  # made just now: held from its creation
            lock = RunLock(
                cfg.job.dump_folder,
                run_id,
                log=log,
                elastic_run=ElasticRestarts.from_env(os.environ).elastic_run,
            )
            replace_old_run(cfg, log=log)
        except (RunFolderError, OSError) as exc:
            if lock is not None:
                lock.release()
            print(shorten_line(f"run folder error: {exc}"), file=sys.stderr)
            return exit_codes.BAD_INPUT
    try:
        info = dist_utils.init_distributed(
            cfg.training.device, timeout_s=cfg.comm.init_timeout_seconds
        )
    except dist_utils.PeersMissing as exc:
        if lock is not None:
            lock.release()
        print(shorten_line(f"launch error: {exc}"), file=sys.stderr)
        return exit_codes.BAD_INPUT
    peers_alive = False
    if (
        info.rank != 0 and os.environ.get("LOCAL_RANK", "0") == "0"
    ):  # a node's console says it joined
        print(
            f"[torchtitan_loom] joined the run as rank {info.rank} of {info.world_size}; rank 0 "
            f"logs its progress and writes {cfg.job.dump_folder}",
            flush=True,
        )
    try:
        if info.world_size > 1:  # rank 0's launch id for every rank's metrics
            run_id = dist_utils.broadcast_object(run_id)
            from torchtitan_loom.distributed.run_agreement import run_problem

            problem = run_problem(cfg, to_toml(cfg), info.rank, run_id)  # one job, one folder
            if problem:
                print(shorten_line(f"run folder error: {problem}"), file=sys.stderr)
                return exit_codes.BAD_INPUT
        code, peers_alive = _train(cfg, resolved, info, run_id, trainer_cls)
        return code
    finally:  # no barrier with a lost peer, nor after an error (the others may never reach it)
        dist_utils.destroy_distributed(wait_for_all=peers_alive)
        if lock is not None:
            lock.release()


def _float8_conversion(cfg: Any) -> Callable[[nn.Module], str] | None:
    """The trainer's float8 conversion of a meta model -> its report line, for the dry run (which
    sits below the components); None when float8 is off."""
    from torchtitan_loom.components.quantization.float8 import build_float8_converter
    from torchtitan_loom.protocols import get_train_spec

    t = cfg.training
    spec = get_train_spec(cfg.model.name)
    f8 = build_float8_converter(cfg.float8, t.device, spec, t.micro_batch_size * t.seq_len)
    return None if f8 is None else lambda model: f8.convert(model).summary(f8.plan)


def _live_run(argv: list[str]) -> str | None:
    """On rank 0 of a launch, the line naming a live run that holds the dump folder (its lock's pid
    is alive), else None; a config that does not load is the config check's to report."""
    try:
        cfg = load_config(argv)
    except ConfigError:
        return None
    return live_run(cfg.job.dump_folder)


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
    try:
        trainer = trainer_cls(cfg, resolved, info, run_id=run_id)
    except BaseException as exc:  # before run.json says running: it stays as it was
        outcome = outcome_of(exc, cfg)
        if outcome is None:
            raise
        print(outcome.message, file=sys.stderr)
        return outcome.exit_code, False
    outcome = trainer.run()  # ends the launch itself: its last line and run.json's status
    return outcome.exit_code, not outcome.error  # no barrier after an error: peers may be gone


def _lines(kind: str, exc: BaseException) -> str:
    return "\n".join(shorten_line(f"{kind} error: {line}") for line in str(exc).splitlines())


def outcome_of(exc: BaseException, cfg: Any, step: int = 0, in_step: bool = True) -> Outcome | None:
    """The Outcome of an exception that ends a launch (of ``cfg``, after global step ``step``;
    ``in_step``: raised inside step ``step + 1``, else in the work after step ``step``: its
    metrics, eval or checkpoint) in a known way; None for anything else (a bug: the caller
    re-raises it, with its traceback)."""
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
    why = dist_utils.lost_peer(exc) if isinstance(exc, Exception) else None
    if why is not None:
        return _lost_peer(cfg, step, why, in_step)
    if isinstance(exc, OSError):  # a file of the run could not be written: a full disk, say
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        what = "disk full" if full else "i/o error"
        where = f" writing {shorten(exc.filename)}" if exc.filename else ""
        msg = f"{what}{where}: {exc.strerror or exc}"
        return Outcome(Status.FAILED, exit_codes.FAILED, msg, error=True)
    return None


def log_elastic_restart(
    log: Any, resumed_from: int | None, was_world: int | None, world: int
) -> None:
    """Under torchrun's elastic agent, the one line that says how this round resumed."""
    elastic = ElasticRestarts.from_env(os.environ)
    if not (elastic.run_id and elastic.max_restarts > 0 and resumed_from is not None):
        return
    log(
        f"elastic (run {elastic.run_id}, restart {elastic.restart_count} of "
        f"{elastic.max_restarts}): world size was {was_world or 'unknown'}, now {world}, "
        f"resumed from step {resumed_from}"
    )


def _steps(first: int, last: int) -> str:
    return f"step {first} is" if first == last else f"steps {first}-{last} are"


def _lost_peer(cfg: Any, step: int, why: str, in_step: bool = True) -> Outcome:
    """A collective failed because a peer is gone: one line, no traceback, and the exit code that
    makes an elastic agent restart the group (1 without restarts left: relaunch by hand)."""
    elastic = ElasticRestarts.from_env(os.environ)
    code = exit_codes.RESTART if elastic.restarts_left else exit_codes.FAILED
    scanned = tree.scan(checkpoint_root(cfg.job.dump_folder, cfg.checkpoint.folder))
    newest = scanned.newest() if cfg.checkpoint.enable else None
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
    when = f"during step {step + 1}" if in_step else f"after step {step} (its eval or save)"
    msg = shorten_line(f"lost a peer {when} ({why}): exiting {code}; {then}")
    status = Status.STOPPED if code == exit_codes.RESTART else Status.FAILED
    return Outcome(status, code, msg, error=True)


def record_end(cfg: Any, run_id: str, status: str, step: int) -> None:
    """run.json's status at the end of a launch that recorded itself as running (rank 0)."""
    try:
        record_launch(cfg, run_id, status, step)
    except OSError as exc:  # the disk that ended the run is still full: say so, keep the exit code
        print(f"warning: run.json not updated to {status!r}: {exc}", file=sys.stderr)
