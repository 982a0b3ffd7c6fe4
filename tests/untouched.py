"""A folder outside the run, checksummed before a fault case and proved untouched after it: every
file's bytes, every link's target and every entry's name (a file added, changed or removed shows).
Fault tests plant their links into it, so a write through a link would change it."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def digest(folder: Path) -> dict[str, str]:
    """Relative path → sha256 of a file's bytes, 'link:<target>' of a link, 'dir' of a folder."""
    out: dict[str, str] = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder)
            if os.path.islink(path):
                out[rel] = f"link:{os.readlink(path)}"
            elif os.path.isdir(path):
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return out


class Untouched:
    """``Untouched(tmp_path / "outside")``: the folder with one file in it, checksummed; ``check()``
    asserts nothing in it changed."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "keep.txt").write_text("the user's file, not the run's\n")
        self.before = digest(folder)

    def put(self, name: str, text: str) -> Path:
        """A file of the user's in the folder (a config the case reads), checksummed with it."""
        path = self.folder / name
        path.write_text(text)
        self.before = digest(self.folder)
        return path

    def check(self) -> None:
        after = digest(self.folder)
        assert after == self.before, (
            f"{self.folder} changed: {sorted(set(after) ^ set(self.before))}"
        )
