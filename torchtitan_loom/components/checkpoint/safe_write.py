"""DCP's file writer, creating every file it writes as a new file, never through a link.

DCP's FileSystem opens each file with ``open(path, "wb")``, which follows a link planted in the
temporary folder during the save (``__0_0.distcp -> a file outside``) and writes the checkpoint
into it. ``SafeWriter`` creates each file O_CREAT | O_EXCL | O_NOFOLLOW: the temporary folder is
empty when the save starts (saving.py prepares it), so anything already at a name was planted,
and the save fails (nothing is committed, older checkpoints stay). The commit then refuses a link
anywhere in the folder (integrity.missing_data_files).
"""

from __future__ import annotations

import io
import os
from collections.abc import Generator
from contextlib import contextmanager
from typing import cast

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

from torchtitan_loom.components.runtime.safe_files import UnsafePathError

_NEW = os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class _NewFilesOnly(FileSystem):
    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if "r" in mode and "+" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        try:
            fd = os.open(path, os.O_WRONLY | _NEW, 0o644)
        except FileExistsError:  # UnsafePathError: saving.py makes it one `checkpoint error:` line
            what = "a symbolic link" if os.path.islink(path) else "something"
            raise UnsafePathError(
                f"{path}: {what} was placed there during the save; refusing to write through it"
            ) from None
        with os.fdopen(fd, mode) as stream:
            yield cast(io.IOBase, stream)  # what DCP's own create_stream yields


class SafeWriter(FileSystemWriter):
    """FileSystemWriter whose files are created new, never written through a link."""

    def __init__(self, path: str | os.PathLike, **kwargs) -> None:
        super().__init__(path, **kwargs)
        self.fs = _NewFilesOnly()
