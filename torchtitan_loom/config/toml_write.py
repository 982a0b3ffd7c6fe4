"""The resolved config as TOML: what a run folder's ``config.toml`` holds and ``load_config`` reads
back (strings escaped so that any value, a newline included, reads back as itself)."""

from __future__ import annotations

from typing import Any

from torchtitan_loom.config.schema import JobConfig


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return _toml_string(str(v))


def _toml_string(text: str) -> str:
    """A TOML basic string: backslash, quote and every control character escaped, so a value with
    a newline or a tab reads back as itself."""
    out = []
    for ch in text:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def to_toml(cfg: JobConfig) -> str:
    """The resolved config as TOML that load_config reads back (None values are omitted)."""
    out = []
    for sec, table in cfg.to_dict().items():
        out.append(f"[{sec}]")
        for k, v in table.items():
            if (sec, k) == ("job", "config_file"):  # a file names no other file (load_config)
                out.append(
                    f"# config_file = {_toml_value(v)}: the file these values were read from"
                )
            elif v is not None:
                out.append(f"{k} = {_toml_value(v)}")
        out.append("")
    return "\n".join(out)
