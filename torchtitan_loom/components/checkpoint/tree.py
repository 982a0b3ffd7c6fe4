"""The checkpoint folder on disk: names, completeness, atomic commit, pruning, index.

Pure filesystem code (no tensors, no process groups), so config validation and the export tool
can use it before anything else exists. Layout under ``<job.dump_folder>/<checkpoint.folder>/``::

    step-<N>/                 periodic checkpoints (every checkpoint.interval, the final step,
                              preemption saves); the newest keep_latest_k are kept
    snapshots/step-<N>/       immutable snapshots every checkpoint.snapshot_interval; newest
                              snapshot_keep kept
    .tmp-step-<N>/            a save in progress (or one that died): never loaded
    abandoned/[snapshots/]step-<N>/  checkpoints newer than the step a load_step resume started
                              from, moved aside instead of being overwritten (never loaded)
    index.json, LAYOUT.md     what is where (rewritten after every commit)

A checkpoint directory is complete when it holds DCP's ``.metadata`` AND the ``COMPLETE`` marker.
The marker is written by rank 0 only after every rank finished writing, then the temporary
directory is renamed to its final name; so a torn save is either a ``.tmp-`` directory or a
``step-N`` directory without the marker, and both are skipped with a warning. Before the marker,
rank 0 writes ``CHECKSUMS.json`` (a CRC-32 per file, integrity.py), verified before every load.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Set
from dataclasses import dataclass, field

from torchtitan_loom.components.checkpoint import integrity
from torchtitan_loom.components.checkpoint.names import DCP_METADATA, INDEX, KEEP, LAYOUT_MD, MARKER
from torchtitan_loom.components.runtime import safe_files

SNAPSHOT_DIR = "snapshots"
TMP_PREFIX = ".tmp-"
ABANDONED = "abandoned"  # checkpoints newer than a load_step resume, moved aside (never loaded)
_STEP_RE = re.compile(r"^step-(\d+)$")
_TMP_RE = re.compile(r"^\.tmp-step-(\d+)$")


class IncompleteSave(RuntimeError):
    """A save whose folder lacks a data file its metadata names: it is not committed."""


@dataclass(frozen=True)
class Entry:
    """One checkpoint directory found on disk."""

    step: int
    kind: str  # "periodic" or "snapshot"
    path: str


@dataclass
class Scan:
    """Complete checkpoints (oldest first) and directories that must not be loaded. A checkpoint
    name that is a symbolic link is in none of them (never loaded, pruned or moved), only in
    ``links``."""

    complete: list[Entry] = field(default_factory=list)
    incomplete: list[Entry] = field(default_factory=list)
    links: list[str] = field(default_factory=list)

    def newest(self) -> Entry | None:
        """The complete checkpoint of the highest step (None when there is none)."""
        return self.complete[-1] if self.complete else None

    def find(self, step: int) -> Entry | None:
        """The complete checkpoint of ``step`` (periodic preferred over snapshot)."""
        hits = [e for e in self.complete if e.step == step]
        return min(hits, key=lambda e: e.kind != "periodic") if hits else None

    def of_kind(self, kind: str) -> list[Entry]:
        """Complete checkpoints of one kind ("periodic" or "snapshot"), oldest first."""
        return [e for e in self.complete if e.kind == kind]


def step_name(step: int) -> str:
    """``step-N``: the directory name of a checkpoint of global step N."""
    return f"step-{step}"


@dataclass(frozen=True)
class SaveTarget:
    """Where a save of ``step`` as ``kind`` ("periodic" or "snapshot") is written (``tmp``) and
    committed (``final``): computed once per save, carried from the write to the commit."""

    step: int
    kind: str
    tmp: str
    final: str

    @classmethod
    def of(cls, root: str, step: int, kind: str) -> SaveTarget:
        base = os.path.join(root, SNAPSHOT_DIR) if kind == "snapshot" else root
        name = step_name(step)
        return cls(step, kind, os.path.join(base, TMP_PREFIX + name), os.path.join(base, name))


def is_complete(path: str) -> bool:
    """True when DCP's metadata and the completion marker are both there."""
    return os.path.isfile(os.path.join(path, MARKER)) and os.path.isfile(
        os.path.join(path, DCP_METADATA)
    )


def scan(root: str) -> Scan:
    """Every checkpoint directory under ``root``, split into complete and incomplete."""
    result = Scan()
    for kind, base in (("periodic", root), ("snapshot", os.path.join(root, SNAPSHOT_DIR))):
        if kind == "snapshot" and os.path.islink(base):  # planted: nothing in it is ours
            result.links.append(base)
            continue
        if not os.path.isdir(base):
            continue
        for name in os.listdir(base):
            path = os.path.join(base, name)
            m, t = _STEP_RE.match(name), _TMP_RE.match(name)
            if os.path.islink(path):
                if m or t or name.startswith(TMP_PREFIX):
                    result.links.append(path)
                continue
            if not os.path.isdir(path):
                continue
            if m:
                entry = Entry(int(m.group(1)), kind, path)
                (result.complete if is_complete(path) else result.incomplete).append(entry)
            elif t:
                result.incomplete.append(Entry(int(t.group(1)), kind, path))
    order = {"periodic": 0, "snapshot": 1}
    result.complete.sort(key=lambda e: (e.step, -order[e.kind]))
    result.incomplete.sort(key=lambda e: (e.step, order[e.kind]))
    return result


def incomplete_warning(entries: list[Entry]) -> str | None:
    """One line naming every directory that is skipped because it lacks the completion marker."""
    if not entries:
        return None
    names = ", ".join(e.path for e in entries)
    return (
        f"skipping incomplete checkpoint directories (no {MARKER} marker: a save that did not "
        f"finish): {names}"
    )


def read_json(path: str) -> dict | None:
    """The JSON object at ``path``, or None when it is missing, unreadable, or not a regular file
    of a sane size (safe_files.read_text: a FIFO does not block, a link is not followed)."""
    try:
        value = json.loads(safe_files.read_text(path))
    except (OSError, ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def write_json(path: str, payload: dict) -> None:
    """Write JSON atomically (temp file, fsync, rename), never through a link (safe_files.py)."""
    safe_files.atomic_write(path, json.dumps(payload, indent=2, sort_keys=True) + "\n")


def planted_links(root: str) -> list[str]:
    """Symbolic links where the checkpoint code writes, renames or removes under ``root``: its
    index files, snapshots/ and abandoned/, and any step-N / .tmp-* name (a launch refuses them)."""
    names = [INDEX, INDEX + ".partial", LAYOUT_MD, LAYOUT_MD + ".partial", ABANDONED]
    found = safe_files.planted_links(root, names) if os.path.isdir(root) else []
    abandoned = os.path.join(root, ABANDONED)
    if os.path.isdir(abandoned) and not os.path.islink(abandoned):
        found += safe_files.planted_links(abandoned, [SNAPSHOT_DIR])
    return found + scan(root).links  # the scan names a linked snapshots/ too


def owner(path: str) -> str:
    """The checkpoint folder that owns the checkpoint directory ``path`` (``<root>/step-N`` or
    ``<root>/snapshots/step-N``): every rename or removal of ``path`` checks the way from there."""
    parent = os.path.dirname(path)
    return os.path.dirname(parent) if os.path.basename(parent) == SNAPSHOT_DIR else parent


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def commit(tmp: str, final: str, marker: dict, checksum: bool = True) -> None:
    """Checksum ``tmp``'s files, mark it complete and move it to ``final`` (replacing an older
    save of the same step). ``checksum=False``: ``tmp`` already holds a valid checksum list (a clone).

    Call only after every rank finished writing into ``tmp``.
    """
    if checksum:
        missing = integrity.missing_data_files(tmp)
        if missing:  # never commit a checkpoint that cannot be loaded
            raise IncompleteSave(missing)
        integrity.write_checksums(tmp)
    write_json(
        os.path.join(tmp, MARKER),
        dict(marker, checksums=integrity.CHECKSUMS, format=integrity.FORMAT),
    )
    _fsync_dir(tmp)
    root = owner(final)
    safe_files.real_dir(tmp, root)  # also: no link planted on the way (snapshots/) since the save
    trash = None
    if os.path.lexists(final):  # e.g. a run resumed from an earlier step reaches this step again
        trash = os.path.join(
            os.path.dirname(final), f"{TMP_PREFIX}trash-{os.path.basename(final)}-{os.getpid()}"
        )
        os.rename(safe_files.real_dir(final, root), trash)
    os.rename(tmp, final)
    _fsync_dir(os.path.dirname(final))
    if trash:
        shutil.rmtree(trash, ignore_errors=True)


def clone(src: str, tmp: str, final: str, marker: dict) -> None:
    """Commit a copy of the complete checkpoint ``src`` at ``final`` (hard links where possible:
    DCP files are never modified after their save, and a link survives pruning of ``src``)."""
    safe_files.remove_dir(tmp, owner(tmp))
    safe_files.make_dirs(tmp, owner(tmp))  # refuses a snapshots/ planted as a link
    for name in os.listdir(src):
        if name in (MARKER, KEEP):
            continue
        s, d = os.path.join(src, name), os.path.join(tmp, name)
        if os.path.isdir(s):
            shutil.copytree(s, d)
            continue
        try:
            os.link(s, d)
        except OSError:
            shutil.copy2(s, d)
    commit(tmp, final, marker, checksum=not os.path.isfile(os.path.join(src, integrity.CHECKSUMS)))


def prune(
    root: str,
    keep_latest_k: int,
    snapshot_keep: int,
    keep_paths: Set[str] = frozenset(),
    upto_step: int | None = None,
) -> list[str]:
    """Delete old complete checkpoints beyond the keep counts (0 keeps all) and torn temporaries
    older than the newest complete checkpoint. The newest complete checkpoint, ``keep_paths`` and
    KEEP-marked ones are never deleted; with ``upto_step`` (the newest proven checkpoint), the
    counts apply to the checkpoints up to it and every newer one stays. Returns the deleted paths.
    A held ``root`` that no longer leads to its folder deletes nothing (UnsafePathError)."""
    safe_files.check_held(root)
    found = scan(root)
    newest = found.newest()
    protect = set(keep_paths) | ({newest.path} if newest else set())
    protect |= {e.path for e in found.complete if os.path.isfile(os.path.join(e.path, KEEP))}
    doomed: list[str] = []
    for kind, keep in (("periodic", keep_latest_k), ("snapshot", snapshot_keep)):
        entries = [e for e in found.of_kind(kind) if upto_step is None or e.step <= upto_step]
        if keep > 0:
            doomed += [e.path for e in entries[:-keep] if e.path not in protect]
    if newest is not None:
        doomed += [
            e.path
            for e in found.incomplete
            if os.path.basename(e.path).startswith(TMP_PREFIX) and e.step < newest.step
        ]
    deleted = []
    for path in doomed:  # links are never in a scan; only what was really removed is reported
        try:
            safe_files.remove_dir(path, owner(path))  # refuses a link on the way (snapshots/)
        except OSError:
            continue
        deleted.append(path)
    return deleted


def write_index(root: str, policy: dict, final_step: int | None = None) -> None:
    """Rewrite index.json (machine-readable) and LAYOUT.md (for people) from what is on disk."""
    safe_files.check_held(root)
    found = scan(root)
    rel = lambda e: os.path.relpath(e.path, root)  # noqa: E731 - a one-line formatter
    newest = found.newest()
    final = found.find(final_step) if final_step is not None else None
    index = {
        "format": 1,
        "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "latest": rel(newest) if newest else None,
        "final": rel(final) if final else None,
        "periodic": [{"step": e.step, "path": rel(e)} for e in found.of_kind("periodic")],
        "snapshots": [{"step": e.step, "path": rel(e)} for e in found.of_kind("snapshot")],
        "incomplete": [rel(e) for e in found.incomplete],
        "policy": policy,
    }
    write_json(os.path.join(root, INDEX), index)
    lines = [
        "# Checkpoints of this run",
        "",
        "Written by torchtitan_loom (components/checkpoint); index.json holds the same in JSON.",
        "",
        f"- `step-<N>/`: periodic checkpoints, every {policy.get('interval')} steps plus the final step and "
        f"preemption saves; the newest {policy.get('keep_latest_k') or 'all'} kept.",
        (
            f"- `snapshots/step-<N>/`: immutable snapshots every {policy['snapshot_interval']} steps; "
            f"the newest {policy.get('snapshot_keep') or 'all'} kept."
            if policy.get("snapshot_interval")
            else "- `snapshots/step-<N>/`: immutable snapshots; none are taken by this run "
            "(checkpoint.snapshot_interval = 0)."
        ),
        "- `.tmp-step-<N>/`: a save in progress or one that died; never loaded.",
        f"- `{ABANDONED}/`: checkpoints newer than the step a run resumed from (or corrupt ones it skipped);",
        "  kept, never loaded. A checkpoint holding a `KEEP` file is never pruned.",
        "",
        "Each checkpoint is a torch.distributed.checkpoint (DCP) directory: model, optimizer (keyed by",
        "parameter name, so it loads at any world size), lr schedule, data cursor (global), spike-guard",
        "state, RNG, train step; plus `config.toml` (the resolved config), `model_args.json`,",
        f"`meta.json`, `{integrity.CHECKSUMS}` (CRC-32 per file, verified before a load) and the `{MARKER}`",
        "marker written after every rank finished.",
        "",
        f"Newest complete: `{index['latest']}`"
        + (f"; final: `{index['final']}`" if index["final"] else ""),
        "",
        "| step | kind | path |",
        "|---|---|---|",
    ]
    lines += [f"| {e.step} | {e.kind} | `{rel(e)}` |" for e in found.complete]
    if found.incomplete:
        lines += ["", "Incomplete (ignored): " + ", ".join(f"`{rel(e)}`" for e in found.incomplete)]
    safe_files.atomic_write(os.path.join(root, LAYOUT_MD), "\n".join(lines) + "\n")


def abandon_newer(root: str, step: int) -> list[str]:
    """Move every checkpoint directory newer than ``step`` (complete or torn, periodic or snapshot)
    to ``<root>/abandoned/[snapshots/]step-N[-k]/``: a run resumed from an older step would
    otherwise overwrite them. Returns the moved paths relative to ``root``."""
    found = scan(root)
    moved = []
    for e in found.complete + [
        e for e in found.incomplete if _STEP_RE.match(os.path.basename(e.path))
    ]:
        if e.step <= step:
            continue
        base = (
            os.path.join(root, ABANDONED, SNAPSHOT_DIR)
            if e.kind == "snapshot"
            else os.path.join(root, ABANDONED)
        )
        safe_files.make_dirs(
            base, root
        )  # abandoned/ (or its snapshots/) planted as a link: refused
        dest, k = os.path.join(base, step_name(e.step)), 1
        while os.path.lexists(dest):  # abandoned twice: keep both
            k += 1
            dest = os.path.join(base, f"{step_name(e.step)}-{k}")
        os.rename(safe_files.real_dir(e.path, root), dest)
        moved.append(os.path.relpath(e.path, root))
    return moved
