"""Which checkpoint a run loads, and whether it fits the configured model (checked up front).

Order: ``checkpoint.load_step N`` (must exist, complete) > the newest complete checkpoint of the
run's folder that verifies > ``checkpoint.initial_load_path`` (model-only warm start) > nothing
(fresh start). A folder whose complete checkpoints all fail verification is refused. Each
candidate is read and verified as one value (found.py), which the load then uses as it is.
``config/section_checks.py`` calls ``config_errors`` before any process starts, so a checkpoint of a
different model fails with one message and nothing on disk is touched.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from torchtitan_loom.components.checkpoint import found, names, tree
from torchtitan_loom.components.runtime import format_version
from torchtitan_loom.protocols import get_train_spec

_MAX_LINES = 12


@dataclasses.dataclass(frozen=True)
class LoadChoice:
    """The checkpoint to load, its step in this run, and whether only the model is taken."""

    on_disk: found.FoundCheckpoint
    step: int | None  # None for a warm start from a directory outside the run
    model_only: bool

    @property
    def path(self) -> str:
        return self.on_disk.folder


def checkpoint_root(dump_folder: str, folder: str) -> str:
    """``<job.dump_folder>/<checkpoint.folder>``."""
    return os.path.join(dump_folder, folder)


def choose(
    root: str,
    load_step: int,
    initial_load_path: str,
    *,
    verify: str = "full",
    exclude: dict[str, str] | None = None,
) -> tuple[LoadChoice | None, tree.Scan, list[str]]:
    """The checkpoint to load (or None), the scan it came from, and one warning line per newer
    complete checkpoint that was skipped because it failed verification (found.at;
    ``verify`` = "full", "quick" or "none") or is in ``exclude`` (path → why it was refused once
    its load began: an entry that is not data, a failed read, non-finite weights), plus one
    when the chosen checkpoint predates checksums.

    Raises ValueError with a user-facing message when ``load_step`` or ``initial_load_path`` point
    at nothing usable, when the explicitly requested ``load_step`` fails verification, or when
    every complete checkpoint fails it (a run that cannot be continued is never restarted in place)."""
    scanned = tree.scan(root)
    exclude = exclude or {}
    seen: dict[str, found.FoundCheckpoint] = {}

    def problem(entry: tree.Entry) -> str | None:
        if entry.path in exclude:
            why = exclude[entry.path]
            return why if why.startswith(entry.path) else f"{entry.path}: {why}"
        try:
            seen[entry.path] = ck = found.at(entry.path, verify)
        except found.NotACheckpoint as exc:
            return str(exc)
        return ck.problem

    if load_step >= 0:
        entry = scanned.find(load_step)
        if entry is None:
            have = ", ".join(str(e.step) for e in scanned.complete) or "none"
            torn = [e.path for e in scanned.incomplete if e.step == load_step]
            extra = f" ({torn[0]} is incomplete)" if torn else ""
            raise ValueError(
                f"checkpoint.load_step = {load_step}: no complete checkpoint of that step in "
                f"{root}{extra}; complete steps: {have}"
            )
        bad = problem(entry)
        if bad:
            raise ValueError(
                f"checkpoint.load_step = {load_step}: checkpoint is corrupt: {bad}; choose "
                f"another step or -1 (the newest checkpoint that verifies)"
            )
        ck = seen[entry.path]
        return LoadChoice(ck, entry.step, model_only=False), scanned, _notes(ck, [])
    skipped: list[str] = []
    newest_bad = ""
    for entry in reversed(scanned.complete):
        bad = problem(entry)
        if bad is None:
            ck = seen[entry.path]
            return LoadChoice(ck, entry.step, model_only=False), scanned, _notes(ck, skipped)
        newest_bad = newest_bad or bad
        skipped.append(f"skipping corrupt checkpoint {entry.path}: {bad}")
    if (
        skipped
    ):  # the run has a history that no checkpoint can continue: never start over on top of it
        listed = ", ".join(os.path.relpath(e.path, root) for e in scanned.complete)
        raise ValueError(
            f"every complete checkpoint in {root} is damaged ({listed}; the newest: "
            f"{newest_bad}): refusing to start over on top of them. Repair or move "
            f"them, or pass --job.overwrite true to start a new run (the old files move to "
            f"replaced-<run_id>/)"
        )
    if initial_load_path:
        ck = warm_start(initial_load_path, verify)
        return LoadChoice(ck, None, model_only=True), scanned, _notes(ck, skipped)
    return None, scanned, skipped


def _notes(ck: found.FoundCheckpoint, lines: list[str]) -> list[str]:
    """``lines`` plus the warning that the chosen checkpoint predates checksums (format 1)."""
    return lines + [ck.note] if ck.note else lines


def warm_start(path: str, verify: str = "full") -> found.FoundCheckpoint:
    """The DCP checkpoint ``checkpoint.initial_load_path`` names (found.find: a step-N directory,
    or the newest complete one of a checkpoint or run folder), verified; ValueError otherwise."""
    key = f"checkpoint.initial_load_path = '{path}'"
    try:
        ck = found.find(path, verify=verify)
    except found.NotACheckpoint as exc:
        raise ValueError(f"{key}: {exc}") from None
    if ck.is_export:
        raise ValueError(
            f"{key}: an export folder; a warm start reads a DCP checkpoint (the one it was "
            f"exported from: {(ck.model_args or {}).get('source')})"
        )
    return ck


# meta.json's format_version, for the whole checkpoint it describes (the DCP state's keys and
# what they hold, meta.json, model_args.json): written by saving.Writer._write_sidecars, checked
# before a load (format_problem). Bump it when a saved key changes its meaning or leaves, and list
# in FORMATS_READ what this code still loads (migrating it in loading.py) or leave it out (a
# refusal); docs/checkpoints.md, "Format versions". Version 1: the first one written, the
# state of the legacy (unversioned) checkpoints, which are read as it.
FORMAT_VERSION = 1
FORMATS_READ = (1,)


def format_problem(ck: found.FoundCheckpoint) -> str | None:
    """One line when the checkpoint ``ck`` is of a format this code does not load, by its
    meta.json's format_version (FORMAT_VERSION); None when it loads it."""
    return format_version.problem(
        os.path.join(ck.folder, names.META_JSON),
        ck.meta,
        FORMATS_READ,
        "resume it with the torchtitan_loom that wrote it (or a newer one), or pick a checkpoint "
        "of a format this one reads with checkpoint.load_step",
    )


def compat_errors(
    ck: found.FoundCheckpoint,
    model_name: str,
    flavor: str,
    args: Any,
    expected_shapes: dict[str, tuple[int, ...]],
    *,
    resume: bool,
) -> list[str]:
    """Lines describing why the checkpoint ``ck`` cannot be loaded into this model ([] = fits).

    Shapes always have to match. A resume also needs the same model args, apart from the few that
    may change mid-run (state.RESUMABLE_ARG_CHANGES and the spec's relaunch_tunable); a model-only
    warm start needs only shapes.
    """
    from torchtitan_loom.components.checkpoint import (
        state,
    )  # torch-heavy; only when a checkpoint exists

    lines: list[str] = []
    saved = ck.model_args
    if saved is not None and resume:
        if saved.get("name") != model_name:
            lines.append(f"model.name: checkpoint {saved.get('name')!r}, config {model_name!r}")
        if saved.get("flavor") != flavor:
            lines.append(f"model.flavor: checkpoint {saved.get('flavor')!r}, config {flavor!r}")
        may_change = state.RESUMABLE_ARG_CHANGES + get_train_spec(model_name).relaunch_tunable
        lines += [
            "model." + d
            for d in state.args_differences(saved.get("args", {}), args, ignore=may_change)
        ]
    meta = (
        ck.dcp_metadata.state_dict_metadata  # read while verifying it
        if ck.dcp_metadata is not None
        else state.read_metadata(ck.folder)
    )
    shapes = state.shape_mismatches(expected_shapes, state.tensor_shapes(meta, "model."))
    if shapes:
        lines.append(f"{len(shapes)} model tensors differ:")
        lines += ["  " + s for s in shapes[:_MAX_LINES]]
        if len(shapes) > _MAX_LINES:
            lines.append(f"  ... and {len(shapes) - _MAX_LINES} more")
    return lines


def explain(path: str, step: int | None, lines: list[str], *, resume: bool) -> str:
    """The full error message for ``compat_errors`` lines."""
    what = f"step {step}" if step is not None else "warm start"
    hint = (
        "resume with the checkpoint's model settings, or start a new run in another job.dump_folder "
        "(checkpoint.initial_load_path warm-starts a model whose tensor shapes match)"
        if resume
        else "checkpoint.initial_load_path needs a checkpoint of a model with the same tensor shapes"
    )
    return "\n".join(
        [f"checkpoint {path} ({what}) does not fit the configured model:"]
        + ["  " + s for s in lines]
        + [hint]
    )


def config_errors(cfg: Any, args: Any, expected_shapes_fn) -> list[str]:
    """Checkpoint problems of a JobConfig, found before anything starts (called by
    config/section_checks.py).

    ``expected_shapes_fn()`` gives the configured model's state-dict shapes; it is only called
    when a checkpoint is going to be loaded.
    """
    ck = cfg.checkpoint
    if not ck.enable:
        return []
    root = checkpoint_root(cfg.job.dump_folder, ck.folder)
    try:
        # Quick (sizes + small files): the full CRC runs once, in the manager, before the load.
        choice, _, _ = choose(root, ck.load_step, ck.initial_load_path, verify="quick")
    except ValueError as exc:
        return [str(exc)]
    if choice is None:
        return []
    version = format_problem(choice.on_disk)
    if version:
        return [version]
    try:
        lines = compat_errors(
            choice.on_disk,
            cfg.model.name,
            cfg.model.flavor,
            args,
            expected_shapes_fn(),
            resume=not choice.model_only,
        )
    except Exception as exc:  # a corrupt .metadata can raise anything unpickling does
        return [f"checkpoint {choice.path}: unreadable DCP metadata ({type(exc).__name__}: {exc})"]
    return [explain(choice.path, choice.step, lines, resume=not choice.model_only)] if lines else []
