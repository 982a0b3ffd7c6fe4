"""Whether a failed checkpoint write ran out of disk: the one-line reason the save reports (torch's
writers lose the errno), and the bytes a checkpoint folder holds (what the next save needs)."""

from __future__ import annotations

import os
import shutil

_NEARLY_FULL_BYTES = 4 << 20


def dir_bytes(path: str) -> int:
    """Bytes of every file under ``path`` (0 when it does not exist)."""
    total = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            try:
                total += os.path.getsize(os.path.join(dirpath, name))
            except OSError:
                pass
    return total


def explain_write_failure(path: str, exc: BaseException, needed_bytes: int) -> str | None:
    """ "no space left on <path> (...)" when a failed write of a checkpoint of about
    ``needed_bytes`` ran out of disk (or quota), else None.

    torch's writers lose the errno ("unexpected pos ..."), so after looking through the exception
    chain this compares what the save needs with what it wrote plus what is still free, and
    calls a disk with under 4 MiB free full. Call it before removing ``path``."""
    import errno

    full = (errno.ENOSPC, errno.EDQUOT)
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in full:
            return f"no space left on {path}"
        seen = seen.__cause__ or seen.__context__
    base = path if os.path.isdir(path) else os.path.dirname(path)
    try:
        free = shutil.disk_usage(base).free
    except OSError:
        return None
    written = dir_bytes(path)
    # Short of room for the whole checkpoint, or (the write failed at its very end) next to nothing free.
    if (needed_bytes and free + written < needed_bytes) or free < _NEARLY_FULL_BYTES:
        return (
            f"no space left on {path} (the checkpoint needs about {needed_bytes / 2**20:.1f} MiB, "
            f"{(free + written) / 2**20:.1f} MiB were available)"
        )
    return None
