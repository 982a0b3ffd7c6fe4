"""The format version of a file a run writes and reads back: run.json (run_folder.RUN_FORMAT_VERSION)
and a checkpoint's meta.json (checkpoint/resolve.FORMAT_VERSION, for the checkpoint it describes).

Each writer stores its constant under ``KEY``. A reader accepts a file without one (the legacy
format, written before versions were: tests/fixtures/ckpt_3d15cf9 proves it still loads) and the
versions it lists, and refuses any other with one line. When to bump: docs/checkpoints.md
("Format versions"). Torch-free: the config checks read run.json before torch is imported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

KEY = "format_version"


def problem(path: str, data: dict[str, Any], reads: Sequence[int], todo: str) -> str | None:
    """None when this code reads ``data`` (the JSON of ``path``); else one line naming the file,
    the version found, the versions read and ``todo`` (what the user can do)."""
    if KEY not in data:
        return None  # legacy: before versions were written
    found = data[KEY]
    known = isinstance(found, int) and not isinstance(found, bool)
    if known and found in reads:
        return None
    newer = known and found > max(reads)
    return (
        f"{path}: {KEY} {found!r} {'(written by a newer torchtitan_loom) ' if newer else ''}is not "
        f"one this torchtitan_loom reads ({', '.join(map(str, reads))}, or none: the legacy "
        f"format); {todo}"
    )
