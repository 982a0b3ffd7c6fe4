"""Activation checkpointing and torch.compile for any registered model, applied by the trainer on
the meta-device model before the model's parallelize function adds expert parallelism and FSDP2.

The model declares where each goes (TrainSpec): ``checkpoint_scopes`` names the
``activation_checkpoint.mode`` values its forward passes through ``region_wrappers`` (LOOM: block,
loop, segment), ``compile_units_fn`` the submodules compiled in place (LOOM: its blocks). A config
asking for a scope or a compile the model does not declare is refused when the config is checked
(``config/validate.py``), never skipped in silence.

Order: float8 conversion, then this, then parallelize (EP swaps the routed experts and FSDP2
wraps the units). ``nn.Module.compile`` traces at the first call, so the expert-parallel module
swapped in afterwards is the one compiled; compile still precedes FSDP2, as in TorchTitan.

Legend: none (no tensors here).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from torchtitan_loom.distributed.activation_checkpoint import apply_activation_checkpointing


def apply_compile(units: list[nn.Module], *, backend: str, fullgraph: bool) -> None:
    """torch.compile each unit in place (parameter names unchanged)."""
    for unit in units:
        unit.compile(backend=backend, fullgraph=fullgraph)


def apply_checkpoint_and_compile(
    model: nn.Module, spec: Any, job_config: Any, *, expert_parallel: bool
) -> int:
    """Register the configured checkpoint wrapper on the model's region seam and compile its
    declared units (both in place); returns how many units compile. The config check has already
    refused what the model does not declare; this raises ValueError if called without it."""
    mode, compiling = job_config.activation_checkpoint.mode, job_config.compile.enable
    if mode != "none":
        if mode not in spec.checkpoint_scopes:
            raise ValueError(f"model {spec.name!r} declares no checkpoint scope {mode!r}")
        # Compiled units are opaque to the routing-replay dispatch modes: recompute them instead.
        apply_activation_checkpointing(model, mode, save_routing=not compiling)
    if not compiling:
        return 0
    if spec.compile_units_fn is None:
        raise ValueError(f"model {spec.name!r} declares no compile units")
    units = list(spec.compile_units_fn(model))
    # Expert-parallel dispatch needs host-side split sizes: a graph break by design.
    apply_compile(units, backend=job_config.compile.backend, fullgraph=not expert_parallel)
    return len(units)
