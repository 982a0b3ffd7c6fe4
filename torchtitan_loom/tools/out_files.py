"""The output folders of export and analyze: what may be there, what ``--force`` may remove, and
writing a file there never through a symbolic link (components/runtime/safe_files.py).

An output folder is the user's: only the names a tool writes are ever replaced or removed in it,
and a symbolic link at such a name (``OUT/config.json -> ~/.bashrc``) is refused with one line
naming it, before anything is written or removed; the file it points to keeps its bytes. OUT itself
may be a link the user made to another disk, except where ``--force`` would clear it.

The one rule for every tool that writes: a folder the user names may be a link; nothing the tool
creates below it may be. A default output folder lies below a folder the user named (the run
folder for depth and analyze, the study folder for compare and study, the checkpoint for lm_eval):
that folder is the ``owner``, and a link (or a file) anywhere from it down to OUT
(``<run>/depth -> /elsewhere``) is refused with one line, before the tool's slow part and before
it writes anything.
No torch import.
"""

from __future__ import annotations

import io
import os
import stat

from torchtitan_loom.components.runtime import safe_files

PARTIAL = ".partial"  # safe_files.new_temp's temporary name; a crash can leave one behind


def _is_ours(name: str, names: frozenset[str]) -> bool:
    return name in names or (name.endswith(PARTIAL) and name[: -len(PARTIAL)] in names)


def below(path: str, owner: str, error: type[Exception]) -> str:
    """``path`` when nothing from ``owner`` down to ``path`` (``path`` included; ``owner`` not: the
    user's, it may be a link) is a symbolic link or a file; else ``error``, one line naming it."""
    try:
        safe_files.check_inside(path, owner)
        here = os.path.normpath(owner)
        for part in os.path.relpath(os.path.normpath(path), here).split(os.sep):
            here = os.path.join(here, part)
            if part != os.curdir and os.path.lexists(here) and not os.path.isdir(here):
                raise safe_files.UnsafePathError(f"{here} is not a folder; refusing to write in it")
    except safe_files.UnsafePathError as exc:
        raise error(f"{exc} ({path} lies below it)") from None
    return path


def check_out(
    out: str,
    force: bool,
    names: frozenset[str],
    error: type[Exception],
    owner: str | None = None,
) -> list[str]:
    """The entries of ``out`` that ``force`` would remove (the tool's own names); ``error`` (one
    line) when ``out`` cannot receive the output: a link or a file on the way from ``owner`` (the
    folder the user named, default ``out`` itself), not a folder, occupied without ``force``, or one
    of those names a link or not a regular file. Removes nothing."""
    if owner is not None:
        below(out, owner, error)
    if os.path.lexists(out) and not os.path.isdir(out):
        raise error(f"{out}: exists and is not a directory; choose an output folder")
    present = sorted(os.listdir(out)) if os.path.isdir(out) else []
    if present and not force:
        raise error(
            f"{out} already holds {', '.join(present[:4])}{' ...' if len(present) > 4 else ''}; "
            f"pass --force to replace what the tool wrote there, or choose a new folder"
        )
    if present and os.path.islink(out):
        raise error(
            f"{out} is a symbolic link (to {os.readlink(out)!r}); --force will not clear a folder "
            "through a link: pass the folder it points to, or a new folder"
        )
    ours = [n for n in present if _is_ours(n, names)]
    for name in ours:
        path = os.path.join(out, name)
        mode = os.lstat(path).st_mode
        if stat.S_ISLNK(mode):
            raise error(
                f"{path} is a symbolic link (to {os.readlink(path)!r}); refusing to write or "
                "remove through it: remove the link, or choose a new folder"
            )
        if not stat.S_ISREG(mode):
            raise error(f"{path} is not a regular file; refusing to replace it: remove it first")
    return ours


def clear_out(
    out: str,
    force: bool,
    names: frozenset[str],
    error: type[Exception],
    owner: str | None = None,
) -> None:
    """Check ``out`` again (a link may have appeared meanwhile), then remove the tool's own
    regular files in it; anything else in the folder is left as it is."""
    for name in check_out(out, force, names, error, owner):
        os.unlink(os.path.join(out, name))  # lstat said regular file: unlink never follows


def make_out(out: str, error: type[Exception], owner: str | None = None) -> None:
    """Create ``out`` (and missing parents). Without ``owner`` the user named ``out``, so a link
    there is allowed; with it, the folders from ``owner`` down are created never through a link."""
    try:
        if owner is None:
            os.makedirs(out, exist_ok=True)
        else:
            safe_files.make_dirs(below(out, owner, error), owner)
    except safe_files.UnsafePathError as exc:  # a link planted since below() looked
        raise error(str(exc)) from None
    except OSError as exc:
        raise error(f"{out}: cannot create the output folder ({exc.strerror or exc})") from None


def write_file(path: str, data: str | bytes, owner: str) -> None:
    """``data`` to ``path`` inside ``owner``: temporary file created O_EXCL | O_NOFOLLOW, then
    renamed; a link at the name, or on the way from ``owner``, is UnsafePathError."""
    safe_files.atomic_write(path, data, owner=owner)


def write_figure(fig, path: str, owner: str, dpi: int) -> None:
    """A matplotlib figure as PNG, written by ``write_file`` (matplotlib opens paths itself)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    write_file(path, buf.getvalue(), owner)
