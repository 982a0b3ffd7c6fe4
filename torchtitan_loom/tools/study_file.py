"""The study file of ``tools.study``: reading and checking it, and the plan it makes (one run per
variant and seed, variant-major, seeds inner), each run's trainer arguments checked with the
trainer's own config loader (``config.load_config``). No torch import.

    [study]
    name = "depth"                          # optional, default: the file's stem
    config_file = "train_configs/debug_model.toml"
    overrides = { "training.steps" = 120 }  # every run
    seeds = [0, 1, 2]                       # training.seed of each run
    folder = "outputs/studies/depth"        # optional, default outputs/studies/<name>

    [variants.H3]
    "model.num_loops" = 3

Paths are relative to the current directory, as run_train.sh's are. A run's arguments are
``--job.config_file F --job.dump_folder <folder>/<variant>/seed-<s> --training.seed s``, then the
checkpoint keys the study adds (``checkpoint_args``), then the [study] overrides, then the
variant's. Every problem is one line naming the key and what is valid (StudyError).
"""

from __future__ import annotations

import difflib
import os
import re
import stat
import sys
from dataclasses import dataclass
from typing import Any

from torchtitan_loom.config.aliases import AliasError, translate
from torchtitan_loom.config.manager import INT_MAX, ConfigError, load_config
from torchtitan_loom.config.schema import JobConfig
from torchtitan_loom.config.toml_file import flatten, read_toml
from torchtitan_loom.tools.study_check import alike_problems, round_trip_problems, typed_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

STUDY_JSON = "study.json"  # the study's record in its folder (tools.compare reads it)
STUDY_KEYS = ("name", "config_file", "overrides", "seeds", "folder")
# Set by the study itself: an override of one would break where a run lives or what it is.
STUDY_OWNED = {
    "job.config_file": "[study] config_file",
    "job.dump_folder": "[study] folder (each run is <folder>/<variant>/seed-<s>)",
    "training.seed": "[study] seeds",
    "job.overwrite": "nothing: the study skips finished runs and resumes cut ones",
}
# A folder name on every file system; "compare" is where tools.compare writes by default.
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
RESERVED_NAMES = ("compare",)
MAX_STUDY_BYTES = 1 << 20
# Checkpoints a run saves when the study turns them on (checkpoint_args): a cut run loses at
# most a tenth of its steps, and a short run does not spend its time saving.
SAVES_PER_RUN = 10


class StudyError(ValueError):
    """A bad study file: one line per problem, each naming the key and what is valid."""


@dataclass(frozen=True)
class Study:
    """A checked study file."""

    path: str
    name: str
    config_file: str
    overrides: dict[str, Any]
    seeds: list[int]
    folder: str
    variants: dict[str, dict[str, Any]]


@dataclass(frozen=True)
class PlannedRun:
    """One run of the study: ``args`` are the trainer's config arguments (without the launcher)."""

    index: int  # 1-based, in plan order
    variant: str
    seed: int
    folder: str
    args: list[str]
    steps: int  # training.steps of the run
    checkpoint_folder: str  # checkpoint.folder, relative to the run folder


def _nearest(name: str, options: tuple[str, ...] | list[str]) -> str:
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.5)
    return f"did you mean '{close[0]}'?" if close else f"valid: {', '.join(options)}"


def plain_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a folder name of the study, else None."""
    if not _PLAIN_NAME.match(name) or name in (".", ".."):
        return "must be a plain folder name (letters, digits, '.', '_', '-'; at most 100)"
    if name in RESERVED_NAMES:
        return f"'{name}' is reserved (tools.compare writes <study folder>/{name}/)"
    return None


def _overrides(where: str, table: Any, errors: list[str]) -> dict[str, Any]:
    """Dotted key -> value of an overrides table (``"a.b" = v`` or nested ``[x.a] b = v``)."""
    if not isinstance(table, dict):
        errors.append(f'{where}: expected a table of "section.key" = value, got {table!r}')
        return {}
    out: dict[str, Any] = {}
    for key, value in table.items():
        pairs = flatten(key, value) if isinstance(value, dict) else [(key, value)]
        for dotted, v in pairs:
            try:
                canonical = translate(dotted.replace("-", "_"), v)[0]
            except AliasError:
                canonical = dotted  # the loader names the problem
            if canonical in STUDY_OWNED:
                errors.append(
                    f"{where}: {dotted} is set by the study, not an override; use "
                    f"{STUDY_OWNED[canonical]}"
                )
                continue
            try:
                cli_value(dotted, v)
            except StudyError as exc:
                errors.append(f"{where}: {exc}")
                continue
            out[dotted] = v
    return out


def _read(path: str) -> dict[str, Any]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise StudyError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO would block, a folder never parse
            raise StudyError(f"{path}: not a regular file; give a study TOML file")
        data = fh.read(MAX_STUDY_BYTES + 1)
    if len(data) > MAX_STUDY_BYTES:
        raise StudyError(f"{path}: over {MAX_STUDY_BYTES >> 20} MiB; a study file is a few KiB")
    try:
        return tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError) as exc:
        raise StudyError(f"{path}: not valid TOML ({exc})") from None


def read_study(path: str) -> Study:
    """The checked study file; StudyError with every problem found (one line each)."""
    doc, errors = _read(path), []
    for top in doc:
        if top not in ("study", "variants"):
            errors.append(f"{path}: unknown table [{top}]; valid: [study], [variants.<name>]")
    st = doc.get("study")
    if not isinstance(st, dict):
        raise StudyError(
            "\n".join([*errors, f"{path}: no [study] table; it needs config_file and seeds"])
        )
    for key in st:
        if key not in STUDY_KEYS:
            errors.append(f"[study] {key}: unknown key; {_nearest(key, STUDY_KEYS)}")
    stem = os.path.splitext(os.path.basename(path))[0]
    name = st.get("name", stem)
    if not isinstance(name, str) or plain_name_problem(name):
        why = plain_name_problem(name) if isinstance(name, str) else "must be a string"
        src = "[study] name" if "name" in st else f"the file's stem '{stem}' (no [study] name)"
        errors.append(f"{src}: {why}")
    config_file = st.get("config_file")
    if not isinstance(config_file, str) or not config_file:
        errors.append("[study] config_file: required, the path of a trainer config TOML")
    elif not os.path.isfile(config_file):
        errors.append(
            f"[study] config_file: no such file '{config_file}' (relative to the current "
            f"directory {os.getcwd()})"
        )
    seeds = st.get("seeds")
    if not isinstance(seeds, list) or not seeds:
        errors.append("[study] seeds: required, a non-empty list of integers, e.g. [0, 1, 2]")
        seeds = []
    for s in seeds:
        if type(s) is not int or not 0 <= s <= INT_MAX:
            errors.append(f"[study] seeds: {s!r} is not an integer in [0, 2^63 - 1]")
    ints = [s for s in seeds if type(s) is int]
    dup = sorted({s for s in ints if ints.count(s) > 1})
    if dup:
        errors.append(f"[study] seeds: {', '.join(map(str, dup))} given twice; each seed once")
    folder = st.get("folder", os.path.join("outputs", "studies", str(name)))
    if not isinstance(folder, str) or not folder:
        errors.append("[study] folder: must be a non-empty path")
    overrides = _overrides("[study] overrides", st.get("overrides", {}), errors)
    variants: dict[str, dict[str, Any]] = {}
    table = doc.get("variants", {})
    if not isinstance(table, dict) or not table:
        errors.append(
            "no [variants.<name>] table; add one per variant (an empty one runs the base config)"
        )
        table = {}
    lower: dict[str, str] = {}
    for vname, vtable in table.items():
        problem = plain_name_problem(vname)
        if problem:
            errors.append(f"[variants.{vname}]: the variant name {problem}")
        elif vname.lower() in lower:
            errors.append(
                f"[variants.{vname}]: differs from [variants.{lower[vname.lower()]}] only in case "
                f"(one folder on a case-insensitive file system); rename one"
            )
        lower.setdefault(vname.lower(), vname)
        variants[vname] = _overrides(f"[variants.{vname}]", vtable, errors)
    if errors:
        raise StudyError("\n".join(errors))
    assert isinstance(name, str) and isinstance(config_file, str) and isinstance(folder, str)
    return Study(path, name, config_file, overrides, list(seeds), folder, variants)


def cli_value(key: str, value: Any) -> str:
    """A TOML value as the trainer's command line writes it (lists comma-separated)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return value if isinstance(value, str) else repr(value)
    if isinstance(value, list) and all(
        isinstance(v, (bool, int, float, str)) and "," not in str(v) for v in value
    ):
        return ",".join(cli_value(key, v) for v in value)
    raise StudyError(
        f"{key} = {value!r}: expected a number, string, boolean or a list of them (without commas)"
    )


def override_args(overrides: dict[str, Any]) -> list[str]:
    """``--section.key value`` per override; ``--section.key=value`` when the value is empty or
    starts with '-' (it would read as the next option, or as run_train.sh's -h)."""
    out: list[str] = []
    for key, value in overrides.items():
        text = cli_value(key, value)
        out += [f"--{key}={text}"] if text == "" or text.startswith("-") else [f"--{key}", text]
    return out


def _problems(argv: list[str]) -> list[str]:
    try:
        load_config(argv)
    except ConfigError as exc:
        return str(exc).splitlines()
    return []


def checkpoint_args(study: Study, variant: str, cfg: JobConfig) -> list[str]:
    """What the study adds so that a cut run resumes: checkpoint.enable = true (unless the study's
    overrides set it), and checkpoint.interval = ceil(training.steps / SAVES_PER_RUN) unless the
    config file or the overrides set one (the debug preset's enable alone saves the last step)."""
    named = {k.replace("-", "_") for k in (*study.overrides, *study.variants[variant])}
    if "checkpoint.enable" in named:
        return []
    in_file = {
        k.replace("-", "_")
        for sec, t in read_toml(study.config_file).items()
        if isinstance(t, dict)
        for k, _ in flatten(sec, t)
    }
    if "checkpoint.interval" in named | in_file:
        return ["--checkpoint.enable", "true"]
    interval = max(1, -(-cfg.training.steps // SAVES_PER_RUN))
    return ["--checkpoint.enable", "true", "--checkpoint.interval", str(interval)]


def plan(study: Study) -> tuple[list[PlannedRun], dict[str, JobConfig]]:
    """Every run with its checked arguments, in order, and each run folder's config; StudyError
    with every problem the config loader finds (one line each, naming where it comes from)."""
    base = ["--job.config_file", study.config_file]
    errors: list[str] = []
    common = override_args(study.overrides)  # values checked by read_study
    per_variant = {v: override_args(o) for v, o in study.variants.items()}
    file_problems = _problems(base)
    errors += [
        p if p.startswith("job.config_file") else f"[study] config_file: {p}" for p in file_problems
    ]
    study_problems = [p for p in _problems(base + common) if p not in file_problems]
    errors += [f"[study] overrides: {p}" for p in study_problems]
    for v, args in per_variant.items():
        known = {*file_problems, *study_problems}
        errors += [
            f"[variants.{v}]: {p}" for p in _problems(base + common + args) if p not in known
        ]
    if errors:
        raise StudyError("\n".join(dict.fromkeys(errors)))
    runs: list[PlannedRun] = []
    configs: dict[str, JobConfig] = {}
    per_run: list[tuple[str, int, str]] = []
    trained: dict[str, tuple[JobConfig, bool]] = {}  # variant -> its first seed's config
    for v, args in per_variant.items():
        for seed in study.seeds:
            folder = os.path.join(study.folder, v, f"seed-{seed}")
            head = [*base, "--job.dump_folder", folder, "--training.seed", str(seed)]
            try:
                ckpt = checkpoint_args(study, v, load_config(head + common + args))
                cfg = load_config(head + ckpt + common + args)
                values = {**study.overrides, **study.variants[v]}  # as a TOML file reads them
                typed = typed_config(head + ckpt, values, "the study file")
            except ConfigError as exc:
                per_run += [(v, seed, p) for p in str(exc).splitlines()]
                continue
            per_run += [(v, seed, p) for p in round_trip_problems(typed, cfg, "the study file")]
            trained.setdefault(v, (typed, bool(study.variants[v])))
            full = head + ckpt + common + args
            runs.append(
                PlannedRun(
                    len(runs) + 1, v, seed, folder, full, cfg.training.steps, cfg.checkpoint.folder
                )
            )
            configs[folder] = cfg
    if per_run:
        raise StudyError("\n".join(by_seeds(per_run)))
    first = [*base, "--training.seed", str(study.seeds[0])]
    alike = alike_problems(typed_config(first, study.overrides, "[study] overrides"), trained)
    if alike:
        raise StudyError("\n".join(alike))
    return runs, configs


def by_seeds(problems: list[tuple[str, int, str]]) -> list[str]:
    """One line per (variant, problem), naming the seeds it holds for (in order first seen)."""
    seeds: dict[tuple[str, str], list[int]] = {}
    for variant, seed, problem in problems:
        seeds.setdefault((variant, problem), []).append(seed)
    return [
        f"[variants.{v}] seed{'s' * (len(s) > 1)} {', '.join(map(str, s))}: {p}"
        for (v, p), s in seeds.items()
    ]


def study_record(study: Study, runs: list[PlannedRun], wall: dict[str, float]) -> dict[str, Any]:
    """study.json: what the study is, and its runs (folders relative to the study folder, with
    the wall seconds the study's launches of each took, where known)."""
    return {
        "name": study.name,
        "study_file": study.path,
        "config_file": study.config_file,
        "overrides": study.overrides,
        "seeds": study.seeds,
        "variants": study.variants,
        "runs": [
            {
                "variant": r.variant,
                "seed": r.seed,
                "folder": os.path.relpath(r.folder, study.folder),
                "args": r.args,
                "wall_s": wall.get(os.path.relpath(r.folder, study.folder)),
            }
            for r in runs
        ],
    }
