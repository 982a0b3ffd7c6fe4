"""tools.compare's numbers: run folders (or a study folder's runs) read into per-run summaries,
grouped by variant, each group's mean ± sample standard deviation over its seeds.

What is read, per run folder (a folder holding run.json and metrics.jsonl):

- metrics.jsonl: the held-out loss after every loop at each eval (``eval_loss_loop_<t>``), the
  tokens trained on (``tokens_seen``: tokens with a target), FLOPs per token (``tflops`` ÷
  ``tokens_per_s``: the trainer's own count), the training time (Σ steps × tokens per step ÷
  ``tokens_per_s`` over the logged intervals: evals and start-up not counted) and the last
  ``downstream/<task>/<metric>`` scores. A relaunch's rows replace the rows after the step it
  resumed from (its first row carries ``launch.resumed_from_step``). A damaged line is skipped
  with one warning (tools/input_files.py).
- run.json: the status and step, the model's params, active params and FLOPs per token as the
  trainer counted them, each ended launch's seconds and the resolved configuration (what
  compare_diff reports each group changes); config.toml: the seed and the grouping;
  study.json (of a study folder): each run's variant and the wall seconds the study's launches took
  (preferred: it includes the launches' start-up).
- params and active params of a run.json written before they were recorded: the model built on
  the meta device from config.toml (compare_sizes.py, imports torch; the current code's count).

Groups: a study's variants; plain run folders whose config.toml differ only in training.seed and
job.dump_folder, named by the keys their configs differ in. Only finished runs enter a group's
numbers; the others are listed with their status. No torch import here.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from torchtitan_loom.components.checkpoint import names
from torchtitan_loom.components.runtime import safe_files
from torchtitan_loom.config.manager import ConfigError
from torchtitan_loom.config.toml_file import flatten, read_toml
from torchtitan_loom.tools.input_files import metrics_rows, not_a_run
from torchtitan_loom.tools.study_file import STUDY_JSON

GROUPING_IGNORES = ("training.seed", "job.dump_folder")
Warn = Callable[[str], None]  # where a warning line goes
MAX_NAME_KEYS = 3  # a group named by more differing keys than this is named by its first run


class CompareError(ValueError):
    """An input that cannot be compared: one line naming it and what is expected."""


class EvalPoint(NamedTuple):
    step: int
    tokens: float
    losses: list[float]  # after loop 1..H


@dataclass
class RunSummary:
    path: str
    study: str | None  # the study folder it came through, else None (grouped by config)
    variant: str | None
    status: str
    step: int
    config: dict[str, Any]
    evals: list[EvalPoint]
    tokens: int | None
    flops_per_token: float | None
    train_s: float | None
    wall_s: float | None
    scores: dict[str, float]
    params: int | None = None
    active_params: int | None = None
    group: str = ""
    resolved: dict[str, Any] = field(default_factory=dict)  # run.json's, else config.toml's keys
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, loss) as logged

    @property
    def seed(self) -> int | None:
        seed = self.config.get("training.seed")
        return seed if isinstance(seed, int) else None

    @property
    def final_losses(self) -> list[float] | None:
        return self.evals[-1].losses if self.evals else None


@dataclass
class Group:
    name: str
    runs: list[RunSummary]
    used: list[RunSummary] = field(default_factory=list)  # the finished ones: the group's numbers


def is_run_folder(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, f)) for f in (names.RUN_JSON, names.METRICS_JSONL))


class RunRef(NamedTuple):
    path: str
    study: str | None  # the study folder it was found through
    variant: str | None
    wall_s: float | None  # the study's launches of it


def find_runs(paths: list[str], notes: list[str]) -> list[RunRef]:
    """Every argument's run folders, a study folder expanded to the runs of its study.json that
    exist (the others are noted); a run named twice (a folder and its study) counts once."""
    found: list[RunRef] = []
    for path in paths:
        if os.path.isfile(os.path.join(path, STUDY_JSON)):
            for folder, variant, wall in study_runs(path):
                if is_run_folder(folder):
                    found.append(RunRef(folder, path, variant, wall))
                else:
                    why = not_a_run(folder, "not run yet (no run.json/metrics.jsonl)")
                    notes.append(f"{folder}: {why}, left out")
        elif is_run_folder(path):
            found.append(RunRef(path, None, None, None))
        else:
            why = not_a_run(path, "no run.json/metrics.jsonl")
            raise CompareError(
                f"{path} is not a run folder ({why}) nor a study folder (no study.json)"
            )
    seen: set[str] = set()
    unique = []
    for ref in found:
        if os.path.realpath(ref.path) not in seen:
            seen.add(os.path.realpath(ref.path))
            unique.append(ref)
    return unique


def study_runs(folder: str) -> list[tuple[str, str, float | None]]:
    path = os.path.join(folder, STUDY_JSON)
    try:
        study = json.loads(safe_files.read_text(path))
        runs = [
            (os.path.join(folder, str(r["folder"])), str(r["variant"]), r.get("wall_s"))
            for r in study["runs"]
        ]
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise CompareError(
            f"{path}: not a study record ({exc.__class__.__name__}: {exc}); it is written by "
            f"tools.study"
        ) from None
    return [(f, v, float(w) if isinstance(w, (int, float)) else None) for f, v, w in runs]


def flat_config(run: str, warn: Warn) -> dict[str, Any]:
    """The run's config.toml as dotted keys ({} with a warning when it is missing or unreadable)."""
    path = os.path.join(run, names.CONFIG_TOML)
    if not os.path.isfile(path):
        warn(f"{path}: missing; the run's seed and config are unknown")
        return {}
    try:
        return dict(
            kv
            for sec, t in read_toml(path).items()
            if isinstance(t, dict)
            for kv in flatten(sec, t)
        )
    except ConfigError as exc:
        warn(f"{path}: {str(exc).splitlines()[0]}; its seed and config are unknown")
        return {}


def history(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of the run's one history: a relaunch from step R replaces the rows after R."""
    kept: list[dict[str, Any]] = []
    for row in rows:
        launch = row.get("launch")
        if isinstance(launch, dict):
            kept = [r for r in kept if r["step"] <= resumed_from(launch)]
        kept.append(row)
    return kept


def resumed_from(launch: dict[str, Any]) -> int:
    """The step a launch resumed from (0: a fresh start)."""
    step = launch.get("resumed_from_step")
    return step if type(step) is int else 0


def _number(row: dict[str, Any], key: str) -> float | None:
    v = row.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def summarize(ref: RunRef, warn: Warn) -> RunSummary:
    """One run folder's numbers (what exists; None for what it did not log)."""
    path = ref.path
    rows = history(list(metrics_rows(os.path.join(path, names.METRICS_JSONL), warn)))
    config = flat_config(path, warn)
    recorded: dict[str, Any] = {}  # run.json's model sizes (trainers since they are recorded)
    launch_s: float | None = None  # the launches' seconds, when every one of them ended
    try:
        run = json.loads(safe_files.read_text(os.path.join(path, names.RUN_JSON)))
        status, step = str(run.get("status")), int(run.get("step") or 0)
        recorded = run.get("model") if isinstance(run.get("model"), dict) else {}
        resolved = run.get("resolved") if isinstance(run.get("resolved"), dict) else config
        secs = [launch.get("seconds") for launch in run.get("launches") or []]
        if secs and all(_number({"s": s}, "s") is not None for s in secs):
            launch_s = float(sum(secs))
    except (OSError, ValueError, AttributeError, TypeError, RecursionError):
        warn(f"{os.path.join(path, names.RUN_JSON)}: unreadable; its status is unknown")
        status, step = "unknown", max((r["step"] for r in rows), default=0)
        resolved = config
    seen = [(r["step"], t) for r in rows if (t := _number(r, "tokens_seen")) is not None]
    xs, ys = [0.0, *(s for s, _ in seen)], [0.0, *(t for _, t in seen)]
    evals = []
    for r in rows:
        losses: list[float] = []
        while (v := _number(r, f"eval_loss_loop_{len(losses) + 1}")) is not None:
            losses.append(v)
        if losses:  # an eval at a step without train scalars: its tokens interpolated
            tokens = _number(r, "tokens_seen")
            evals.append(
                EvalPoint(
                    r["step"],
                    tokens if tokens is not None else float(np.interp(r["step"], xs, ys)),
                    losses,
                )
            )
    gbs, seq = config.get("training.global_batch_size"), config.get("training.seq_len")
    per_step = gbs * seq if type(gbs) is int and type(seq) is int else 0  # tokens per step
    train_s, fpt, last_train = 0.0, None, 0
    for r in rows:
        launch = r.get("launch")
        if isinstance(launch, dict):
            last_train = resumed_from(launch)
        rate, tflops = _number(r, "tokens_per_s"), _number(r, "tflops")
        if rate and rate > 0:
            train_s += (r["step"] - last_train) * per_step / rate
            last_train = r["step"]
            fpt = tflops * 1e12 / rate if tflops else fpt
    scores = {
        k: float(v)
        for r in rows
        for k, v in r.items()
        if k.startswith("downstream/") and _number(r, k) is not None
    }
    return RunSummary(
        path=path,
        study=ref.study,
        variant=ref.variant,
        status=status,
        step=step,
        config=config,
        evals=evals,
        tokens=int(seen[-1][1]) if seen else None,
        flops_per_token=_number(recorded, "flops_per_token") or fpt,
        train_s=train_s if per_step and any(_number(r, "tokens_per_s") for r in rows) else None,
        wall_s=ref.wall_s if ref.wall_s is not None else launch_s,
        scores=scores,
        params=_int(recorded.get("params")),
        active_params=_int(recorded.get("active_params")),
        resolved=resolved,
        losses=[(r["step"], v) for r in rows if (v := _number(r, "loss")) is not None],
    )


def _int(value: Any) -> int | None:
    return value if type(value) is int else None


def group_runs(runs: list[RunSummary]) -> list[Group]:
    """Study runs by variant (``study/variant`` when several studies are compared), plain run
    folders by config (all keys but GROUPING_IGNORES), in the order first seen."""
    studies = {r.study for r in runs if r.study is not None}
    keyed: dict[str, list[RunSummary]] = {}
    plain: dict[str, list[RunSummary]] = {}
    for r in runs:
        if r.study is not None and r.variant is not None:
            study = os.path.basename(os.path.normpath(r.study))
            keyed.setdefault(r.variant if len(studies) == 1 else f"{study}/{r.variant}", []).append(
                r
            )
        else:
            cfg = {k: v for k, v in r.config.items() if k not in GROUPING_IGNORES}
            plain.setdefault(json.dumps(cfg, sort_keys=True, default=str), []).append(r)
    groups = [Group(name, members) for name, members in keyed.items()]
    configs = [json.loads(k) for k in plain]
    differing = sorted(
        k
        for k in {k for c in configs for k in c}
        if len({json.dumps(c.get(k)) for c in configs}) > 1
    )
    for cfg, members in zip(configs, plain.values()):
        if differing and len(differing) <= MAX_NAME_KEYS:
            name = ", ".join(f"{k}={cfg.get(k)}" for k in differing)
        else:
            name = os.path.basename(os.path.normpath(members[0].path))
        groups.append(Group(name, members))
    taken: set[str] = set()
    for g in groups:  # names are table keys: unique
        base, n = g.name, 1
        while g.name in taken:
            n += 1
            g.name = f"{base} ({n})"
        taken.add(g.name)
        g.used = [r for r in g.runs if r.status == "finished"]
        for r in g.runs:
            r.group = g.name
    return groups


def mean_std(values: list[float]) -> dict[str, Any] | None:
    """{"mean", "std" (sample standard deviation, None for one value), "n"}; None for none."""
    if not values:
        return None
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else None,
        "n": len(values),
    }


def _same(values: list[Any]) -> Any:
    """The value all runs share (None when unknown or when they differ)."""
    known = {v for v in values if v is not None}
    return known.pop() if len(known) == 1 else None


def group_numbers(g: Group) -> dict[str, Any]:
    """The group's row: sizes, and mean ± sample std over its finished runs."""
    used = g.used
    loops = max((len(r.final_losses or []) for r in used), default=0)
    tasks = sorted({k for r in used for k in r.scores})
    return {
        "name": g.name,
        "runs": [r.path for r in g.runs],
        "used": [r.path for r in used],
        "seeds": [r.seed for r in used],
        "params": _same([r.params for r in used]),
        "active_params": _same([r.active_params for r in used]),
        "flops_per_token": mean_std([r.flops_per_token for r in used if r.flops_per_token]),
        "tokens": mean_std([float(r.tokens) for r in used if r.tokens is not None]),
        "train_s": mean_std([r.train_s for r in used if r.train_s is not None]),
        "wall_s": mean_std([r.wall_s for r in used if r.wall_s is not None]),
        "final_loss_per_loop": [
            mean_std(
                [r.final_losses[t] for r in used if r.final_losses and len(r.final_losses) > t]
            )
            for t in range(loops)
        ],
        "scores": {k: mean_std([r.scores[k] for r in used if k in r.scores]) for k in tasks},
    }


def run_numbers(r: RunSummary) -> dict[str, Any]:
    return {
        "path": r.path,
        "group": r.group,
        "seed": r.seed,
        "status": r.status,
        "step": r.step,
        "params": r.params,
        "active_params": r.active_params,
        "flops_per_token": r.flops_per_token,
        "tokens": r.tokens,
        "train_s": r.train_s,
        "wall_s": r.wall_s,
        "final_loss_per_loop": r.final_losses,
        "final_eval_step": r.evals[-1].step if r.evals else None,
        "scores": r.scores,
        "evals": [{"step": e.step, "tokens": e.tokens, "losses": e.losses} for e in r.evals],
    }
