"""The files of a checkpoint and of an export, read by the export tool and the inference loader
(tools/export.py writes exports; tools/loading.py builds models from either)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from torchtitan_loom.components.checkpoint import integrity, layout
from torchtitan_loom.components.checkpoint.resolve import MODEL_ARGS_FILE
from torchtitan_loom.protocols import get_train_spec


class ExportError(ValueError):
    """A checkpoint that cannot be exported, or an export that does not match its source."""


def find_checkpoint(path: str) -> str:
    """The complete DCP checkpoint directory that ``path`` names (see module doc), its files
    matching their checksums (integrity.py)."""
    if os.path.isfile(os.path.join(path, layout.DCP_METADATA)):
        if os.path.isfile(os.path.join(path, "meta.json")) and not layout.is_complete(path):
            raise ExportError(f"{path}: incomplete checkpoint (no {layout.MARKER} marker: its save did not finish)")
        return _verified(path)
    for root in (path, os.path.join(path, "checkpoint")):
        newest = layout.scan(root).newest() if os.path.isdir(root) else None
        if newest is not None:
            return _verified(newest.path)
    raise ExportError(f"{path}: not a checkpoint directory (no .metadata) and no complete step-N checkpoint "
                      f"under it or under {os.path.join(path, 'checkpoint')}")


def model_spec(info: dict[str, Any]) -> tuple[Any, Any]:
    """(TrainSpec, model args) from a model_args.json payload."""
    spec = get_train_spec(info["name"])
    args_cls = type(spec.model_args.get(info.get("flavor")) or next(iter(spec.model_args.values())))
    known = {f.name for f in dataclasses.fields(args_cls)}
    return spec, args_cls(**{k: v for k, v in info["args"].items() if k in known})


def read_export(out: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(model_args.json payload, tensors) of an export directory."""
    info = layout.read_json(os.path.join(out, MODEL_ARGS_FILE))
    if info is None:
        raise ExportError(f"{out}: no {MODEL_ARGS_FILE}; not an export directory")
    path = os.path.join(out, info["file"])
    if info["file"].endswith(".safetensors"):
        from safetensors.torch import load_file

        return info, load_file(path)
    return info, torch.load(path, map_location="cpu", weights_only=True)


def _verified(ckpt: str) -> str:
    problem = integrity.verify(ckpt) if os.path.isfile(os.path.join(ckpt, layout.MARKER)) else None
    if problem:
        raise ExportError(f"{ckpt}: checkpoint is corrupt: {problem}")
    return ckpt
