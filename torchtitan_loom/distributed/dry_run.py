"""``--parallelism.dry_run``: lay a validated config out on W ranks inside ONE process, print it, exit.

The model is built on the meta device and parallelized exactly as the trainer would, over a fake
process group (no communication, no memory), as rank 0 of W. The report: the mesh layout, how the
global batch splits over the data-parallel ranks, rank 0's shard of every parameter (layers that
match layer 0 are folded into one line) and an estimate of rank 0's parameter-related memory.
Activations are not estimated (they depend on K, the activation-checkpoint mode and the kernels).
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan_loom.distributed.parallel_dims import ParallelDims
from torchtitan_loom.distributed.utils import DTYPES
from torchtitan_loom.protocols import Sharding, get_train_spec

_GIB = 1024**3


def dry_run(cfg: Any, model_args: Any, dims: ParallelDims) -> str:
    """The dry-run report of `cfg` on `dims.world_size` ranks (builds nothing real)."""
    world_size = dims.world_size
    t = cfg.training
    lines = [f"dry run: {cfg.model.name}/{cfg.model.flavor}, H={model_args.num_loops}, K={t.bp_segment_len}, "
             f"world size {world_size}", dims.describe()]
    rows = t.global_batch_size // dims.dp
    lines.append(f"batch: {t.global_batch_size} rows × {t.seq_len} tokens per step = {rows} rows per data-parallel "
                 f"rank ({dims.dp} ranks) = {rows // t.micro_batch_size} micro-batches of {t.micro_batch_size}")
    lines.append(f"activation_checkpoint={cfg.activation_checkpoint.mode}, compile={cfg.compile.enable}, "
                 f"param dtype={t.mixed_precision_param}, reduce dtype={t.mixed_precision_reduce}, "
                 f"reshard_after_forward={cfg.parallelism.fsdp_reshard_after_forward}")
    fake = world_size > 1 and not dist.is_initialized()
    if fake:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        dims.build_meshes("cpu")
        spec = get_train_spec(cfg.model.name)
        with torch.device("meta"):
            model = spec.model_cls(model_args)
        if spec.parallelize_fn is not None:
            model = spec.parallelize_fn(model, dims, cfg).model
        lines += _shard_report(model, dims, cfg, spec.sharding)
    finally:
        if fake:
            dist.destroy_process_group()
    return "\n".join(lines)


def _shard_report(model: torch.nn.Module, dims: ParallelDims, cfg: Any, sharding: Sharding) -> list[str]:
    lines, seen = ["rank 0 parameters: name  full shape -> local shard  placements"], {}
    local_total = gathered_total = 0
    units: set[int] = set()
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        local_total += local.numel()
        # Gathered by FSDP for compute: the full tensor divided only by its expert-parallel split
        # (parameters FSDP never shards are replicated, counted in the local values already).
        if not any(frag in name for frag in sharding.replicated):
            split = dims.ep_enabled and any(frag in name for frag in sharding.expert_parallel)
            gathered_total += p.numel() // (dims.ep if split else 1)
        placements = ", ".join(str(x) for x in p.placements) if isinstance(p, DTensor) else "plain"
        entry = f"{tuple(p.shape)} -> {tuple(local.shape)}  {placements}"
        unit = re.match(sharding.repeated_unit, name) if sharding.repeated_unit else None
        key = name if unit is None else "{unit}." + name[unit.end():]
        if unit is not None:
            units.add(int(unit.group(1)))
        if seen.get(key) == entry:
            continue
        seen[key] = entry
        lines.append(f"  {name}  {entry}")
    if len(units) > 1:
        unit_name = sharding.unit_name
        lines.append(f"  ({unit_name}s {min(units) + 1}..{max(units)}: same as {unit_name} {min(units)})")
    t = cfg.training
    state_bytes = local_total * (4 + 4 + 8)  # fp32 master + fp32 gradient + AdamW's two moments
    gathered_bytes = gathered_total * DTYPES[t.mixed_precision_param].itemsize if dims.fsdp_enabled else 0
    lines.append(f"rank 0 memory estimate: {local_total:,} local parameter values -> {state_bytes / _GIB:.2f} GiB "
                 f"(fp32 weights + gradients + AdamW moments)")
    if dims.fsdp_enabled:
        keep = cfg.parallelism.fsdp_reshard_after_forward != "always"
        lines.append(f"  + gathered {t.mixed_precision_param} parameters during a segment: "
                     f"{gathered_bytes / _GIB:.2f} GiB if every unit stays gathered (reshard_after_forward "
                     f"{'never: this is the peak' if keep else 'always: about one block at a time instead'})")
    lines.append("  + activations (depend on micro_batch_size, seq_len, K and activation_checkpoint.mode): "
                 "not estimated; measure with benchmarks/memory_time.py")
    return lines
