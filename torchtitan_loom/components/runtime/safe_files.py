"""Writing, renaming and removing inside a folder without following a planted link.

A run folder may be shared, copied or restored by others; a symbolic link planted where the run
writes (``run.json.partial -> ~/.bashrc``) must not make a relaunch write outside it. So:

    atomic_write   the temporary ``<name>.partial`` (new_temp) is created with O_CREAT | O_EXCL |
                   O_NOFOLLOW (a link there, or at ``<name>`` itself, is refused; a stale regular
                   file from a crash is removed first), fsynced, then renamed over ``<name>``
    create_new     a new file with the same flags (a marker such as KEEP)
    open_append    a log file (metrics.jsonl) opened O_APPEND | O_NOFOLLOW: the descriptor stays
                   bound to the run's own file, whatever is planted at the name later
    check_inside   no component between the owning folder and a path is a link (a folder such as
                   ``snapshots/`` or ``tb/`` replaced by a link mid-run is refused at the next write)
    make_dirs      create the folders down to a path, each checked as it is made or found
    real_dir       a path that is about to be renamed or removed must be a directory, not a link,
                   and lie inside the folder that owns it with no link on the way
    planted_links  the names of a list that are links (the up-front check of a launch)
    HeldFolder     a folder path that remembers the directory it named (device, inode): the run
                   folder and the checkpoint folder are held from the launch, and every function
                   here given one as ``owner`` first checks that the name still leads there (a run
                   folder swapped for a link mid-run stops the run; nothing goes outside)
    read_text      a small file the run reads back (run.json, RUN.lock, a checkpoint's JSON files):
                   opened O_NOFOLLOW | O_NONBLOCK (a FIFO does not block the open), a regular file
                   only, at most a size its format allows (a link to /dev/zero is refused, not read)

Every writer calls these at the moment it writes, not only before the launch: a link planted while
the run goes on is refused by the next write, rename or removal that would go through it.
The folders themselves (job.dump_folder, checkpoint.folder) may be links a user made, e.g. to
another disk: only what the run creates, renames and removes inside them is checked.
Pure filesystem code; every refusal is ``UnsafePathError`` with one line naming the path.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat

_NEW_FILE = (
    os.O_WRONLY
    | os.O_CREAT
    | os.O_EXCL
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
)


class UnsafePathError(OSError):
    """A link (or a path outside its folder) where the run writes, renames or removes."""


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)  # follows a link the user made (a folder on another disk): its target
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st.st_dev, st.st_ino


class HeldFolder(str):
    """A folder's path that holds the directory it named when made (or when first found, if it
    did not exist yet): ``check`` raises UnsafePathError once the name leads elsewhere — the
    folder was moved or deleted, or replaced by a link to another — so nothing more is written,
    renamed or removed through it. ``within``: a held folder above it, checked first. Used as a
    plain ``str`` everywhere else (joins, messages, the config)."""

    within: HeldFolder | None
    identity: tuple[int, int] | None

    def __new__(cls, path: str, within: HeldFolder | None = None) -> HeldFolder:
        obj = super().__new__(cls, path)
        obj.within, obj.identity = within, _identity(path)
        return obj

    def check(self) -> None:
        if self.within is not None:
            self.within.check()
        now = _identity(self)
        if self.identity is None:  # made since it was held: held from now on
            self.identity = now
            return
        if now != self.identity:
            link = f" (now a link to {os.readlink(self)!r})" if os.path.islink(self) else ""
            raise UnsafePathError(
                f"{self} is no longer the folder this run started in{link}; it was moved, "
                f"deleted or replaced: stopping without writing or removing anything through it"
            )


def check_held(path: str) -> None:
    """``path.check()`` when ``path`` is a HeldFolder; nothing for a plain path."""
    if isinstance(path, HeldFolder):
        path.check()


def _refuse_link(path: str) -> None:
    if os.path.islink(path):
        raise UnsafePathError(
            f"{path} is a symbolic link (to {os.readlink(path)!r}); refusing to write "
            f"through it: remove the link"
        )


def check_inside(path: str, owner: str) -> str:
    """``path`` when it lies inside the folder ``owner`` and no existing component below ``owner``
    (``path`` itself included) is a symbolic link; UnsafePathError otherwise. ``owner`` itself may
    be a link (a folder a user put on another disk); a HeldFolder ``owner`` must still be the
    directory it held."""
    check_held(owner)
    rel = os.path.relpath(os.path.normpath(path), os.path.normpath(owner))
    if rel == os.pardir or rel.startswith(os.pardir + os.sep) or os.path.isabs(rel):
        raise UnsafePathError(f"{path} lies outside {owner}; refusing to write there")
    here = os.path.normpath(owner)
    for part in [] if rel == os.curdir else rel.split(os.sep):
        here = os.path.join(here, part)
        _refuse_link(here)
    return path


def make_dirs(path: str, owner: str) -> str:
    """Create the directories from ``owner`` down to ``path`` (those missing), refusing a link or a
    file at any of them below ``owner``; returns ``path``."""
    check_inside(path, owner)
    os.makedirs(owner, exist_ok=True)  # the user's folder: a link there is theirs to make
    rel = os.path.relpath(os.path.normpath(path), os.path.normpath(owner))
    here = os.path.normpath(owner)
    for part in [] if rel == os.curdir else rel.split(os.sep):
        here = os.path.join(here, part)
        try:
            os.mkdir(here)  # never follows a link at ``here``: EEXIST
        except FileExistsError:
            _refuse_link(here)
            if not os.path.isdir(here):
                raise UnsafePathError(
                    f"{here} is not a directory; refusing to write into it"
                ) from None
    return path


def open_append(path: str, owner: str):
    """A text file object appending to ``path`` (created if missing), never through a link."""
    check_inside(os.path.dirname(path) or owner, owner)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
    try:  # O_NONBLOCK: a FIFO at the name fails (ENXIO) or opens at once, never waits
        fd = os.open(path, flags | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as exc:
        _refuse_link(path)  # ELOOP from O_NOFOLLOW: say which link
        if exc.errno == errno.ENXIO:
            raise UnsafePathError(
                f"{path} is a FIFO, not a regular file; refusing to write to it"
            ) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafePathError(f"{path} is not a regular file; refusing to write to it")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "a", encoding="utf-8")


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


def atomic_write(path: str, data: str | bytes, owner: str | None = None) -> None:
    """Replace ``path`` with ``data`` (temp file in the same folder, fsync, rename); refuses links
    (with ``owner``: also a link on the way from ``owner`` to ``path``'s folder)."""
    if owner is not None:
        check_inside(os.path.dirname(path), owner)
    fd, tmp = new_temp(path)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if os.path.lexists(tmp) and not os.path.islink(tmp):
            os.remove(tmp)
        if isinstance(exc, OSError) and not exc.filename and exc.errno:  # say which file
            raise OSError(exc.errno, exc.strerror, path) from None
        raise


def real_dir(path: str, owner: str) -> str:
    """``path`` when it is a directory (not a link) inside the folder ``owner``, reached from
    ``owner`` through no link; UnsafePathError otherwise."""
    check_inside(path, owner)
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


SMALL_FILE_MAX = 16 << 20  # run.json, RUN.lock, index.json, meta.json, CHECKSUMS.json: KiBs


def read_text(path: str, max_bytes: int = SMALL_FILE_MAX) -> str:
    """The text of the regular file at ``path``, read without following a link or blocking, at
    most ``max_bytes``: UnsafePathError (one line) for a link, a FIFO, a device or a socket, or a
    larger file; FileNotFoundError when nothing is there."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP or os.path.islink(path):
            raise UnsafePathError(
                f"{path} is a symbolic link; refusing to read through it"
            ) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "FIFO" if stat.S_ISFIFO(st.st_mode) else "device or socket"
            raise UnsafePathError(f"{path} is a {kind}, not a regular file; refusing to read it")
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > max_bytes:
            raise UnsafePathError(f"{path} is larger than the {max_bytes:,} bytes it can hold")
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8", errors="replace")
