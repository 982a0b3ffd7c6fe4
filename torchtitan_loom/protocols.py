"""What the trainer knows about a model: the ModelProtocol, its output types, and the TrainSpec
registry (TorchTitan v0.2.2 spirit: a named spec carries the model class, its flavors and the
parallelize function).

Legend: B batch rows, S sequence length, D model dim, V vocab, L layers, T loops in the range
run, E routed experts, K routed top-k.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
from torch import nn


class LoopCarry(NamedTuple):
    """State handed from one loop range to the next: the stream and the H-axis memory (fp32)."""

    z_BSD: torch.Tensor
    h_num_BSD: torch.Tensor
    h_den_BS1: torch.Tensor

    def detach(self) -> "LoopCarry":
        """Values only, no autograd history (segment boundary of truncated backprop)."""
        return LoopCarry(*(t.detach() for t in self))


class ModelOutput(NamedTuple):
    """Result of a forward over loops [loop_start, loop_end]."""

    logits_BSV: torch.Tensor
    """fp32 logits of the head applied to the state after loop_end."""
    carry: LoopCarry
    """State after loop_end, NOT detached (the caller detaches)."""
    counts_LTE: torch.Tensor
    """int64 kept (post-capacity) assignments per layer, per loop of the range, per expert."""
    aux_loss: torch.Tensor
    """Scalar: router_z_loss_coef * sum over layers and loops of the z-loss term (0 when off)."""
    topk_LTBSK: torch.Tensor | None = None
    """int64 routed expert ids chosen (top-k, before capacity) per layer, loop, token; only with
    return_topk=True (analysis / eval), else None so training carries nothing extra."""
    observed_LTNK: torch.Tensor | None = None
    """The caller's `observe` function applied to each of the N observed branch outputs (see
    ModelProtocol.observation_layout) of every layer and loop of the range, stacked; None without it."""


@runtime_checkable
class ModelProtocol(Protocol):
    """Everything the trainer uses of a model, and nothing about its internals.

    The trainer reads no model-specific field: shapes of the step's buffers, FLOPs, the bias update
    and the activation-checkpoint seam all come through this surface (a second model registered in
    tests/unit/test_protocol.py trains through the same trainer).
    """

    args: Any
    """The typed model args (a frozen dataclass with `validate()`, `init_seed`, `vocab_size`)."""
    region_wrappers: dict[str, Callable[..., Any]]
    """The AC seam: scope -> wrapper(fn, *args) that must return fn(*args); empty = plain calls.
    Scopes are the model's own (LOOM: "block", "loop", "segment"); parameter names never change."""

    @property
    def num_loops(self) -> int:
        """H, the number of loops of a full forward."""
        ...

    def init_weights(self) -> None:
        """(Re)initialise every parameter and buffer in place, layout-independently."""
        ...

    def __call__(
        self,
        tokens_BS: torch.Tensor,
        positions_BS: torch.Tensor,
        doc_ids_BS: torch.Tensor,
        loop_start: int = 1,
        loop_end: int | None = None,
        carry: LoopCarry | None = None,
        return_topk: bool = False,
        observe: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> ModelOutput:
        """Run loops [loop_start, loop_end] (1-based, global); carry is None iff loop_start == 1.
        return_topk=True also fills ModelOutput.topk_LTBSK; `observe` (a pure function of one branch
        output [B, S, D] returning a 1-D tensor, the same length every call) fills observed_LTNK."""
        ...

    def observation_layout(self) -> tuple[int, tuple[str, ...]]:
        """(L, names of the N branch outputs) that `observe` sees in each of L layers in every loop
        (LOOM: attention, moe); (0, ()) for a model that observes nothing."""
        ...

    def param_groups(self) -> dict[str, list[str]]:
        """Submodule name -> names of its parameters (per-submodule gradient norms); every group is
        listed even when empty, so the key set does not depend on the layout."""
        ...

    def expert_counts_shape(self) -> tuple[int, int]:
        """(L, E) of `ModelOutput.counts_LTE`; (0, 0) for a model without routed experts."""
        ...

    def update_expert_bias(self, counts_LE: torch.Tensor) -> None:
        """Apply the once-per-step routing-bias update from loads summed over loops, micro-batches and
        ranks (LOOM_SPEC §5.2); a no-op for a model without one."""
        ...

    def param_counts(self) -> dict[str, int]:
        """{"total": all parameters, "active": parameters used per token}."""
        ...

    def flops_per_token(self, seq_len: int, head_calls: int = 1) -> float:
        """Training FLOPs per token over all loops (forward + backward); the head counted `head_calls`
        times (once per backprop segment)."""
        ...


class Parallelized(NamedTuple):
    """What a parallelize function hands back to the trainer."""

    model: nn.Module
    finish_gradients: Callable[[], None]
    """Called once per segment after backward: sums over the data-parallel ranks every gradient the
    applied wrappers (FSDP) did not already reduce, so the step need not know which those are."""
    before_micro_batch: Callable[[bool], None] = lambda last: None
    """Called before each micro-batch's forward with last=True for a segment's final one: lets the
    wrappers defer their gradient reduction (and keep parameters gathered) to the segment's end."""


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


@dataclass(frozen=True)
class TrainSpec:
    """A registered model: its class, its named argument sets, and how to parallelize it."""

    name: str
    model_cls: type[nn.Module]
    model_args: Mapping[str, Any]
    """flavor name -> model args (e.g. LoomModelArgs)."""
    parallelize_fn: Callable[..., Parallelized] | None = None
    """parallelize(model, parallel_dims, job_config) -> Parallelized; None = a plain replicated model."""
    kernel_report_fn: Callable[..., list[str]] | None = None
    """kernel_report(model, device_type, compute_dtype, compiling) -> log lines naming the kernels the
    model will use on this device (attention backend, GEMM fallbacks); the trainer logs them once."""
    cost_fn: Callable[..., ModelCost] | None = None
    """cost(model_args, parallel_dims, job_config) -> ModelCost: FSDP units, FLOPs and activation
    bytes per segment, read by the dry run's estimate (None: the dry run prints no estimate)."""


# The registry is the only module-level mutable state in the package: specs register once at
# import of their model package and are read-only afterwards.
_REGISTRY: dict[str, TrainSpec] = {}

_MODELS_PACKAGE = "torchtitan_loom.models"


def register_train_spec(name: str, spec: TrainSpec) -> None:
    """Register `spec` under `name`; registering a different spec under a taken name is an error."""
    existing = _REGISTRY.get(name)
    if existing is not None and existing is not spec:
        raise ValueError(f"train spec {name!r} is already registered")
    _REGISTRY[name] = spec


def get_train_spec(name: str) -> TrainSpec:
    """The spec registered as `name`; imports the bundled model packages on first use."""
    if name not in _REGISTRY:
        importlib.import_module(_MODELS_PACKAGE)
    if name not in _REGISTRY:
        raise ValueError(f"unknown train spec {name!r}; registered: {', '.join(sorted(_REGISTRY)) or 'none'}")
    return _REGISTRY[name]
