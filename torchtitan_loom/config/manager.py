"""Load a JobConfig: dataclass defaults < TOML file < CLI overrides, with one-line errors.

CLI forms: ``--section.key value``, ``--section.key=value``, a bare ``--section.flag`` for true,
``--section.flag false``; lists are comma-separated. Unknown sections/keys suggest the nearest valid
name; wrong types name the key, the expected type and the value given. Nothing here creates a
process group or a tensor, so every error surfaces before any is made.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any

from torchtitan_loom.config.aliases import ALIASES, AliasError, aliases_of, translate
from torchtitan_loom.config.errors import ConfigError
from torchtitan_loom.config.schema import SECTION_DOCS, JobConfig, model_section
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
    return f"{name} or none" if optional else name


def _nearest(name: str, options: list[str], prefix: str = "", suggest: bool = True) -> str:
    if not suggest:
        return ""
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    if close:
        return f"; did you mean '{prefix}{close[0]}'?"
    return f"; valid: {', '.join(prefix + o for o in options)}"


def _coerce(key: str, tp: Any, value: Any, from_cli: bool) -> Any:
    """Convert a TOML value or CLI string to the annotated type, or raise ConfigError."""
    inner, optional = _split_optional(tp)
    if isinstance(value, _BareFlag) and inner is not bool:
        raise ConfigError(f"--{key} is given without a value; it takes {type_name(tp)}")
    bad = ConfigError(f"{key}: expected {type_name(tp)}, got {value!r}")
    if optional and (value is None or (from_cli and str(value).lower() in ("none", "null"))):
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
) -> None:
    """Check and set one key (``suggest``: name the nearest valid key of a wrong one)."""
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


def _per_step(written: str, key: str, value: Any, from_cli: bool) -> tuple[str, str, int]:
    """A step count given for a fraction-of-training key (warmup_steps): checked now, divided later."""
    steps = _coerce(written, int, value, from_cli)
    if steps < 0:
        raise ConfigError(f"{written} = {steps}: must be ≥ 0")
    return written, key, steps


def load_config(argv: list[str]) -> JobConfig:
    """Build the JobConfig from argv (without the program name). Raises ConfigError naming every
    bad key and value (one line each; an unreadable argv or TOML file stops at once)."""
    pairs = parse_cli(argv)
    cfg = JobConfig()
    errors: list[str] = []
    config_file = next((v for k, v in pairs if k in ("job.config_file", "job.config-file")), "")
    sources: list[tuple[str, Any, bool]] = []
    if config_file:
        for sec, table in read_toml(config_file).items():
            if not isinstance(table, dict):
                errors.append(
                    f"TOML key '{sec}' must be a [section] table{_nearest(sec, list(section_types()))}"
                )
                continue
            errors += _unknown_if_empty(sec, table)
            try:
                sources += [(k, v, False) for k, v in flatten(sec, table)]
            except ConfigError as exc:
                errors.append(str(exc))
    sources += [(k, v, True) for k, v in pairs]
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
    pending: dict[str, tuple[str, str, int]] = {}
    for key, value, from_cli in sources:
        try:
            alias = ALIASES.get(key.replace("-", "_"))
            if alias is not None and alias.per_training_step:
                pending[alias.key] = _per_step(key, alias.key, value, from_cli)
                continue
            _set(cfg, schema, key, value, from_cli, suggest=len(errors) < MAX_PROBLEMS)
            pending.pop(key.replace("-", "_"), None)
        except ConfigError as exc:
            errors.append(str(exc))
    for written, key, steps in pending.values():
        total = cfg.training.steps
        if total < 1 or steps > total:
            errors.append(f"{written} = {steps}: must lie in [0, training.steps = {total}]")
        else:
            _set(cfg, schema, key, steps / total, from_cli=False)
    if errors:
        raise ConfigError(problems_message(errors), partial=cfg)
    return cfg


def help_text(argv: list[str] | None = None) -> str:
    """Every section and key with its type, value and doc (what --help prints). With ``argv`` (the
    rest of the command line: a config file, overrides), each value is the one that command would
    run with, and the header names the file it came from; a problem in it is named, and the
    schema's defaults shown instead."""
    values, source, problem = None, "the schema's defaults (no config file)", None
    if argv:
        try:
            values = load_config(argv)
        except ConfigError as exc:
            problem = str(exc).splitlines()[0]
        else:
            file = values.job.config_file
            source = f"{file} over the schema's defaults" if file else "the schema's defaults"
            if any(a.startswith("--") and "config_file" not in a for a in argv):
                source += ", with the command line's overrides"
    lines = [
        "usage: run_train.sh [--job.config_file FILE] [--section.key VALUE ...]",
        "Precedence: CLI > TOML > defaults. Booleans: --section.flag / --section.flag false.",
        f"Values shown: {source}."
        if problem is None
        else f"Values shown: the schema's defaults "
        f"(the command's config has a problem: {problem}).",
        "",
    ]
    for sec, cls in section_types().items():
        lines.append(f"[{sec}]  {SECTION_DOCS.get(sec, '')}")
        for key, (tp, f) in section_fields(cls).items():
            if f.default is not dataclasses.MISSING:
                default = f.default
            else:
                assert f.default_factory is not dataclasses.MISSING, f"{sec}.{key} has no default"
                default = f.default_factory()
            if values is not None and sec != "model":
                default = getattr(getattr(values, sec), key)
            extra = (
                f" (one of: {', '.join(f.metadata['choices'])})"
                if f.metadata.get("choices")
                else ""
            )
            lines.append(
                f"  --{sec}.{key}  {type_name(tp)} = {default!r}{extra}{_alias_note(f'{sec}.{key}')}"
            )
            lines.append(f"      {f.metadata.get('doc', '')}")
        lines.append("")
    return "\n".join(lines)


def _alias_note(key: str) -> str:
    """' (TorchTitan: --a.b, values x = y)' for a key with TorchTitan spellings or value translations."""
    notes = [
        f"--{tt}" + (" (steps, → steps / training.steps)" if ALIASES[tt].per_training_step else "")
        for tt in aliases_of(key)
    ]
    for tt, a in ALIASES.items():
        if a.key == key and a.values:
            notes.append(
                ", ".join(f"{tt.rsplit('.', 1)[1]} {v!r} = {o!r}" for v, o in a.values.items())
            )
    return f"  (TorchTitan: {'; '.join(notes)})" if notes else ""


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_toml(cfg: JobConfig) -> str:
    """The resolved config as TOML that load_config reads back (None values are omitted)."""
    out = []
    for sec, table in cfg.to_dict().items():
        out.append(f"[{sec}]")
        out += [f"{k} = {_toml_value(v)}" for k, v in table.items() if v is not None]
        out.append("")
    return "\n".join(out)
