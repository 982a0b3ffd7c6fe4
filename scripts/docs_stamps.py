"""What a refreshed region was made from, so that a stale region is named instead of trusted.

Each producer lists the paths its region describes (``Producer.sources``: the package, a preset, a
benchmark). The digest of a region is a hash of the content of every file under those paths (in
the working tree, so an uncommitted edit counts) and of the producer function's own source, so
editing the code a region describes, or the producer that writes it, makes the region stale. The
commit is recorded for the reader (what the text was made on); staleness is decided by the digest.
"""

from __future__ import annotations

import hashlib
import inspect
import subprocess
from pathlib import Path

from docs_regions import ROOT, Region

SKIP_PARTS = ("__pycache__", ".pytest_cache")


def source_files(paths: tuple[str, ...], root: Path = ROOT) -> list[Path]:
    """Every file under `paths` (files or folders, relative to root), caches left out, sorted."""
    files: set[Path] = set()
    for rel in paths:
        p = root / rel
        if p.is_file():
            files.add(p)
        elif p.is_dir():
            files |= {
                f
                for f in p.rglob("*")
                if f.is_file() and not any(s in f.parts for s in SKIP_PARTS) and f.suffix != ".pyc"
            }
        else:
            raise FileNotFoundError(f"source path '{rel}' of a docs producer does not exist")
    return sorted(files)


def digest(paths: tuple[str, ...], producer_fn, root: Path = ROOT) -> str:
    """12 hex digits over the files under `paths` (path and content) and the producer's source."""
    h = hashlib.sha256(inspect.getsource(producer_fn).encode())
    for f in source_files(paths, root):
        h.update(f"\0{f.relative_to(root).as_posix()}\0".encode())
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:12]


def commit(paths: tuple[str, ...], root: Path = ROOT) -> str:
    """The short HEAD commit, with '+' when the working tree differs from it under `paths`;
    'unknown' outside a git checkout."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=7", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", *paths],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+" if dirty else "")


def stale(regions: list[Region], producers: dict, root: Path = ROOT) -> list[str]:
    """One line per region whose text was not made from the current sources (or never stamped)."""
    out = []
    for r in regions:
        p = producers[r.name]
        now = digest(p.sources, p.fn, root)
        if r.sources is None:
            out.append(
                f"{r.path}:{r.start + 1}: region '{r.name}' carries no stamp (never refreshed)"
            )
        elif r.sources != now:
            out.append(
                f"{r.path}:{r.start + 1}: region '{r.name}' was made on {r.commit}; its sources "
                f"({', '.join(p.sources)}) or its producer changed since"
            )
    return out
