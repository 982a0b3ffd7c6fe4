"""A model's side of the dry run's estimate, what ``TrainSpec.cost_fn`` returns: the FSDP units its
parallelize function builds and what one micro-batch costs in one backprop segment. Read by
distributed/estimate.py, distributed/comm_plan.py and the start report; torch-free."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple


class FsdpUnit(NamedTuple):
    """One FSDP2 unit as the parallelize function builds it (for the dry run's cost estimate)."""

    name: str
    """Module FQN ("" = the root)."""
    shapes: tuple[tuple[int, ...], ...]
    """Shapes FSDP shards, per parameter, after any expert-parallel split (its local tensors)."""
    mesh: str
    """ParallelDims mesh it is sharded on: "fsdp" (dense) or "efsdp" (routed experts)."""
    shard_dim: int
    """Dimension FSDP splits (padded up to a multiple of the shard degree)."""


class SegmentCost(NamedTuple):
    """What one micro-batch costs in one backprop segment (a forward over T loops and its backward)."""

    unit_calls: dict[str, int]
    """FSDP unit name -> times the forward calls it."""
    idle_params: int
    """Parameters without a gradient in this segment (e.g. the routers of other loops)."""
    all_to_alls: tuple[tuple[str, int, int], ...]
    """(what, calls, bytes per call) of every all-to-all (expert parallelism) on one rank; bytes a
    rank receives that depend on the routing are given at their mean over the ranks."""
    activation_bytes: int
    """Peak bytes of activations (saved for backward, plus the recompute and backward working set)."""
    logits_bytes: int
    """Logits, their softmax and their gradient at the loss."""
    carry_bytes: int
    """The state one micro-batch carries to the next segment (kept for every micro-batch)."""
    flops: float
    """Model FLOPs (forward + backward) of the segment."""
    recompute_flops: float
    """Extra forward FLOPs that activation checkpointing spends."""


class ModelCost(NamedTuple):
    """A model's side of the dry run's estimate (TrainSpec.cost_fn)."""

    units: list[FsdpUnit]
    segment: Callable[[int, int], SegmentCost]
    """segment(loop_start, loop_end) -> one micro-batch's cost of that segment."""
    total_params: int
    expert_counts: int
    """Values of the step's expert-count tensor (summed over the ranks once per step)."""
