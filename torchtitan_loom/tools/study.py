"""A study in one command: every variant × seed of a study file trained as an ordinary run folder.

    python -m torchtitan_loom.tools.study STUDY.toml [--dry-run]

The study file (tools/study_file.py) names a trainer config, overrides for every run, the seeds
and the variants. Run (variant, seed) lives in ``<folder>/<variant>/seed-<s>`` and is trained by
``./run_train.sh`` of this checkout (``python -m torchtitan_loom.train`` for an installed package
without it), one after another in file order (variant-major, seeds inner), its output passed
through, with a line before (which run, where, whether it resumes) and after it (wall time).

Before anything is launched every run is checked: its arguments by the trainer's config loader
(load_config, no torch), then, for a run still to train, the trainer's full up-front checks
(config.validate.resolve, at the world size run_train.sh will start: NGPU × NNODES, counted as it
counts them), a live run holding its folder, and a run folder whose config.toml differs from what
the study now asks (a changed study would mix two configs in one comparison). Each problem is one
``study error:`` line on stderr, exit 2; nothing is launched or written.

A rerun of the study skips finished runs (run.json status "finished" at training.steps) and
resumes cut ones: relaunching into the same folder resumes from its newest checkpoint. The schema's
default leaves checkpoints off and the debug preset saves only the last step, so the study turns
``checkpoint.enable`` on for its runs, with ``checkpoint.interval`` = ceil(training.steps / 10) unless the config file or
the study's overrides set one: a cut run loses at most a tenth of its steps. A study override of
``checkpoint.enable`` wins. ``<folder>/study.json`` records the study (its variants, seeds and run
folders, and the wall seconds of the study's launches of each run) for tools.compare.

A run that fails stops the study: one line naming its folder, exit 1 (finished runs are kept); one
stopped by a signal (saved) ends the study too, to be resumed by rerunning it. ``--dry-run`` prints
the plan (each run's folder, status: finished / partial at step N / new, and its command).

The study folder may be a link; nothing the study creates below it may be (tools/out_files.py): a
variant or run folder that is a symbolic link is one ``study error:`` line before any launch.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

from torchtitan_loom.components.checkpoint import names, tree
from torchtitan_loom.components.runtime import exit_codes, safe_files
from torchtitan_loom.components.runtime.messages import count, shorten_line
from torchtitan_loom.components.runtime.run_folder import RunFolderError, live_run, read_run
from torchtitan_loom.config.manager import ConfigError, load_config
from torchtitan_loom.config.schema import JobConfig
from torchtitan_loom.tools.out_files import below
from torchtitan_loom.tools.study_file import (
    STUDY_JSON,
    PlannedRun,
    Study,
    StudyError,
    by_seeds,
    plan,
    read_study,
)
from torchtitan_loom.tools.study_file import study_record as make_record

# Where run_train.sh lives in a checkout: the folder above the package.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Keys a run's recorded config.toml may differ in from the study's: where it lives and how it
# was spelled, and the length of training (raising training.steps continues a finished run; the
# study's checkpoint.interval follows it).
MAY_DIFFER = ("job.config_file", "job.dump_folder", "training.steps", "checkpoint.interval")


def launcher() -> list[str]:
    """The command that trains one run, before its config arguments."""
    script = os.path.join(REPO_ROOT, "run_train.sh")
    if os.path.isfile(script) and os.access(script, os.X_OK):
        return [script]
    return [sys.executable, "-m", "torchtitan_loom.train"]


def launch_world_size(env: dict[str, str], command: list[str]) -> int | None:
    """The ranks ``command`` starts: 1 without run_train.sh; with it NGPU × NNODES as run_train.sh
    counts them (NGPU unset: the devices CUDA_VISIBLE_DEVICES names, else nvidia-smi's, else 1).
    None when it cannot be known here (elastic NNODES=MIN:MAX, srun, a bad value): run_train.sh
    then checks the config itself."""
    if not command[0].endswith("run_train.sh"):
        return 1
    nodes = env.get("NNODES") or env.get("WORLD_SIZE") or "1"
    ngpu = env.get("NGPU", "")
    if env.get("LAUNCHER") == "srun" or not nodes.isdigit() or (ngpu and not ngpu.isdigit()):
        return None
    if not ngpu:
        count = 0
        if "CUDA_VISIBLE_DEVICES" in env:
            count = sum(1 for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d.strip())
        elif shutil.which("nvidia-smi"):
            try:
                listed = subprocess.run(
                    ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30
                ).stdout
            except (OSError, subprocess.SubprocessError):
                listed = ""
            count = sum(1 for line in listed.splitlines() if line.startswith("GPU "))
        ngpu = str(max(count, 1))
    return max(int(ngpu), 1) * max(int(nodes), 1)


def status_of(run: PlannedRun) -> tuple[str, str]:
    """("finished" | "partial" | "new", the words the plan shows) from the run folder's run.json
    and checkpoints; StudyError when run.json is not a regular file."""
    try:
        rec = read_run(run.folder)
    except RunFolderError as exc:
        raise StudyError(f"{run.folder}: {exc}") from None
    if rec is None:
        return "new", "new"
    step = int(rec.get("step") or 0)
    if rec.get("status") == "finished" and step >= run.steps:
        return "finished", f"finished at step {step}"
    newest = tree.scan(os.path.join(run.folder, run.checkpoint_folder)).newest()
    step = max(step, newest.step if newest else 0)
    resume = (
        f"resumes from checkpoint step {newest.step}" if newest else "no checkpoint: starts over"
    )
    return "partial", f"partial at step {step} (status {rec.get('status')}; {resume})"


def _flat(cfg: JobConfig) -> dict[str, Any]:
    return {f"{s}.{k}": v for s, t in cfg.to_dict().items() for k, v in t.items()}


def changed_since(run: PlannedRun, cfg: JobConfig) -> str | None:
    """The line saying how the run folder's recorded config.toml differs from the study's config
    for it (keys other than MAY_DIFFER), else None."""
    path = os.path.join(run.folder, names.CONFIG_TOML)
    if not os.path.isfile(path):
        return None
    try:
        old = _flat(load_config(["--job.config_file", path]))
    except ConfigError as exc:
        return f"{path} does not load ({str(exc).splitlines()[0]})"
    new = _flat(cfg)
    diff = [
        f"{k}: {old.get(k)!r} → {new.get(k)!r}"
        for k in sorted(old.keys() | new.keys())
        if k not in MAY_DIFFER and old.get(k) != new.get(k)
    ]
    if not diff:
        return None
    more = f" and {len(diff) - 3} more" if len(diff) > 3 else ""
    return (
        f"{run.folder} was trained with another config ({'; '.join(diff[:3])}{more}); restore the "
        f"study's settings, remove that run folder, or give the study a new [study] folder"
    )


def check_runs(
    runs: list[PlannedRun], configs: dict[str, JobConfig], command: list[str], dry_run: bool
) -> dict[str, tuple[str, str]]:
    """Each run's status; StudyError with every problem of the runs still to train (a run being
    trained now is one, except in the dry run, whose plan says so)."""
    from torchtitan_loom.config.validate import resolve  # imports torch (the model registry)

    world = launch_world_size(dict(os.environ), command)
    statuses, errors = {}, []
    for run in runs:
        cfg, at = configs[run.folder], (run.variant, run.seed)
        statuses[run.folder] = status = status_of(run)
        changed = changed_since(run, cfg)
        if changed:
            errors.append((*at, changed))
            continue
        if status[0] == "finished":
            continue
        live = live_run(run.folder) if os.path.isdir(run.folder) else None
        if live and dry_run:  # the plan of a study still running: say so, check the rest
            statuses[run.folder] = (status[0], f"{status[1]}; being trained now: {live}")
            continue
        if live:
            errors.append((*at, live))
            continue
        if world is not None:
            try:
                resolve(cfg, world)
            except ConfigError as exc:
                errors += [(*at, line) for line in str(exc).splitlines()]
    if errors:
        raise StudyError("\n".join(by_seeds(errors)))
    return statuses


def read_wall(folder: str) -> dict[str, float]:
    """The wall seconds an earlier study.json recorded per run folder ({} when there is none)."""
    try:
        old = json.loads(safe_files.read_text(os.path.join(folder, STUDY_JSON)))
        return {
            r["folder"]: float(r["wall_s"])
            for r in old.get("runs", [])
            if isinstance(r, dict) and isinstance(r.get("wall_s"), (int, float))
        }
    except (OSError, ValueError, AttributeError, KeyError, TypeError, RecursionError):
        return {}


def write_record(study: Study, runs: list[PlannedRun], wall: dict[str, float]) -> None:
    safe_files.make_dirs(study.folder, study.folder)
    text = json.dumps(make_record(study, runs, wall), indent=2) + "\n"
    safe_files.atomic_write(os.path.join(study.folder, STUDY_JSON), text, owner=study.folder)


def launch_run(command: list[str]) -> int:
    """Run one training command, its output passed through; its exit code. SIGTERM / SIGUSR1 sent
    to the study are passed on (the run saves and stops); Ctrl-C reaches the run from the terminal
    itself, so the study only waits for it to save and exit."""
    # run_train.sh starts $PYTHON (default python3): this interpreter, whose packages are known
    env = dict(os.environ, PYTHON=os.environ.get("PYTHON", sys.executable))
    proc = subprocess.Popen(command, env=env)
    got: list[int] = []  # the stop signals the run was sent

    def forward(signum: int, _frame: Any) -> None:
        got.append(signum)
        proc.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        while True:
            try:
                return stop_code(proc.wait(), got)
            except KeyboardInterrupt:
                got.append(signal.SIGINT)
                print(
                    "study: interrupted; waiting for the run to save and stop (Ctrl-C again: "
                    "stop without saving)",
                    flush=True,
                )
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def stop_code(code: int, got: list[int]) -> int:
    """The run's exit code, except for a run ended by a stop signal it was sent before its trainer
    handles signals (e.g. while it imports torch): stopped as asked, so the code of a handled stop
    (0; 130 for Ctrl-C), not a failure."""
    if not any(code in (-s, 128 + s) for s in got):
        return code
    return (
        exit_codes.INTERRUPTED
        if code in (-signal.SIGINT, exit_codes.INTERRUPTED)
        else exit_codes.OK
    )


def print_plan(
    runs: list[PlannedRun], statuses: dict[str, tuple[str, str]], command: list[str]
) -> None:
    """The dry run: each run's folder, status and command."""
    for run in runs:
        where = f"{run.variant} seed {run.seed} -> {run.folder}"
        print(f"study: run {run.index} of {len(runs)}: {where}: {statuses[run.folder][1]}")
        print(f"  {shlex.join(command + run.args)}")
    left = sum(kind != "finished" for kind, _ in statuses.values())
    print(f"study: dry run: nothing launched ({count(left, 'run')} to train)")


def ended(run: PlannedRun, total: int, code: int, seconds: float) -> int | None:
    """After a launch: None when the run finished (the study goes on), else the study's exit
    code, with the line saying why it stops."""
    rec = read_run(run.folder) or {}
    which = f"study: run {run.index} of {total} ({run.folder})"
    if code == exit_codes.OK and rec.get("status") == "finished":
        print(f"study: run {run.index} of {total} done in {seconds:,.1f} s", flush=True)
        return None
    if code in (exit_codes.OK, exit_codes.INTERRUPTED):  # stopped by a signal, saved
        state = f"status {rec.get('status')}, step {rec.get('step')}" if rec else "before step 1"
        print(
            f"{which} stopped after {seconds:,.1f} s (exit code {code}, {state}); rerun the "
            "study to resume it",
            flush=True,
        )
        return code
    print(
        shorten_line(
            f"{which} failed with exit code {code} after {seconds:,.1f} s (its output is above); "
            f"the {count(run.index - 1, 'run')} before it are finished and kept"
        ),
        file=sys.stderr,
    )
    return exit_codes.FAILED


def run_study(study: Study, dry_run: bool) -> int:
    """Check, then print the plan (``dry_run``) or train the runs left; the exit code."""
    n_var, n_seed = len(study.variants), len(study.seeds)
    print(
        f"study: {study.name}: {count(n_var * n_seed, 'run')} ({count(n_var, 'variant')} × "
        f"{count(n_seed, 'seed')}) of {study.config_file} in {study.folder}; checking every "
        f"run's config ...",
        flush=True,
    )
    runs, configs = plan(study)
    for run in runs:  # a run's folder (or its variant's) planted as a link: refused (out_files.py)
        below(run.folder, study.folder, StudyError)
    command = launcher()
    statuses = check_runs(runs, configs, command, dry_run)
    if dry_run:
        print_plan(runs, statuses, command)
        return exit_codes.OK
    wall = read_wall(study.folder)
    write_record(study, runs, wall)
    for run in runs:
        head = (
            f"study: run {run.index} of {len(runs)}: {run.variant} seed {run.seed} -> {run.folder}"
        )
        kind, words = statuses[run.folder]
        if kind == "finished":
            print(f"{head}: {words}, skipped", flush=True)
            continue
        print(f"{head}: {'resuming, ' + words if kind == 'partial' else 'new'} ...", flush=True)
        safe_files.make_dirs(run.folder, study.folder)  # never through a link planted since
        started = time.monotonic()
        code = launch_run(command + run.args)
        seconds = time.monotonic() - started
        rel = os.path.relpath(run.folder, study.folder)
        wall[rel] = wall.get(rel, 0.0) + seconds
        write_record(study, runs, wall)
        stop = ended(run, len(runs), code, seconds)
        if stop is not None:
            return stop
    tool = "python -m torchtitan_loom.tools.compare"
    print(f"study: every run finished; compare them with: {tool} {study.folder}")
    return exit_codes.OK


def main(argv: list[str] | None = None) -> int:
    """The command line; 0, 2 with ``study error:`` lines, 1 when a run failed."""
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_loom.tools.study", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("study", help="the study TOML file")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, launch nothing")
    ns = parser.parse_args(argv)
    try:
        return run_study(read_study(ns.study), ns.dry_run)
    except (StudyError, OSError) as exc:
        for line in str(exc).splitlines():
            print(shorten_line(f"study error: {line}"), file=sys.stderr)
        return exit_codes.BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
