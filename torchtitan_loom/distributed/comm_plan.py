"""Every collective one training step makes on a rank, predicted from the layout and the model's
cost (TrainSpec.cost_fn) without running anything: what the dry run's estimate prices, and what
tests/distributed/test_estimate_comm.py counts on real gloo ranks.

What FSDP2 does per unit, per micro-batch and segment (measured on gloo, torch 2.13, and asserted
by that test): a unit called c times in a forward runs FSDP's post-backward once per use, and the
trainer (parallelize.LoopedBlockSync) keeps a looped block's sync and reshard off in a backward
that reduces until its last use there, so the unit is reduce-scattered once per reducing backward
(with HSDP the reduce-scattered shard is then all-reduced over the replicas) and stays gathered
through the whole backward. All-gathers: with reshard_after_forward "never", once per micro-batch
(the forward's first call); with "always", once per call in the forward plus once in the backward.
Activation checkpointing adds no gather (the recompute runs while the unit is gathered for
backward). A unit on a mesh of one rank makes no call. With ``parallelism.fsdp_sync = "segment"``
the micro-batches of a segment share the gathers (parameters stay gathered, gradients accumulate
unsharded until the last micro-batch): one gather per unit and segment with "never",
c·micro + 1 with "always" (after the first micro-batch the forward's first call finds the
parameters still gathered); one reduction per unit and segment whatever c and micro.

Bytes are those of the tensors passed: an all-gather's gathered output, a reduce-scatter's
unsharded input (FSDP pads each parameter's split dimension to a multiple of the shard degree),
an all-reduce's buffer, an all-to-all's input.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from torchtitan_loom.depth_sampling import step_segments
from torchtitan_loom.distributed.parallel_dims import ParallelDims
from torchtitan_loom.distributed.utils import DTYPES
from torchtitan_loom.model_cost import FsdpUnit, ModelCost, SegmentCost

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


class Collective(NamedTuple):
    kind: str
    """One of KINDS."""
    what: str
    """The FSDP unit, or the trainer's / expert-parallel purpose."""
    group: str
    """The mesh dimension it runs over (dp_shard, dp_shard_mod_ep, dp_replicate, ep, dp)."""
    size: int
    """Ranks in the group."""
    span: int
    """Consecutive ranks the group lies within (≤ gpus per node: it stays inside one node)."""
    calls: int
    """Calls per step."""
    nbytes: int
    """Bytes passed per call."""


def padded_numel(unit: FsdpUnit, degree: int) -> int:
    """Values FSDP gathers for the unit: each parameter's split dimension rounded up to the degree."""
    total = 0
    for shape in unit.shapes:
        dims = list(shape)
        dims[unit.shard_dim] = -(-dims[unit.shard_dim] // degree) * degree
        total += math.prod(dims)
    return total


def shard_degree(unit: FsdpUnit, dims: ParallelDims) -> int:
    return dims.dp_shard if unit.mesh == "fsdp" else dims.dp_shard_mod_ep


def replicated_numel(cost: ModelCost, dims: ParallelDims) -> int:
    """Parameters outside every FSDP unit (replicated over the data-parallel ranks under FSDP)."""
    ep = dims.ep if dims.ep_enabled else 1
    in_units = sum(
        math.prod(s) * (ep if u.mesh == "efsdp" else 1) for u in cost.units for s in u.shapes
    )
    return cost.total_params - in_units


def _gradient_collectives(
    cfg: Any, cost: ModelCost, seg: SegmentCost, dims: ParallelDims, micro: int
) -> list[Collective]:
    """One segment's parameter gathers and gradient reductions: per FSDP unit, or one all-reduce
    of the gradients without FSDP."""
    t, par = cfg.training, cfg.parallelism
    pb, rb = DTYPES[t.mixed_precision_param].itemsize, DTYPES[t.mixed_precision_reduce].itemsize
    per_segment_sync = par.fsdp_sync == "segment"
    always = par.fsdp_reshard_after_forward == "always"
    world = dims.world_size
    out: list[Collective] = []
    if dims.fsdp_enabled:
        for unit in cost.units:
            n, r = shard_degree(unit, dims), dims.dp_replicate
            group = "dp_shard" if unit.mesh == "fsdp" else "dp_shard_mod_ep"
            numel, c = padded_numel(unit, n), seg.unit_calls[unit.name]
            if per_segment_sync:
                gathers = c * micro + 1 if always else 1
                reductions = 1
            else:
                gathers, reductions = (c + 1 if always else 1) * micro, micro
            if n > 1:
                out.append(
                    Collective(
                        "all_gather", unit.name, group, n, dims.dp_shard, gathers, numel * pb
                    )
                )
                out.append(
                    Collective(
                        "reduce_scatter",
                        unit.name,
                        group,
                        n,
                        dims.dp_shard,
                        reductions,
                        numel * rb,
                    )
                )
            if r > 1:
                out.append(
                    Collective(
                        "all_reduce",
                        unit.name,
                        "dp_replicate",
                        r,
                        world,
                        reductions,
                        numel // n * rb,
                    )
                )
        replicated = replicated_numel(cost, dims) - seg.idle_params
        if replicated > 0:
            out.append(
                Collective(
                    "all_reduce",
                    "replicated parameters",
                    "dp",
                    world,
                    world,
                    1,
                    replicated * rb,
                )
            )
    else:
        out.append(
            Collective(
                "all_reduce",
                "gradients",
                "dp",
                world,
                world,
                1,
                (cost.total_params - seg.idle_params) * rb,
            )
        )
    return out


def predict(cfg: Any, cost: ModelCost, dims: ParallelDims, num_loops: int) -> list[Collective]:
    """The collectives of one step on one rank (empty on one rank)."""
    if dims.world_size == 1:
        return []
    t = cfg.training
    micro = t.global_batch_size // dims.dp // t.micro_batch_size
    world = dims.world_size
    out: list[Collective] = []
    ranges = step_segments(num_loops, t.bp_segment_len, t.sample_depth_max)
    for a, b in ranges:
        seg = cost.segment(a, b)
        out += _gradient_collectives(cfg, cost, seg, dims, micro)
        for what, calls, nbytes in seg.all_to_alls:
            out.append(
                Collective("all_to_all", what, "ep", dims.ep, dims.ep, calls * micro, nbytes)
            )
        out.append(Collective("all_reduce", "step statistics", "dp", world, world, 1, 4 * 8))
    out.append(Collective("all_reduce", "valid tokens", "dp", world, world, 1, 8))
    if cost.expert_counts:
        # One column per loop a step may run (the step's counts_LHE): past H with sample_depth_max.
        n_counts = cost.expert_counts // num_loops * ranges[-1][1]
        out.append(Collective("all_reduce", "expert counts", "dp", world, world, 1, n_counts * 8))
    return out


def merged(collectives: list[Collective]) -> list[Collective]:
    """Calls of the same (kind, what, group, bytes) added up over the segments, order kept."""
    seen: dict[tuple, Collective] = {}
    for c in collectives:
        key = (c.kind, c.what, c.group, c.nbytes)
        seen[key] = seen[key]._replace(calls=seen[key].calls + c.calls) if key in seen else c
    return list(seen.values())


def totals(collectives: list[Collective]) -> dict[str, tuple[int, int]]:
    """kind -> (calls, bytes) per step."""
    result = {kind: (0, 0) for kind in KINDS}
    for c in collectives:
        calls, nbytes = result[c.kind]
        result[c.kind] = (calls + c.calls, nbytes + c.calls * c.nbytes)
    return result
