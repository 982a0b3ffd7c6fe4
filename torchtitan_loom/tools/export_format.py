"""The files of a checkpoint and of an export, read by the export tool and the inference loader
(tools/export.py writes exports; tools/loading.py builds models from either)."""

from __future__ import annotations

import dataclasses
import os
import pickle
import shlex
import sys
from typing import Any

import torch

from torchtitan_loom.components.checkpoint import integrity, layout, names
from torchtitan_loom.components.checkpoint.resolve import checkpoint_problem
from torchtitan_loom.config.errors import ConfigError
from torchtitan_loom.config.toml_file import read_toml
from torchtitan_loom.protocols import get_train_spec


class ExportError(ValueError):
    """A checkpoint that cannot be exported, or an export that does not match its source."""


def find_checkpoint(path: str, step: int | None = None) -> str:
    """The complete DCP checkpoint directory that ``path`` names (see module doc), its files
    matching their checksums (integrity.py). In a checkpoint or run folder: the newest one, or with
    ``step`` the one of that step (export --verify checks the step it exported, not a newer one
    the run saved meanwhile)."""
    if os.path.isfile(os.path.join(path, layout.DCP_METADATA)):
        if os.path.isfile(os.path.join(path, names.META_JSON)) and not layout.is_complete(path):
            raise ExportError(
                f"{path}: incomplete checkpoint (no {layout.MARKER} marker: its save did not finish)"
            )
        return _verified(path)
    for root in (path, os.path.join(path, "checkpoint")):
        found = layout.scan(root) if os.path.isdir(root) else None
        entry = None if found is None else found.newest() if step is None else found.find(step)
        if entry is not None:
            return _verified(entry.path)
    which = (
        "no complete step-N checkpoint" if step is None else f"no complete step-{step} checkpoint"
    )
    raise ExportError(
        f"{path}: not a checkpoint directory (no .metadata) and {which} "
        f"under it or under {os.path.join(path, 'checkpoint')}{why_no_checkpoint(path)}"
    )


def why_no_checkpoint(path: str) -> str:
    """What a run folder without a checkpoint says about it, and the command that gives it one
    ("" for a folder that is no run): its config.toml shows checkpoints off, or the run has not
    reached a save yet."""
    try:
        ckpt = read_toml(os.path.join(path, names.CONFIG_TOML))["checkpoint"]
        enabled, interval = bool(ckpt["enable"]), int(ckpt["interval"])
    except (ConfigError, KeyError, TypeError, ValueError):
        return ""
    run = layout.read_json(os.path.join(path, names.RUN_JSON)) or {}
    if not enabled:
        folder, config = (shlex.quote(p) for p in (path, os.path.join(path, names.CONFIG_TOML)))
        return (
            f"; that run trained with checkpoint.enable = false, so it saved no weights: train it "
            f"again with them (its old files move to replaced-<run_id>/): ./run_train.sh "
            f"--job.config_file {config} --job.dump_folder {folder} --job.overwrite true "
            "--checkpoint.enable true"
        )
    return (
        f"; that run (status {run.get('status', 'unknown')!r} at step {run.get('step', '?')}) has "
        f"not saved yet: it saves every {interval} steps and at its last step"
    )


def model_spec(info: dict[str, Any]) -> tuple[Any, Any]:
    """(TrainSpec, model args) from a model_args.json payload."""
    spec = get_train_spec(info["name"])
    flavor = info.get("flavor")
    preset = spec.model_args.get(flavor) if flavor is not None else None
    args_cls = type(preset or next(iter(spec.model_args.values())))
    known = {f.name for f in dataclasses.fields(args_cls)}
    return spec, args_cls(**{k: v for k, v in info["args"].items() if k in known})


def read_export(out: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(model_args.json payload, tensors) of an export directory."""
    info = layout.read_json(os.path.join(out, names.MODEL_ARGS_JSON))
    if info is None:
        raise ExportError(f"{out}: no {names.MODEL_ARGS_JSON}; not an export directory")
    path = _export_file(out, info.get("file"))
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            return info, load_file(path)
        return info, torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:  # weights_only refused it: the file asks for code
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "not plain tensors"
        raise ExportError(f"{path}: refused: not a plain state dict of tensors ({first})") from None
    except (OSError, RuntimeError, ValueError) as exc:  # missing, truncated or not a model file
        raise ExportError(f"{path}: unreadable model file ({type(exc).__name__}: {exc})") from None


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


def _export_file(out: str, name: Any) -> str:
    """The model file an export's model_args.json names: a plain file name inside ``out``."""
    if (
        not isinstance(name, str)
        or name in ("", ".", "..")
        or os.path.basename(name) != name
        or "\\" in name
    ):
        raise ExportError(
            f'{os.path.join(out, names.MODEL_ARGS_JSON)}: "file" is {name!r}; it must name a file '
            f"inside {out} (model.safetensors or model.pt)"
        )
    path = os.path.join(out, name)
    if os.path.islink(path) and os.path.dirname(os.path.realpath(path)) != os.path.realpath(out):
        raise ExportError(
            f"{path}: a symbolic link out of {out}; an export's model file must be inside it"
        )
    return path


def _verified(ckpt: str) -> str:
    """``ckpt`` when its files match their checksums (a checkpoint without a marker has none)
    and its DCP metadata is plain data; ExportError otherwise."""
    if os.path.isfile(os.path.join(ckpt, layout.MARKER)):
        problem = checkpoint_problem(ckpt)
    else:
        from torchtitan_loom.components.checkpoint.safe_read import metadata_problem

        problem = metadata_problem(ckpt)
    if problem:
        raise ExportError(f"{ckpt}: checkpoint is corrupt: {problem}")
    note = integrity.unverified_note(ckpt)
    if note:
        print(f"warning: {note}", file=sys.stderr)
    return ckpt
