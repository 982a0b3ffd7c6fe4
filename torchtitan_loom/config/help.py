"""What ``--help`` prints: every section and key with its type, value and doc; for a command line,
the values that command would run with (unset [model] keys as the flavor's)."""

from __future__ import annotations

import dataclasses
from typing import Any

from torchtitan_loom.config.aliases import ALIASES, aliases_of
from torchtitan_loom.config.errors import ConfigError
from torchtitan_loom.config.fields import overridden_args
from torchtitan_loom.config.manager import load_config, section_fields, section_types, type_name
from torchtitan_loom.config.schema import SECTION_DOCS, JobConfig


def help_requested(argv: list[str]) -> tuple[bool, list[str]]:
    """(whether --help / -h stands where an option goes, argv without it). A value is not an option:
    ``--job.description -h`` describes the run as "-h"."""
    wanted, rest, i = False, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--help", "-h"):
            wanted, i = True, i + 1
            continue
        takes_next = (
            arg.startswith("--")
            and "=" not in arg
            and i + 1 < len(argv)
            and not argv[i + 1].startswith("--")
        )
        rest += argv[i : i + 1 + takes_next]
        i += 1 + takes_next
    return wanted, rest


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
    flavor = _flavor_values(values if values is not None else JobConfig())
    for sec, cls in section_types(values).items():
        lines.append(f"[{sec}]  {SECTION_DOCS.get(sec, '')}")
        for key, (tp, f) in section_fields(cls).items():
            if f.default is not dataclasses.MISSING:
                default = f.default
            else:
                assert f.default_factory is not dataclasses.MISSING, f"{sec}.{key} has no default"
                default = f.default_factory()
            if values is not None:
                default = getattr(getattr(values, sec), key)
            if sec == "model" and default is None and key in flavor:
                default = _FlavorValue(flavor[key])
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


class _FlavorValue:
    """An unset [model] key in --help: the value the flavor gives it."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"{self.value!r} (unset: the flavor's value)"


def _flavor_values(cfg: JobConfig) -> dict[str, Any]:
    """The model arguments the config resolves to (torch-free), or {} for an unknown name or
    flavor (the problem line names it)."""
    try:
        return dataclasses.asdict(overridden_args(cfg))
    except (ValueError, KeyError, TypeError):
        return {}


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
