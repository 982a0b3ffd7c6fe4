"""Load a JobConfig: dataclass defaults < TOML file < CLI overrides, with one-line errors.

CLI forms: ``--section.key value``, ``--section.key=value``, a bare ``--section.flag`` for true,
``--section.flag false``; lists are comma-separated. Unknown sections/keys suggest the nearest valid
name; wrong types name the key, the expected type and the value given. Nothing here creates a
process group or a tensor, so every error surfaces before any is made.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import types
import typing
from typing import Any

from torchtitan_loom.components.checkpoint import names
from torchtitan_loom.config.aliases import ALIASES, AliasError, translate
from torchtitan_loom.config.errors import ConfigError
from torchtitan_loom.config.schema import JobConfig, model_section
from torchtitan_loom.config.toml_file import flatten, read_toml

# Printed problems: the first MAX_PROBLEMS in full (with a suggestion each), then how many more. A
# generated file of 10⁶ unknown keys is answered in seconds, not after 10⁶ fuzzy matches.
MAX_PROBLEMS = 20
# Integers the code can hold: a step, a row count or a seed beyond a signed 64-bit value overflows
# the tensors and generators it reaches (seeds, timeouts and sizes have tighter rules elsewhere).
INT_MAX = 2**63 - 1

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def section_types(cfg: JobConfig | None = None) -> dict[str, type]:
    """Section name -> its dataclass; [model]'s is the chosen model's (that of ``cfg``, else the default)."""
    cfg = JobConfig() if cfg is None else cfg
    return {f.name: type(getattr(cfg, f.name)) for f in dataclasses.fields(JobConfig)}


@functools.lru_cache(maxsize=64)  # a section class never changes; type hints take ~4 ms each
def section_fields(section_cls: type) -> dict[str, tuple[Any, dataclasses.Field]]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: (hints[f.name], f) for f in dataclasses.fields(section_cls)}


def _split_optional(tp: Any) -> tuple[Any, bool]:
    """(inner type, is_optional) for ``X | None``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def type_name(tp: Any) -> str:
    inner, optional = _split_optional(tp)
    name = getattr(inner, "__name__", str(inner))
    if typing.get_origin(inner) is list:
        name = f"list[{typing.get_args(inner)[0].__name__}] (comma-separated)"
    if not optional:
        return name
    if inner is str or typing.get_origin(inner) is list:  # 'none' is text there (_unsets)
        return f"{name}, or unset by not giving it"
    return f"{name} or none (none: unset)"


def _nearest(name: str, options: list[str], prefix: str = "", suggest: bool = True) -> str:
    if not suggest:
        return ""
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    if close:
        return f"; did you mean '{prefix}{close[0]}'?"
    return f"; valid: {', '.join(prefix + o for o in options)}"


def _unsets(inner: Any, value: Any) -> bool:
    """Whether a command-line string unsets an optional key: ``none`` / ``null`` do, but only where
    no value of the key can be spelled so. A text key's ``none`` is that text (``--model.ffn_branch_rms
    none`` is the choice 'none', never "the flavor's value"); such a key is unset by not giving it."""
    if inner is str or typing.get_origin(inner) is list:
        return False
    return str(value).lower() in ("none", "null")


def _coerce(key: str, tp: Any, value: Any, from_cli: bool) -> Any:
    """Convert a TOML value or CLI string to the annotated type, or raise ConfigError."""
    inner, optional = _split_optional(tp)
    if isinstance(value, _BareFlag) and inner is not bool:
        raise ConfigError(f"--{key} is given without a value; it takes {type_name(tp)}")
    if optional and not from_cli:  # a file has no none: an unset key is one left out
        bad = ConfigError(
            f"{key}: expected {type_name(inner)} (leave it out to unset it), got {value!r}"
        )
    else:
        bad = ConfigError(f"{key}: expected {type_name(tp)}, got {value!r}")
    if optional and (value is None or (from_cli and _unsets(inner, value))):
        return None
    if inner is bool:
        if isinstance(value, bool):
            return value
        if from_cli and str(value).lower() in _TRUE | _FALSE:
            return str(value).lower() in _TRUE
        raise bad
    if inner is int:
        if isinstance(value, bool):
            raise bad
        if not isinstance(value, int):
            if not from_cli:
                raise bad
            try:
                value = int(str(value).replace("_", ""))
            except ValueError:
                raise bad from None
        if abs(value) > INT_MAX:
            raise ConfigError(f"{key} = {value}: beyond a 64-bit integer (|value| ≤ 2^63 - 1)")
        return value
    if inner is float:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, (int, float)):
            return float(value)
        if from_cli:
            try:
                return float(value)
            except ValueError:
                raise bad from None
        raise bad
    if inner is str:
        if not isinstance(value, str):
            raise bad
        if "\x00" in value:  # no file name or value of the run can hold one (the OS refuses it)
            raise ConfigError(f"{key} = {value!r}: contains a NUL byte")
        return value
    if typing.get_origin(inner) is list:
        elem = typing.get_args(inner)[0]
        items = value.split(",") if from_cli and isinstance(value, str) else value
        if not isinstance(items, list):
            raise bad
        return [
            _coerce(key, elem, v.strip() if isinstance(v, str) else v, from_cli)
            for v in items
            if v != ""
        ]
    raise ConfigError(f"{key}: unsupported annotation {tp!r}")  # a schema bug, not a user error


Schema = dict[str, dict[str, tuple[Any, dataclasses.Field]]]


def schema_of(cfg: JobConfig) -> Schema:
    """Section -> key -> (annotation, field) of ``cfg``'s sections (read once per load: resolving
    the annotations is the slow part of checking a key)."""
    return {sec: section_fields(cls) for sec, cls in section_types(cfg).items()}


def _set(
    cfg: JobConfig, sections: Schema, dotted: str, value: Any, from_cli: bool, suggest: bool = True
) -> str:
    """Check and set one key (``suggest``: name the nearest valid key of a wrong one); returns the
    key as the schema spells it."""
    try:  # a TorchTitan spelling becomes ours here, before any check (aliases.py)
        dotted, value, _ = translate(dotted.replace("-", "_"), value)
    except AliasError as exc:
        raise ConfigError(str(exc)) from None
    if "." not in dotted:
        raise ConfigError(
            f"'{dotted}': options are --section.key{_nearest(dotted, list(sections), '', suggest)}"
        )
    sec, key = dotted.split(".", 1)
    if sec not in sections:
        raise ConfigError(f"unknown section '{sec}'{_nearest(sec, list(sections), '', suggest)}")
    fields = sections[sec]
    key = key.replace("-", "_")
    if key not in fields and sec == "model":
        raise ConfigError(
            f"model.{key}: not a key of model '{cfg.model.name}'"
            f"{_nearest(key, list(fields), 'model.', suggest)}"
        )
    if key not in fields:
        raise ConfigError(
            f"unknown key '{sec}.{key}'{_nearest(key, list(fields), sec + '.', suggest)}"
        )
    tp, f = fields[key]
    value = _coerce(f"{sec}.{key}", tp, value, from_cli)
    choices = f.metadata.get("choices")
    if choices and value is not None and value not in choices:
        raise ConfigError(f"{sec}.{key}: {value!r} is not one of {', '.join(choices)}")
    setattr(getattr(cfg, sec), key, value)
    return f"{sec}.{key}"


def _unknown_if_empty(sec: str, table: dict[str, Any]) -> list[str]:
    """An empty [section] sets no key, so ``_set`` never sees its name: an unknown one is an error
    all the same (the file's table count is bounded before parsing, toml_file.MAX_TABLES). A
    TorchTitan section of an alias ([debug], [validation]) is known."""
    sections = section_types()
    if table or sec in sections or any(k.startswith(sec + ".") for k in ALIASES):
        return []
    return [f"unknown section '{sec}'{_nearest(sec, list(sections))}"]


class _BareFlag(str):
    """The value of a flag given alone (``--section.flag``): "true" for a bool key, and for any
    other key the sign that its value is missing."""


def parse_cli(argv: list[str]) -> list[tuple[str, Any]]:
    """Split argv into (dotted key, raw value) pairs; a bare flag means true."""
    pairs: list[tuple[str, Any]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; options look like --section.key value")
        body = arg[2:]
        if "=" in body:
            key, value = body.split("=", 1)
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            key, value = body, argv[i + 1]
            i += 2
        else:
            key, value = body, _BareFlag("true")
            i += 1
        pairs.append((key, value))
    return pairs


def problems_message(errors: list[str]) -> str:
    """The first MAX_PROBLEMS problems, one line each, then how many more there are."""
    if len(errors) <= MAX_PROBLEMS:
        return "\n".join(errors)
    more = len(errors) - MAX_PROBLEMS
    return "\n".join(errors[:MAX_PROBLEMS] + [f"... and {more:,} more problems (fix these first)"])


def _both_spellings(alias: str, key: str, origin: str) -> str:
    return f"{alias} and {key} are both given ({origin}): give one of them"


def _per_step(written: str, key: str, value: Any, from_cli: bool) -> tuple[str, str, int]:
    """A step count given for a fraction-of-training key (warmup_steps): checked now, divided later."""
    steps = _coerce(written, int, value, from_cli)
    if steps < 0:
        raise ConfigError(f"{written} = {steps}: must be ≥ 0")
    return written, key, steps


# Where a value came from, in JobConfig.given: the command line, or the file's path.
CLI = "command line"


def _file_sources(path: str, errors: list[str]) -> list[tuple[str, Any, str]]:
    """(dotted key, value, path) of a config file; a table that is not a section, a section that is
    not the schema's and a config_file inside a file are problems (files do not include files)."""
    out: list[tuple[str, Any, str]] = []
    for sec, table in read_toml(path).items():
        if not isinstance(table, dict):
            errors.append(
                f"TOML key '{sec}' must be a [section] table{_nearest(sec, list(section_types()))}"
            )
            continue
        errors += _unknown_if_empty(sec, table)
        try:
            pairs = flatten(sec, table)
        except ConfigError as exc:
            errors.append(str(exc))
            continue
        for key, value in pairs:
            if key.replace("-", "_") == "job.config_file" and _run_record(path):
                continue  # a run's config.toml written before it became a comment: a record
            if key.replace("-", "_") == "job.config_file":
                errors.append(
                    f"job.config_file = {value!r} in {path}: a config file cannot name another; "
                    f"give --job.config_file on the command line"
                )
                continue
            out.append((key, value, path))
    return out


def _run_record(path: str) -> bool:
    """Whether ``path`` is a run folder's own config.toml (run.json beside it): its config_file
    line records where the run's values came from, it names no file to read."""
    folder = os.path.dirname(os.path.abspath(path))
    return os.path.basename(path) == names.CONFIG_TOML and os.path.isfile(
        os.path.join(folder, names.RUN_JSON)
    )


def _flavor_switch_errors(sources: list[tuple[str, Any, str]], cfg: JobConfig) -> list[str]:
    """A file's [model] values were written for its flavor: when the command line chooses another
    model or flavor, each of them must be given again there (else the file's value would silently
    outrank the new flavor's own, e.g. the debug preset's H under loom_329m)."""
    file_meta = {
        k: v for k, v, src in sources if src != CLI and k in ("model.name", "model.flavor")
    }
    cli_keys = {k for k, _, src in sources if src == CLI}
    if not ({"model.name", "model.flavor"} & cli_keys):
        return []
    written_for = (file_meta.get("model.name", cfg.model.name), file_meta.get("model.flavor"))
    if written_for == (cfg.model.name, cfg.model.flavor):
        return []
    return [
        f"{k} = {v!r} ({src}) was written for model {written_for[0]} flavor "
        f"{written_for[1] or 'default'}; the command line chose {cfg.model.name} flavor "
        f"{cfg.model.flavor}: give --{k} there too, or use a config file for that flavor"
        for k, v, src in sources
        if src != CLI and k.startswith("model.") and k not in file_meta and k not in cli_keys
    ]


def load_config(
    argv: list[str], file_values: list[tuple[str, Any]] | None = None, where: str = ""
) -> JobConfig:
    """Build the JobConfig from argv (without the program name). Raises ConfigError naming every
    bad key and value (one line each; an unreadable argv or TOML file stops at once).
    ``file_values``: typed values read as a TOML file reads them (a study's overrides), applied
    after the config file and before the command line, their origin named ``where``.
    The result's ``given`` maps each key a source set to where it came from (CLI or a path)."""
    pairs = parse_cli(argv)
    cfg = JobConfig()
    errors: list[str] = []
    files = [v for k, v in pairs if k.replace("-", "_") == "job.config_file"]
    sources: list[tuple[str, Any, str]] = []  # (key as written, value, origin)
    if files and files[-1]:  # the last one given, as for every key (it is the one recorded)
        sources += _file_sources(str(files[-1]), errors)
    sources += [(k, v, where or "the study file") for k, v in file_values or []]
    sources += [(k, v, CLI) for k, v in pairs]
    # [model]'s keys are the chosen model's: find the name first (the last one given wins).
    names = [v for k, v, _ in sources if k == "model.name"]
    if names:
        try:
            cfg.model = model_section(str(names[-1]))()
        except ValueError as exc:  # the other keys are still checked, against the default model
            errors.append(f"model.name: {exc}")
            sources = [src for src in sources if src[0] != "model.name"]
    schema = schema_of(cfg)
    # Step counts for fraction keys wait for the final training.steps; a later canonical write wins.
    # A later source outranks an earlier one whichever spelling each uses; both spellings in one
    # source are refused (which one is meant cannot be guessed).
    pending: dict[str, tuple[str, str, int]] = {}
    for key, value, origin in sources:
        from_cli = origin == CLI
        try:
            alias = ALIASES.get(key.replace("-", "_"))
            if alias is not None and alias.per_training_step:
                if cfg.given.get(alias.key) == origin:
                    errors.append(_both_spellings(key, alias.key, origin))
                pending[alias.key] = _per_step(key, alias.key, value, from_cli)
                cfg.given[alias.key] = origin
                continue
            dotted = _set(cfg, schema, key, value, from_cli, suggest=len(errors) < MAX_PROBLEMS)
            if dotted in pending and cfg.given.get(dotted) == origin:
                errors.append(_both_spellings(pending[dotted][0], dotted, origin))
            pending.pop(dotted, None)
            cfg.given[dotted] = origin
        except ConfigError as exc:
            errors.append(str(exc))
    for written, key, steps in pending.values():
        total = cfg.training.steps
        if total < 1 or steps > total:
            errors.append(f"{written} = {steps}: must lie in [0, training.steps = {total}]")
        else:
            _set(cfg, schema, key, steps / total, from_cli=False)
    errors += _flavor_switch_errors(sources, cfg)
    if errors:
        raise ConfigError(problems_message(errors), partial=cfg)
    return cfg
