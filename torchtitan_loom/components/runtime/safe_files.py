"""Writing, renaming and removing inside a folder without following a planted link.

A run folder may be shared, copied or restored by others; a symbolic link planted where the run
writes (``run.json.partial -> ~/.bashrc``) must not make a relaunch write outside it. So:

    atomic_write   the temporary ``<name>.partial`` (new_temp) is created with O_CREAT | O_EXCL |
                   O_NOFOLLOW (a link there, or at ``<name>`` itself, is refused; a stale regular
                   file from a crash is removed first), fsynced, then renamed over ``<name>``
    create_new     a new file with the same flags (a marker such as KEEP)
    real_dir       a path that is about to be renamed or removed must be a directory, not a link,
                   and lie inside the folder that owns it
    planted_links  the names of a list that are links (the up-front check of a launch)

The folders themselves (job.dump_folder, checkpoint.folder) may be links a user made, e.g. to
another disk: only what the run creates, renames and removes inside them is checked.
Pure filesystem code; every refusal is ``UnsafePathError`` with one line naming the path.
"""

from __future__ import annotations

import os
import shutil

_NEW_FILE = (
    os.O_WRONLY
    | os.O_CREAT
    | os.O_EXCL
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
)


class UnsafePathError(OSError):
    """A link (or a path outside its folder) where the run writes, renames or removes."""


def _refuse_link(path: str) -> None:
    if os.path.islink(path):
        raise UnsafePathError(
            f"{path} is a symbolic link (to {os.readlink(path)!r}); refusing to write "
            f"through it: remove the link"
        )


def create_new(path: str, mode: int = 0o644) -> int:
    """A file descriptor of a file created at ``path`` (FileExistsError when something is there;
    UnsafePathError when that something is a link)."""
    try:
        return os.open(path, _NEW_FILE, mode)
    except FileExistsError:
        _refuse_link(path)
        raise


def new_temp(path: str) -> tuple[int, str]:
    """(descriptor, name) of a new ``<path>.partial`` for a write that replaces ``path``; refuses
    a link at either name, removes a stale regular file left by a write that died."""
    _refuse_link(path)
    tmp = path + ".partial"
    _refuse_link(tmp)
    if os.path.lexists(tmp):
        os.remove(tmp)
    return create_new(tmp), tmp


def atomic_write(path: str, data: str | bytes) -> None:
    """Replace ``path`` with ``data`` (temp file in the same folder, fsync, rename); refuses links."""
    fd, tmp = new_temp(path)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp) and not os.path.islink(tmp):
            os.remove(tmp)
        raise


def real_dir(path: str, owner: str) -> str:
    """``path`` when it is a directory (not a link) inside the folder ``owner``; UnsafePathError
    otherwise."""
    _refuse_link(path)
    if not os.path.isdir(path):
        raise UnsafePathError(f"{path} is not a directory; refusing to rename or remove it")
    inside = os.path.realpath(owner)
    if os.path.commonpath([os.path.realpath(path), inside]) != inside:
        raise UnsafePathError(f"{path} resolves outside {owner}; refusing to rename or remove it")
    return path


def remove_dir(path: str, owner: str) -> None:
    """Delete the directory ``path`` (checked by ``real_dir``) with everything in it; links inside it
    are removed, never followed. Nothing happens when nothing is there."""
    if not os.path.lexists(path):
        return
    shutil.rmtree(real_dir(path, owner))


def planted_links(folder: str, names: list[str]) -> list[str]:
    """Paths of ``folder/<name>`` that are symbolic links."""
    return [os.path.join(folder, n) for n in names if os.path.islink(os.path.join(folder, n))]
