"""parallelize_loom: native PyTorch parallelism applied to the LOOM model from outside: expert
parallelism, then FSDP2 (activation checkpointing and torch.compile come before, from the trainer,
through the scopes and units the spec declares: distributed/model_wrappers.py). None of it changes
the math (the parity tests in tests/distributed/ prove it); the model file holds no parallel code.

Choices made for the looped model (each block runs H times per forward, K per segment):

- Routers stay out of FSDP: replicated DTensors on the ``dp`` mesh, fp32, their gradients summed
  by ``distributed.utils.reduce_gradients``. The model picks ``routers[t-1]`` outside the block
  and passes it in as a tensor (one compiled graph serves every loop); were the routers in the
  block's FSDP unit, that argument would be read before FSDP unshards the block (a sharded
  DTensor in loop 1), and its gradient would reach the parameter only after the block's
  post-backward hook has reduce-scattered, so loop ``a``'s router of each segment would never be
  reduced (measured). Cost: L·H·E·D replicated fp32 values (5.2M for loom_1p7b) and one small
  all-reduce per segment. A forward pre-hook on each block turns the DTensor into its local tensor.
- ``reshard_after_forward`` "default" = False ("never"): a block's parameters are all-gathered
  once per forward instead of once per loop (measured, README "Parallelism").
- ``fsdp_sync`` "segment" (default): within a segment FSDP reduces gradients (reduce-scatter, and
  the HSDP all-reduce) only after the last micro-batch, and parameters stay gathered across the
  segment's micro-batches, so a segment makes one all-gather and one reduce-scatter per unit
  whatever the micro-batch count. Cost: each rank holds the unsharded fp32 (``reduce_dtype``)
  gradients of every FSDP unit until the segment's last backward (docs/parallelism.md gives the
  figures). "micro_batch": FSDP's per-backward behaviour, the sharded gradients only.
- A block runs K times in a segment's forward, and FSDP2's post-backward runs once per use: left
  alone, a backward that reduces would reduce-scatter (and reshard) after the first use it meets
  and again after the last. ``LoopedBlockSync`` keeps each block's sync and reshard off in that
  backward until its last use there (the segment's first loop) and turns them on from a hook on
  that use's output gradient, so a block reduces once per reducing backward at any K.
- FSDP's gradient division is off and its reductions are plain sums (gloo has no pre-multiplied
  sum), because the loss is already divided by the global valid-token count.
- ``cast_forward_inputs=False``: the Looping-Residual memories, the carry and the RoPE tables stay
  fp32 as the spec's precision notes require; parameters are cast to ``param_dtype`` by FSDP.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from torchtitan_loom.distributed.parallel_dims import ParallelDims
from torchtitan_loom.distributed.utils import DTYPES, RESHARD_AFTER_FORWARD, reduce_gradients
from torchtitan_loom.model_cost import FsdpUnit
from torchtitan_loom.protocols import Parallelized

if TYPE_CHECKING:
    from torchtitan_loom.models.loom.block import LoomBlock
    from torchtitan_loom.models.loom.model import LoomTransformer
    from torchtitan_loom.models.loom.moe import Experts


def parallelize_loom(
    model: nn.Module, parallel_dims: ParallelDims, job_config: Any
) -> Parallelized:
    """Apply EP and FSDP2 as configured (in place, on the meta-device model).

    Returns the model, its ``finish_gradients`` (without FSDP it sums every gradient over the
    data-parallel ranks; under FSDP only the replicated routers', FSDP reduce-scattered the rest)
    and its ``before_micro_batch`` (FSDP's sync per segment or per micro-batch, ``fsdp_sync``).
    The caller materialises afterwards (``to_empty`` + ``init_weights``, layout-independent).
    """
    cfg = job_config
    loom = cast("LoomTransformer", model)
    reduce_dtype = DTYPES[cfg.training.mixed_precision_reduce]
    if parallel_dims.ep_enabled:
        from torchtitan_loom.models.loom.infra.expert_parallel import apply_expert_parallel

        apply_expert_parallel(model, parallel_dims.get_mesh("ep"))
    if parallel_dims.fsdp_enabled:
        apply_fsdp(
            model,
            parallel_dims,
            param_dtype=DTYPES[cfg.training.mixed_precision_param],
            reduce_dtype=reduce_dtype,
            reshard_after_forward=RESHARD_AFTER_FORWARD[cfg.parallelism.fsdp_reshard_after_forward],
        )

    def finish_gradients() -> None:
        # Parameters are looked up per call: materialising the meta model may swap the objects.
        if parallel_dims.fsdp_enabled:
            unreduced = [router for moe in loom.moe_layers() for router in moe.routers]
        else:
            unreduced = [p for p in model.parameters() if p.requires_grad]
        reduce_gradients(unreduced, reduce_dtype)

    if not parallel_dims.fsdp_enabled:
        return Parallelized(model, finish_gradients)
    looped = LoopedBlockSync(loom.layers)
    root = cast(FSDPModule, model)  # apply_fsdp sharded the root

    def defer_sync_to_segment_end(last: bool) -> None:
        # Deferred sync: gradients accumulate unsharded and the gathered parameters stay until the
        # segment's last backward, which reduces and reshards (before the optimizer step).
        root.set_requires_gradient_sync(last, recurse=True)
        root.set_reshard_after_backward(last, recurse=True)
        if last:
            looped.defer()

    # The sync mode is bound here, once: the step calls whichever hook this layout needs. Either
    # way a reducing backward reduces each looped block once (LoopedBlockSync).
    if cfg.parallelism.fsdp_sync == "segment":
        return Parallelized(model, finish_gradients, defer_sync_to_segment_end)
    return Parallelized(model, finish_gradients, lambda last: looped.defer())


class LoopedBlockSync:
    """One reduce-scatter per block in a backward that reduces, however many loops used the block.

    ``defer()`` (before such a forward) turns the blocks' gradient sync and reshard-after-backward
    off (their FSDP units inside, the routed experts under EP, too) and arms each block: its first
    call of that forward, the segment's first loop and so its last use in the backward, registers a
    hook on its output gradient that turns them back on. That gradient is complete only once every
    later loop's backward through the block has run (each of them lies between it and the loss),
    so FSDP's post-backward of that last use reduces the gradient of all K uses, once, and
    reshards. Public FSDP2 calls only (``set_requires_gradient_sync``, ``set_reshard_after_backward``
    on the block). Per-object state, for the model's lifetime.
    """

    def __init__(self, blocks: nn.ModuleList):
        self._blocks = list(blocks)
        self._armed: set[int] = set()
        for index, block in enumerate(self._blocks):
            block.register_forward_hook(self._after_forward_hook(index))

    def defer(self) -> None:
        for block in self._blocks:
            _set_block_sync(block, False)
        self._armed = set(range(len(self._blocks)))

    def _after_forward_hook(self, index: int):
        block = self._blocks[index]

        def enable(grad: torch.Tensor) -> None:
            _set_block_sync(block, True)

        # Outside the compiled block graph: the hook only reads Python state and registers a hook.
        @torch.compiler.disable
        def after_forward(module: nn.Module, args: Any, output: Any) -> None:
            if index not in self._armed:
                return  # a later loop, a recompute, or a forward that does not reduce
            self._armed.discard(index)
            z = output[0]
            if z.requires_grad:
                z.register_hook(enable)
            else:  # no backward through this output: reduce as FSDP would
                _set_block_sync(block, True)

        return after_forward


def _set_block_sync(block: nn.Module, on: bool) -> None:
    unit = cast(FSDPModule, block)  # apply_fsdp sharded every block
    unit.set_requires_gradient_sync(on, recurse=True)
    unit.set_reshard_after_backward(on, recurse=True)


def apply_fsdp(
    model: nn.Module,
    parallel_dims: ParallelDims,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool,
) -> None:
    """FSDP2 units: [routed experts on efsdp when ep > 1], each block, the embedding, the head, the root.

    Dense parameters shard on the ``fsdp`` mesh (HSDP when dp_replicate > 1); routed experts,
    already ``Shard(0)`` over ``ep``, shard on ``efsdp`` (= dp_shard / ep ranks).
    """
    mp = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False
    )
    dense_mesh = parallel_dims.get_mesh("fsdp")
    routers = replicate_routers(model, parallel_dims.get_mesh("dp"))
    common: dict[str, Any] = dict(mp_policy=mp, reshard_after_forward=reshard_after_forward)
    for layer in _blocks(model):
        if parallel_dims.ep_enabled:
            experts = layer.moe.experts
            fully_shard(
                experts,
                mesh=parallel_dims.get_mesh("efsdp"),
                shard_placement_fn=expert_shard_placement(experts, parallel_dims.dp_shard_mod_ep),
                **common,
            )
        fully_shard(layer, mesh=dense_mesh, ignored_params=routers, **common)
        layer.register_forward_pre_hook(_local_tensor_args)
    loom = cast("LoomTransformer", model)
    fully_shard(loom.tok_embeddings, mesh=dense_mesh, **common)
    fully_shard(loom.output, mesh=dense_mesh, **common)
    fully_shard(model, mesh=dense_mesh, mp_policy=mp, ignored_params=routers)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def fsdp_units(model: nn.Module, parallel_dims: ParallelDims) -> list[FsdpUnit]:
    """The units apply_fsdp builds, with the shapes each shards (read by the dry run's estimate;
    works on a meta-device model before any parallelism is applied)."""
    units = []
    ep = parallel_dims.ep if parallel_dims.ep_enabled else 1
    for l, layer in enumerate(_blocks(model)):
        experts = [(f"layers.{l}.moe.{n}", p) for n, p in layer.moe.experts.named_parameters()]
        dense = [
            (n, p) for n, p in layer.named_parameters(prefix=f"layers.{l}") if ".routers." not in n
        ]
        if ep > 1:
            local = tuple((p.shape[0] // ep, *p.shape[1:]) for _, p in experts)
            shard_dim = 0 if local[0][0] >= parallel_dims.dp_shard_mod_ep else 1
            units.append(FsdpUnit(f"layers.{l}.moe.experts", local, "efsdp", shard_dim))
            dense = [(n, p) for n, p in dense if ".moe.experts." not in n]
        units.append(FsdpUnit(f"layers.{l}", tuple(tuple(p.shape) for _, p in dense), "fsdp", 0))
    for name in ("tok_embeddings", "output"):
        units.append(FsdpUnit(name, (tuple(getattr(model, name).weight.shape),), "fsdp", 0))
    return units


def replicate_routers(model: nn.Module, dp_mesh: Any) -> set[nn.Parameter]:
    """Turn every router into a DTensor replicated over the data-parallel mesh (in place).

    DTensors, not plain tensors, because one foreach AdamW cannot mix the two. Works on meta.
    """
    routers = set()
    for moe in cast("LoomTransformer", model).moe_layers():
        for i, weight in enumerate(moe.routers):
            replicated = distribute_tensor(
                weight.detach(), dp_mesh, [Replicate()], src_data_rank=None
            )
            moe.routers[i] = nn.Parameter(replicated, requires_grad=weight.requires_grad)
            routers.add(moe.routers[i])
    return routers


def expert_shard_placement(experts: Experts, efsdp_degree: int):
    """FSDP placement of the routed experts: Shard(0) over the local experts when there are at
    least as many as efsdp ranks, else Shard(1) (rows of each expert) so no rank holds only padding."""
    local_experts = _local(experts.w13).shape[0]
    placement = Shard(0) if local_experts >= efsdp_degree else Shard(1)
    return lambda param: placement


def _blocks(model: nn.Module) -> Iterable[LoomBlock]:
    """model.layers of a LoomTransformer, typed (an nn.ModuleList iterates as nn.Module)."""
    return cast("Iterable[LoomBlock]", model.layers)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _local_tensor_args(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Forward pre-hook of a block: the replicated router arrives as a DTensor; the block computes
    on plain tensors (gradients flow back to the DTensor through to_local)."""
    return tuple(a.to_local() if isinstance(a, DTensor) else a for a in args)
