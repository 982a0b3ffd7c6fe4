"""The run folder's own bookkeeping: a lock for the live run, the identity of the run
the folder holds, and what happens when another launch arrives.

    RUN.lock   host, pid, start time and run_id of the live launch (rank 0). A second launch is
               refused while that process lives; a lock left by a dead process of this host is
               stale and taken over with a warning. A lock from another host cannot be checked
               from here: the message says which file to delete once that run is known dead.
    run.json   the run's identity (the config keys that define WHAT is trained), its status
               (running / finished / stopped / diverged / failed), and one entry per launch
               (run_id, start, resumed step). A relaunch whose identity differs, or into a finished run (training.steps
               not raised, no checkpoint.load_step given), or that cannot continue the run
               (checkpoints off) is refused unless
               job.overwrite, which moves the old run's files to ``replaced-<run_id>/`` first.

Tunables (lr, intervals, logging, parallel layout, ...) are not part of the identity: a resume may
change them. Pure filesystem code, used by config validation and by train.main before any process
group exists.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import secrets
import socket
import time
from collections.abc import Sequence
from typing import Any

from torchtitan_loom.components.checkpoint import names, tree
from torchtitan_loom.components.runtime import format_version, safe_files
from torchtitan_loom.components.runtime.resolved import flat_sections, resolved_config
from torchtitan_loom.protocols import model_args_of, relaunch_tunable_of

LOCK = "RUN.lock"
# Run files moved aside by job.overwrite (the metrics and checkpoint folders are added per config).
_RUN_FILES = (names.RUN_JSON, names.CONFIG_TOML, names.METRICS_JSONL, "SPIKE_ABORT.txt")


class RunFolderError(RuntimeError):
    """The run folder refuses this launch; the message says why and what to do."""


def new_run_id() -> str:
    """A launch id: UTC time plus random hex (unique across hosts)."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3)


def identity(cfg: Any) -> dict[str, Any]:
    """The config values that define what a run trains; two launches with different ones are
    different runs."""
    tunable = relaunch_tunable_of(cfg.model.name)  # may change between launches of one run
    model = {k: v for k, v in dataclasses.asdict(cfg.model).items() if k not in tunable}
    t = cfg.training
    return {
        "model": model,
        "data.path": cfg.data.path,
        "training.seed": t.seed,
        "training.seq_len": t.seq_len,
        "training.global_batch_size": t.global_batch_size,
        "training.bp_segment_len": t.bp_segment_len,
        "training.sample_depth_min": t.sample_depth_min,  # which loops each step trains
        "training.sample_depth_max": t.sample_depth_max,
        "optimizer.name": cfg.optimizer.name,  # another optimizer cannot continue this one's state
    }


def _as_flavor(flat: dict[str, Any]) -> dict[str, Any]:
    """An identity's unset [model] keys as the flavor's values: a key set to the flavor's own value
    (an older preset's ``num_loops = 3``) and the same key left unset train the same model."""
    try:
        flavors, _ = model_args_of(str(flat.get("model.name")))
        args = dataclasses.asdict(flavors[str(flat.get("model.flavor"))])
    except (ValueError, KeyError):
        return flat  # an unknown model or flavor: compared as written (the config names it)
    return {
        k: args.get(k.split(".", 1)[1]) if k.startswith("model.") and v is None else v
        for k, v in flat.items()
    }


def read_run(dump_folder: str) -> dict[str, Any] | None:
    """run.json, or None when there is none (or it is not JSON); RunFolderError when something
    other than a regular file is there (a FIFO would block, a link to /dev/zero never end)."""
    path = os.path.join(dump_folder, names.RUN_JSON)
    try:
        run = json.loads(safe_files.read_text(path))
    except safe_files.UnsafePathError as exc:
        raise RunFolderError(str(exc)) from None
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(run, dict):
        return None
    if not isinstance(run.get("launches", []), list) or not all(
        isinstance(x, dict) for x in run.get("launches", [])
    ):
        run["launches"] = []  # a damaged history is rewritten from this launch on, not trusted
    run.setdefault("launches", [])
    return run


def relaunch_errors(cfg: Any, finished_only: bool = False) -> list[str]:
    """Why this launch may not continue the run in job.dump_folder ([] = it may). ``finished_only``
    (the answer before torch): only the refusal of the same run, finished; a different run is
    said with the config's other problems, which need torch."""
    if cfg.job.overwrite or cfg.parallelism.dry_run:  # the dry run writes nothing there
        return []
    try:
        run = read_run(cfg.job.dump_folder)
    except RunFolderError as exc:
        return [] if finished_only else [f"job.dump_folder = '{cfg.job.dump_folder}': {exc}"]
    if run is None:
        return []
    version = version_problem(cfg.job.dump_folder, run)
    if version:
        return [version]
    hint = "pass --job.overwrite true (the old run moves to replaced-<run_id>/) or use a new job.dump_folder"
    where = f"job.dump_folder = '{cfg.job.dump_folder}'"
    now = flat_sections(identity(cfg))
    # A key added to the identity since the run was recorded is absent there. A model argument
    # reads as unset (the flavor's value), as a key the run left unset; any other key as the
    # schema's default (the config's own class, built bare), what runs trained before the key.
    default = flat_sections(identity(type(cfg)()))
    recorded = {
        k: None if k.startswith("model.") else default.get(k) for k in default.keys() | now.keys()
    }
    recorded.update(flat_sections(run.get("identity", {})))
    old, new = _as_flavor(recorded), _as_flavor(now)
    diff = [
        f"{k}: {old.get(k)!r} → {new.get(k)!r}"
        for k in sorted(old.keys() | new.keys())
        if old.get(k) != new.get(k)
    ]
    if diff and finished_only:
        return []
    if diff:
        return [
            f"{where} holds a different run ({'; '.join(diff[:4])}{' ...' if len(diff) > 4 else ''}); {hint}"
        ]
    branch = (
        cfg.checkpoint.enable and cfg.checkpoint.load_step >= 0
    )  # an explicit resume from an older step
    if (
        run.get("status") == "finished"
        and cfg.training.steps <= int(run.get("step", 0))
        and not branch
    ):
        return [
            f"{where} holds a finished run (step {run.get('step')} of training.steps = {cfg.training.steps}); "
            f"{_continue_advice(cfg)}{hint}"
        ]
    if finished_only:
        return []
    if not cfg.checkpoint.enable:
        return [
            f"{where} holds a run (status {run.get('status')!r}) that checkpoint.enable = false cannot "
            f"continue (it would start over and mix two histories in metrics.jsonl); {hint}"
        ]
    return []


def _continue_advice(cfg: Any) -> str:
    """How a finished run continues, said only where it can: the launch must resume from a
    complete checkpoint in the folder (a run that saved none cannot be continued)."""
    root = os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder)
    if os.path.isdir(root) and tree.scan(root).newest() is not None:
        on = "" if cfg.checkpoint.enable else " with --checkpoint.enable true"
        return f"raise training.steps{on} to continue it, or "
    return "it saved no checkpoint, so it cannot be continued: "


def live_run(dump_folder: str) -> str | None:
    """The line RunLock refuses a live run's folder with, when its lock names a live process (on
    this host: its pid is alive; on another host it cannot be checked and counts as live); else
    None. Read without blocking or following a link; an unreadable lock is RunLock's to report.
    Only rank 0 asks (it takes the lock; the other ranks of its launch would find it holding it),
    and a lock of an earlier round of this elastic run is RunLock's to take over."""
    if int(os.environ.get("RANK", "0") or 0) != 0:
        return None
    path = os.path.join(dump_folder, LOCK)
    try:
        held = json.loads(safe_files.read_text(path))
        host, pid = str(held["host"]), int(held["pid"])
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None
    from torchtitan_loom.components.runtime.preemption import ElasticRestarts

    elastic = ElasticRestarts.from_env(os.environ).elastic_run
    if elastic and held.get("elastic_run") == elastic:
        return None
    if host == socket.gethostname() and (pid == os.getpid() or not _pid_alive(pid)):
        return None
    where = "this host" if host == socket.gethostname() else f"host {host}"
    return (
        f"{dump_folder} is in use by a live run: pid {pid} on {where}, started "
        f"{held.get('started')} (run {held.get('run_id')}); wait for it, stop it, or use another "
        f"job.dump_folder (if that run is dead, delete {path})"
    )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """``RUN.lock`` held by this process; ``release()`` removes it (only if still ours)."""

    def __init__(self, dump_folder: str, run_id: str, log=print, elastic_run: str = "") -> None:
        self.path = os.path.join(dump_folder, LOCK)
        # ``elastic_run``: torchrun's elastic run id; a later round of the same elastic run takes
        # the lock over from an earlier one (whose rank 0 may have died on another host).
        self.elastic_run = elastic_run
        self.payload = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "run_id": run_id,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **({"elastic_run": elastic_run} if elastic_run else {}),
        }
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._handle_existing(log)
                continue
            try:
                with os.fdopen(fd, "w") as fh:
                    json.dump(self.payload, fh)
            except OSError as exc:  # e.g. a full disk: no empty lock left to refuse the next launch
                os.remove(self.path)
                raise RunFolderError(
                    f"{self.path}: could not write the run lock ({exc.strerror or exc})"
                ) from None
            return
        raise RunFolderError(
            f"{self.path}: could not take the run lock (another launch is racing for it)"
        )

    def _handle_existing(self, log) -> None:
        try:
            held = json.loads(safe_files.read_text(self.path))
            host, pid = held["host"], int(held["pid"])
        except safe_files.UnsafePathError as exc:
            raise RunFolderError(f"{exc} (the run lock)") from None
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            raise RunFolderError(
                f"{self.path}: unreadable run lock; if no run uses this folder, delete it"
            ) from None
        if self.elastic_run and held.get("elastic_run") == self.elastic_run:
            # torchrun stopped every worker of the earlier round before this round's rendezvous.
            log(
                f"taking over {self.path} from an earlier round of elastic run {self.elastic_run} "
                f"(pid {pid} on {host})"
            )
            os.remove(self.path)
            return
        if host == socket.gethostname() and not _pid_alive(pid):
            log(
                f"warning: stale run lock {self.path} (pid {pid} of {host}, started {held.get('started')}, "
                f"is gone): taking it over"
            )
            os.remove(self.path)
            return
        where = "this host" if host == socket.gethostname() else f"host {host}"
        raise RunFolderError(
            f"{os.path.dirname(self.path)} is in use by a live run: pid {pid} on {where}, "
            f"started {held.get('started')} (run {held.get('run_id')}); wait for it, stop it, or "
            f"use another job.dump_folder (if that run is dead, delete {self.path})"
        )

    def release(self) -> None:
        try:
            mine = json.loads(safe_files.read_text(self.path)).get("pid") == os.getpid()
        except (OSError, ValueError, AttributeError, RecursionError):
            return
        if mine:
            os.remove(self.path)


def replace_old_run(cfg: Any, log=print) -> str | None:
    """job.overwrite: move the previous run's files to ``replaced-<run_id>/``; returns that path."""
    dump = cfg.job.dump_folder
    run = read_run(dump)
    moved = list(_RUN_FILES) + [cfg.checkpoint.folder, cfg.metrics.tb_folder]
    present = [n for n in moved if os.path.exists(os.path.join(dump, n))]
    if not cfg.job.overwrite or not present:
        return None
    dest = os.path.join(dump, f"replaced-{(run or {}).get('run_id') or new_run_id()}")
    safe_files.make_dirs(dest, dump)  # a link planted at that name would take the old run away
    for n in present:
        os.rename(os.path.join(dump, n), os.path.join(dest, n))
    log(f"job.overwrite: moved the previous run's {', '.join(present)} to {dest}")
    return dest


# run.json's format_version, written by record_launch: bump it (and list what this code still reads
# in RUN_FORMATS_READ, migrating in read_run / relaunch_errors) when a key changes its meaning or
# leaves; docs/checkpoints.md, "Format versions". Version 1: the first one written (the keys of
# the legacy file, plus format_version).
RUN_FORMAT_VERSION = 1
RUN_FORMATS_READ = (1,)


def version_problem(dump_folder: str, run: dict[str, Any]) -> str | None:
    """One line when run.json is of a format this code does not read (None: it reads it)."""
    return format_version.problem(
        os.path.join(dump_folder, names.RUN_JSON),
        run,
        RUN_FORMATS_READ,
        "continue this run with the torchtitan_loom that wrote it (or a newer one), or start "
        "another in a new job.dump_folder",
    )


def record_launch(
    cfg: Any,
    run_id: str,
    status: str,
    step: int,
    resumed_from: int | None = None,
    model: dict[str, float] | None = None,
    model_args: Any = None,
) -> None:
    """Write run.json: identity, status ("running", or how the launch ended: Trainer._finish), step,
    launches (each with its start, and its end and seconds once it ended), ``model`` when given
    (params, active params and training FLOPs per token, for tools that compare runs) and
    ``resolved``: the configuration this launch really ran (every section, and the model arguments
    the flavor and the [model] overrides resolved to), so a study can tell what each run changed."""
    dump = cfg.job.dump_folder
    safe_files.check_held(dump)  # a run folder swapped since the launch is neither read nor written
    run = read_run(dump) or {"identity": identity(cfg), "launches": []}
    version = version_problem(dump, run)
    if version:  # relaunch_errors refused it up front; this is the writer's own guard
        raise RunFolderError(version)
    run["identity"] = identity(cfg)
    run[format_version.KEY] = RUN_FORMAT_VERSION  # a legacy file is rewritten in this format
    if not run["launches"] or run["launches"][-1].get("run_id") != run_id:
        run["launches"].append(
            {
                "run_id": run_id,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "started_unix": round(time.time(), 3),
                "resumed_from_step": resumed_from,
            }
        )
    if status != "running":
        launch = run["launches"][-1]
        launch["ended"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        if isinstance(launch.get("started_unix"), (int, float)):
            launch["seconds"] = round(time.time() - launch["started_unix"], 1)
    if model is not None:
        run["model"] = model
    if model_args is not None:
        run["resolved"] = resolved_config(cfg, model_args)
    run.update(run_id=run_id, status=status, step=step)
    path, text = os.path.join(dump, names.RUN_JSON), json.dumps(run, indent=2, sort_keys=True)
    try:
        safe_files.atomic_write(path, text, owner=dump)
    except OSError as exc:
        if (
            isinstance(exc, safe_files.UnsafePathError)
            or exc.errno not in (errno.ENOSPC, errno.EDQUOT)
            or not os.path.isfile(path)
        ):
            raise
        _rewrite_in_place(path, text)


def _rewrite_in_place(path: str, text: str) -> None:
    """A full disk has no room for run.json's temporary copy, but the status still fits the
    blocks run.json already holds: overwrite it where it is (not atomic; only on a full disk)."""
    fd = os.open(path, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        data = text.encode()
        os.write(fd, data)
        os.ftruncate(fd, len(data))
        os.fsync(fd)
    finally:
        os.close(fd)


def planted_links(dump_folder: str, folders: Sequence[str] = ()) -> list[str]:
    """Symbolic links where a launch writes its run files or the sub-``folders`` it writes into
    (tb/), which a launch refuses (safe_files.py); each writer checks again when it writes."""
    written = [*_RUN_FILES, *(f + ".partial" for f in _RUN_FILES), LOCK, *folders]
    return safe_files.planted_links(dump_folder, written) if os.path.isdir(dump_folder) else []
