"""The export's own error and file modes (tools/export.py and tools/hf_export.py write exports;
components/checkpoint/found.py reads checkpoints and exports)."""

from __future__ import annotations

import os


class ExportError(ValueError):
    """A checkpoint that cannot be exported, or an export that does not match its source."""


def umask_mode() -> int:
    """The mode ``open()`` gives a new file under this process's umask (0o644 under umask 022)."""
    mask = os.umask(0o022)  # the umask is read by setting it; it is put back at once
    os.umask(mask)
    return 0o666 & ~mask


def give_umask_mode(folder: str, files: list[str]) -> None:
    """Exported files get the umask's mode: safetensors and the O_EXCL temporary files create them
    0600, which another user or an inference server could not read. Changed through a descriptor
    opened O_NOFOLLOW: a link planted at a name since it was written is refused, not followed."""
    mode = umask_mode()
    for name in files:
        path = os.path.join(folder, name)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK)
        except OSError:
            if os.path.islink(path):
                raise ExportError(f"{path} became a symbolic link; refusing to change it") from None
            raise
        try:
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
