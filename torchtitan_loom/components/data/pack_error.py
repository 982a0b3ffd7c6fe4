"""PackError and the helpers every pack check uses to build its one line (pack, problem, what is
valid). Its own module so the metadata, array and layout checks can share it without importing
each other."""

from __future__ import annotations

from pathlib import Path

from torchtitan_loom.components.runtime.messages import shorten

REPACK = "re-pack the corpus (python -m torchtitan_loom.tools.pack ... --force) or restore the file"
_SHOWN_CHARS = 40  # an echoed metadata value: enough to recognise it, never a whole blob


class PackError(ValueError):
    """A pack that cannot be used: the message names the pack, the problem and what is valid."""


def fail(path: Path, problem: str, valid: str) -> PackError:
    """PackError with the house line: ``pack '<dir>': <problem>; <what is valid / what to do>``."""
    return PackError(f"pack {shorten(str(path))!r}: {problem}; {valid}")


def shown(value: object) -> str:
    """A JSON value as a short, one-line echo: strings quoted, containers by kind and size (a deep
    nest is never walked), anything else by repr (inf, nan, 1.5), cut to ~40 characters."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return f"a JSON object of {len(value)} keys"
    if isinstance(value, list):
        return f"a JSON array of {len(value)} items"
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."
