"""Which checkpoint a run loads, and whether it fits the configured model (checked up front).

Order: ``checkpoint.load_step N`` (must exist, complete) > the newest complete checkpoint of the
run's folder that verifies > ``checkpoint.initial_load_path`` (model-only warm start) > nothing
(fresh start). A folder whose complete checkpoints all fail verification is refused.
``config/section_checks.py`` calls ``config_errors`` before any process starts, so a checkpoint of a
different model fails with one message and nothing on disk is touched.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from torchtitan_loom.components.checkpoint import integrity, layout, names
from torchtitan_loom.components.runtime import format_version
from torchtitan_loom.protocols import get_train_spec

_MAX_LINES = 12


@dataclasses.dataclass(frozen=True)
class LoadChoice:
    """The checkpoint directory to load, its step, and whether only the model is taken."""

    path: str
    step: int | None  # None for a warm start from a directory outside the run
    model_only: bool


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
) -> tuple[LoadChoice | None, layout.Scan, list[str]]:
    """The checkpoint to load (or None), the scan it came from, and one warning line per newer
    complete checkpoint that was skipped because it failed verification (checkpoint_problem;
    ``verify`` = "full", "quick" or "none") or is in ``exclude`` (path → why it was refused once
    its load began: an entry that is not data, a failed read, non-finite weights), plus one
    when the chosen checkpoint predates checksums.

    Raises ValueError with a user-facing message when ``load_step`` or ``initial_load_path`` point
    at nothing usable, when the explicitly requested ``load_step`` fails verification, or when
    every complete checkpoint fails it (a run that cannot be continued is never restarted in place)."""
    found = layout.scan(root)
    exclude = exclude or {}

    def problem(entry: layout.Entry) -> str | None:
        if entry.path in exclude:
            why = exclude[entry.path]
            return why if why.startswith(entry.path) else f"{entry.path}: {why}"
        if verify == "none":  # unverified, but never read through a link out of the folder
            return integrity.link_problem(entry.path)
        return checkpoint_problem(entry.path, quick=verify == "quick")

    if load_step >= 0:
        entry = found.find(load_step)
        if entry is None:
            have = ", ".join(str(e.step) for e in found.complete) or "none"
            torn = [e.path for e in found.incomplete if e.step == load_step]
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
        return (
            LoadChoice(entry.path, entry.step, model_only=False),
            found,
            _notes(entry.path, [], verify),
        )
    skipped: list[str] = []
    newest_bad = ""
    for entry in reversed(found.complete):
        bad = problem(entry)
        if bad is None:
            return (
                LoadChoice(entry.path, entry.step, model_only=False),
                found,
                _notes(entry.path, skipped, verify),
            )
        newest_bad = newest_bad or bad
        skipped.append(f"skipping corrupt checkpoint {entry.path}: {bad}")
    if (
        skipped
    ):  # the run has a history that no checkpoint can continue: never start over on top of it
        listed = ", ".join(os.path.relpath(e.path, root) for e in found.complete)
        raise ValueError(
            f"every complete checkpoint in {root} is damaged ({listed}; the newest: "
            f"{newest_bad}): refusing to start over on top of them. Repair or move "
            f"them, or pass --job.overwrite true to start a new run (the old files move to "
            f"replaced-<run_id>/)"
        )
    if initial_load_path:
        path = warm_start_dir(initial_load_path)
        bad = (
            integrity.link_problem(path)
            if verify == "none"
            else checkpoint_problem(path, quick=verify == "quick")
        )
        if bad:
            raise ValueError(
                f"checkpoint.initial_load_path = '{initial_load_path}': checkpoint is corrupt: {bad}"
            )
        return LoadChoice(path, None, model_only=True), found, _notes(path, skipped, verify)
    return None, found, skipped


def _notes(path: str, lines: list[str], verify: str) -> list[str]:
    """``lines`` plus the warning that the chosen checkpoint predates checksums (format 1)."""
    note = integrity.unverified_note(path) if verify != "none" else None
    return lines + [note] if note else lines


def checkpoint_problem(path: str, quick: bool = False) -> str | None:
    """None when the checkpoint at ``path`` matches its checksums and its DCP metadata is plain
    data (safe_read.py), else one line naming the file that fails."""
    bad = integrity.verify(path, quick=quick)
    if bad is None and os.path.isfile(os.path.join(path, layout.DCP_METADATA)):
        from torchtitan_loom.components.checkpoint import (
            safe_read,
        )  # torch-side; only with a checkpoint

        bad = safe_read.metadata_problem(path)
    return bad


def warm_start_dir(path: str) -> str:
    """A DCP checkpoint directory, or a checkpoint folder whose newest complete one is used."""
    if os.path.isfile(os.path.join(path, layout.DCP_METADATA)):
        marker_expected = os.path.isfile(os.path.join(path, names.META_JSON))
        if marker_expected and not layout.is_complete(path):
            raise ValueError(
                f"checkpoint.initial_load_path = '{path}': incomplete checkpoint (no "
                f"{layout.MARKER} marker: its save did not finish)"
            )
        return path
    newest = layout.scan(path).newest() if os.path.isdir(path) else None
    if newest is None:
        raise ValueError(
            f"checkpoint.initial_load_path = '{path}': not a DCP checkpoint directory (no "
            f".metadata) and no complete step-N checkpoint inside"
        )
    return newest.path


# meta.json's format_version, for the whole checkpoint it describes (the DCP state's keys and
# what they hold, meta.json, model_args.json): written by saving.Writer._write_sidecars, checked
# before a load (format_problem). Bump it when a saved key changes its meaning or leaves, and list
# in FORMATS_READ what this code still loads (migrating it in loading.py) or leave it out (a
# refusal); docs/checkpoints.md, "Format versions". Version 1: the first one written, the
# state of the legacy (unversioned) checkpoints, which are read as it.
FORMAT_VERSION = 1
FORMATS_READ = (1,)


def format_problem(path: str) -> str | None:
    """One line when the checkpoint at ``path`` is of a format this code does not load, by its
    meta.json's format_version (FORMAT_VERSION); None when it loads it."""
    meta = layout.read_json(os.path.join(path, names.META_JSON)) or {}
    return format_version.problem(
        os.path.join(path, names.META_JSON),
        meta,
        FORMATS_READ,
        "resume it with the torchtitan_loom that wrote it (or a newer one), or pick a checkpoint "
        "of a format this one reads with checkpoint.load_step",
    )


def read_model_args(path: str) -> dict[str, Any] | None:
    """{"name", "flavor", "args"} saved next to the checkpoint, or None for a foreign checkpoint."""
    return layout.read_json(os.path.join(path, names.MODEL_ARGS_JSON))


def compat_errors(
    path: str,
    model_name: str,
    flavor: str,
    args: Any,
    expected_shapes: dict[str, tuple[int, ...]],
    *,
    resume: bool,
) -> list[str]:
    """Lines describing why the checkpoint at ``path`` cannot be loaded into this model ([] = fits).

    Shapes always have to match. A resume also needs the same model args, apart from the few that
    may change mid-run (state.RESUMABLE_ARG_CHANGES and the spec's relaunch_tunable); a model-only
    warm start needs only shapes.
    """
    from torchtitan_loom.components.checkpoint import (
        state,
    )  # torch-heavy; only when a checkpoint exists

    lines: list[str] = []
    saved = read_model_args(path)
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
    shapes = state.shape_mismatches(
        expected_shapes, state.tensor_shapes(state.read_metadata(path), "model.")
    )
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
    version = format_problem(choice.path)
    if version:
        return [version]
    try:
        lines = compat_errors(
            choice.path,
            cfg.model.name,
            cfg.model.flavor,
            args,
            expected_shapes_fn(),
            resume=not choice.model_only,
        )
    except Exception as exc:  # a corrupt .metadata can raise anything unpickling does
        return [f"checkpoint {choice.path}: unreadable DCP metadata ({type(exc).__name__}: {exc})"]
    return [explain(choice.path, choice.step, lines, resume=not choice.model_only)] if lines else []
