"""What goes into a checkpoint and how it comes back: model, optimizer, RNG, model-compat checks.

Model and optimizer go through ``torch.distributed.checkpoint.state_dict``: keys are parameter
names and tensors keep their GLOBAL shapes (DTensors under FSDP2/EP), so DCP reshards them onto
any world size or mesh. The optimizer state is flattened per parameter name
(``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``, ...).

Parameters without AdamW state: a per-loop router whose loop has not been in a trained segment
yet has no state (AdamW initialises it lazily at its first update). It is saved without state and
must come back without state: torch's state-dict API gives every parameter state on load (it runs
a zero-lr step on a fresh optimizer), so ``OptimizerLoad`` drops those keys from the DCP read and
removes the invented state afterwards, and ``optimizer_state`` undoes the same invention on save.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from torchtitan_loom.components.checkpoint import safe_read

OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# Model args that may change between save and resume whatever the model: the init seed (irrelevant
# once weights are loaded) and the longest sequence; each TrainSpec adds its own (relaunch_tunable).
RESUMABLE_ARG_CHANGES = ("init_seed", "max_seq_len")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used with this run; the message says why and what to do."""


class CheckpointUnreadable(CheckpointError):
    """A checkpoint refused or unreadable while loading it; a resume falls back to the previous."""


class CheckpointSaveError(RuntimeError):
    """A save that could not be written (disk full, say); older checkpoints are untouched."""


@contextlib.contextmanager
def single_process_quiet():
    """Silence DCP's warning that a save/load without a process group is single-process: that is
    exactly what a one-process run or the export tool means."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*assuming the intent is to (save|load) in a single process.*"
        )
        yield


# ----------------------------------------------------------------------------- model / optimizer
def model_state(model: nn.Module) -> dict[str, Any]:
    """Parameters and persistent buffers (expert_bias included) by name, global shapes."""
    return get_model_state_dict(model)


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Flattened optimizer state by parameter name; never invents state (see module doc)."""
    was_empty = not optimizer.state
    sd = get_optimizer_state_dict(model, optimizer, options=OPTIM_OPTIONS)
    if was_empty:  # torch initialised every parameter's state with a zero-lr step: undo it
        optimizer.state.clear()
        sd = {k: v for k, v in sd.items() if not k.startswith("state.")}
    return sd


class OptimizerLoad:
    """Loads a flattened optimizer state, keeping "no state" for parameters saved without one.

    Usage: ``template()`` gives the dict to fill (keys the checkpoint lacks are left out),
    DCP fills it, then ``apply(filled)``.
    """

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, saved_keys: set[str], prefix: str
    ):
        self.model, self.optimizer = model, optimizer
        self.full = get_optimizer_state_dict(
            model, optimizer, options=OPTIM_OPTIONS
        )  # every param has state
        self.missing = {k for k in self.full if prefix + k not in saved_keys}
        bad = sorted(k for k in self.missing if not k.startswith("state."))
        if bad:
            raise CheckpointError(
                f"optimizer entries missing from the checkpoint: {', '.join(bad[:8])}"
                f"{' ...' if len(bad) > 8 else ''} (a different optimizer or parameter set?)"
            )
        self.stateless = sorted({k[len("state.") :].rsplit(".", 1)[0] for k in self.missing})

    def template(self) -> dict[str, Any]:
        """The flattened state for DCP to fill: only keys the checkpoint has."""
        return {k: v for k, v in self.full.items() if k not in self.missing}

    def apply(self, loaded: dict[str, Any]) -> None:
        """Load the filled template into the optimizer; drop state the checkpoint did not have."""
        merged = dict(self.full)
        merged.update(loaded)
        set_optimizer_state_dict(self.model, self.optimizer, merged, options=OPTIM_OPTIONS)
        if self.stateless:
            by_name = dict(
                self.model.named_parameters()
            )  # names are canonical (no wrapper prefixes)
            for fqn in self.stateless:
                self.optimizer.state.pop(by_name[fqn], None)


def set_model_state(model: nn.Module, sd: dict[str, Any]) -> None:
    """Load ``model_state``'s dict back (resharded onto the model's own layout)."""
    set_model_state_dict(model, sd)


def local_nbytes(obj: Any) -> int:
    """Bytes of the tensors (this rank's pieces) in a nested state dict."""
    if isinstance(obj, dict):
        return sum(local_nbytes(v) for v in obj.values())
    if isinstance(obj, torch.Tensor):
        t = obj.to_local() if hasattr(obj, "to_local") else obj
        return t.numel() * t.element_size()
    return 0


# --------------------------------------------------------------------------------------------- rng
def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """torch's CPU generator and, on CUDA, the current device's generator."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Restore what ``rng_state`` saved (the CUDA part only on a CUDA device)."""
    if "cpu" in state:
        torch.set_rng_state(state["cpu"].cpu())
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


# ---------------------------------------------------------------------------------------- metadata
def read_metadata(path: str) -> dict[str, Any]:
    """DCP's per-key metadata (TensorStorageMetadata with the global size, or bytes), read through
    the allow-list of safe_read.py (UnsafeCheckpoint for a file that is not plain DCP metadata)."""
    return safe_read.read_metadata_file(path).state_dict_metadata


def dcp_load(sd: dict[str, Any], path: str, no_dist: bool, metadata: Any | None = None) -> None:
    """Fill ``sd`` from the checkpoint at ``path`` without running code from it (safe_read.py);
    a refused or unreadable file raises CheckpointUnreadable naming it. ``metadata``: its DCP
    Metadata, already read through safe_read (not read again)."""
    try:
        with single_process_quiet():
            safe_read.load(sd, path, no_dist=no_dist, metadata=metadata)
    except (safe_read.UnsafeCheckpoint, safe_read.UnreadableCheckpoint) as exc:
        raise CheckpointUnreadable(str(exc)) from None


def tensor_shapes(meta: dict[str, Any], prefix: str) -> dict[str, tuple[int, ...]]:
    """{name without prefix: global shape} of the tensors stored under ``prefix``."""
    return {
        k[len(prefix) :]: tuple(v.size)
        for k, v in meta.items()
        if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)
    }


def shape_mismatches(
    expected: dict[str, tuple[int, ...]], saved: dict[str, tuple[int, ...]]
) -> list[str]:
    """One line per tensor that is missing, unexpected or shaped differently."""
    lines = []
    for name in sorted(expected.keys() | saved.keys()):
        a, b = saved.get(name), expected.get(name)
        if a != b:
            fmt = lambda s: "absent" if s is None else list(s)  # noqa: E731 - a one-line formatter
            lines.append(f"{name}: checkpoint {fmt(a)}, this model {fmt(b)}")
    return lines


def model_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """{name: global shape} of the model's state dict (DTensors report their global shape)."""
    return {k: tuple(v.shape) for k, v in model_state(model).items() if isinstance(v, torch.Tensor)}


def args_differences(
    saved: dict[str, Any], current: Any, ignore: tuple[str, ...] = ()
) -> list[str]:
    """'field: checkpoint X, config Y' for every model arg that differs (``ignore`` skipped). An
    argument added since the checkpoint was written reads as its default, as building the model
    from the checkpoint's arguments gives it."""
    mine = dataclasses.asdict(current)
    added = {
        f.name: f.default
        for f in dataclasses.fields(current)
        if f.name not in saved and f.default is not dataclasses.MISSING
    }
    saved = {**added, **saved}
    return [
        f"{k}: checkpoint {saved.get(k)!r}, config {mine.get(k)!r}"
        for k in sorted(mine.keys() | saved.keys())
        if k not in ignore and saved.get(k) != mine.get(k)
    ]


def load_full(path: str, prefix: str = "", metadata: Any | None = None) -> dict[str, Any]:
    """Every entry of a DCP checkpoint under ``prefix`` as full (unsharded) CPU values, without a
    process group: the reference reader for export, verification and tests. ``metadata``: its
    DCP Metadata when it was read already (safe_read.read_metadata_file)."""
    if metadata is None:
        metadata = safe_read.read_metadata_file(path)
    meta = metadata.state_dict_metadata
    sd: dict[str, Any] = {}
    for key, m in meta.items():
        if not key.startswith(prefix):
            continue
        if isinstance(m, TensorStorageMetadata):
            sd[key] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
        else:
            sd[key] = None  # bytes entries are replaced by their unpickled value
    if not sd:
        raise CheckpointError(f"{path}: no entries under {prefix!r} in this checkpoint")
    dcp_load(sd, path, no_dist=True, metadata=metadata)
    return {k[len(prefix) :]: v for k, v in sd.items()}
