"""``--parallelism.dry_run``: lay a validated config out on W ranks inside ONE process, print it, exit.

The model is built on the meta device, converted (float8) and parallelized exactly as the trainer
would, over a fake process group (no communication, no memory), as rank 0 of W. The report: the
mesh layout, how the global batch splits over the data-parallel ranks, the float8 conversion (what
became float8, e.g. routed experts under expert parallelism), rank 0's shard of every parameter
(layers that match layer 0 are folded into one line), then the cost estimate of distributed/estimate.py (memory,
communication, FLOPs, step time, MFU, the fastest layouts) when the spec has a cost model.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan_loom.distributed.estimate import count
from torchtitan_loom.distributed.parallel_dims import ParallelDims
from torchtitan_loom.protocols import Sharding, get_train_spec


def dry_run(
    cfg: Any,
    model_args: Any,
    dims: ParallelDims,
    convert: Callable[[torch.nn.Module], str] | None = None,
) -> str:
    """The dry-run report of `cfg` on `dims.world_size` ranks (builds nothing real). `convert`: the
    trainer's model conversion (float8), run on the meta model before parallelism; its line is
    reported."""
    world_size = dims.world_size
    t = cfg.training
    lines = [
        f"dry run: {cfg.model.name}/{cfg.model.flavor}, H={model_args.num_loops}, K={t.bp_segment_len}, "
        f"world size {world_size}",
        dims.describe(),
    ]
    rows = t.global_batch_size // dims.dp
    lines.append(
        f"batch: {t.global_batch_size} rows × {t.seq_len} tokens per step = {rows} rows per data-parallel "
        f"rank ({count(dims.dp, 'rank')}) = {count(rows // t.micro_batch_size, 'micro-batch', 'micro-batches')} of {t.micro_batch_size}"
    )
    lines.append(
        f"activation_checkpoint={cfg.activation_checkpoint.mode}, compile={cfg.compile.enable}, "
        f"param dtype={t.mixed_precision_param}, reduce dtype={t.mixed_precision_reduce}, "
        f"reshard_after_forward={cfg.parallelism.fsdp_reshard_after_forward}"
    )
    fake = world_size > 1 and not dist.is_initialized()
    if fake:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        dims.build_meshes("cpu")
        spec = get_train_spec(cfg.model.name)
        with torch.device("meta"):
            model = spec.model_cls(model_args)
        if convert is not None:  # the trainer's order: converters, then parallelism around them
            lines.append(convert(model))
        if spec.parallelize_fn is not None:
            model = spec.parallelize_fn(model, dims, cfg).model
        lines += _shard_report(model, spec.sharding)
    finally:
        if fake:
            dist.destroy_process_group()
    if spec.cost_fn is not None:
        from torchtitan_loom.distributed.estimate import report

        lines += report(cfg, model_args, dims)
    return "\n".join(lines)


def _shard_report(model: torch.nn.Module, sharding: Sharding) -> list[str]:
    """Rank 0's shard of every parameter; the units of the spec's repeated_unit that match the first
    one are folded into one line."""
    lines = ["rank 0 parameters: name  full shape -> local shard  placements"]
    seen: dict[str, str] = {}  # key -> its entry
    units: set[int] = set()
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        placements = ", ".join(str(x) for x in p.placements) if isinstance(p, DTensor) else "plain"
        entry = f"{tuple(p.shape)} -> {tuple(local.shape)}  {placements}"
        unit = re.match(sharding.repeated_unit, name) if sharding.repeated_unit else None
        key = name if unit is None else "{unit}." + name[unit.end() :]
        if unit is not None:
            units.add(int(unit.group(1)))
        if seen.get(key) == entry:
            continue
        seen[key] = entry
        lines.append(f"  {name}  {entry}")
    if len(units) > 1:
        unit_name = sharding.unit_name
        lines.append(
            f"  ({unit_name}s {min(units) + 1}..{max(units)}: same as {unit_name} {min(units)})"
        )
    return lines
