"""What a LOOM step costs, for the dry run's estimate (TrainSpec.cost_fn): the FSDP units of
models/loom/infra/parallelize.py (next to it: a cost of the layout), FLOPs per segment, and the activation bytes of one micro-batch for each
activation-checkpoint mode.

Activation bytes are counted tensor by tensor from what autograd saves (read off a saved-tensor hook
on this model, per block call; N = B·S tokens, A = N·k dispatched rows, c = compute bytes):

  attention   c·(6·N·n_h·h_d + N·n_kv·h_d/2) + 4·N·n_h (log-sum-exp); the sdpa kernel (CPU) also keeps
              an fp32 B·S·S mask, flex / flash attention do not
  dense       c·6·N·D + 4·2·N·D (the Looping-Residual memories stay fp32) + 4·(10·N + N·E + 3·N·k)
  MoE         c·(4·A·I + 3·A·D) routed, c·4·N·I per shared expert, 8·(N·k + 3·A) indices
  per loop    c·N·D + 4·N (the loop's closing RMSNorm)

A checkpointed region keeps only its inputs (block: z, both memories; loop: z and the H memory;
segment: the carry) plus the recorded routing, and the backward of one region holds the region's
full activations again while it runs. The backward working set adds the routed experts' gradients
in flight, c·A·(3·I + D). Checked against benchmarks/memory_time.py in tests/integration.

Legend: B rows, S sequence length, N tokens, D model dim, I expert width, E routed experts, k routed
top-k, A dispatched rows, L layers, H loops, T loops of a segment, V vocab.
"""

from __future__ import annotations

from typing import Any

import torch

from torchtitan_loom.distributed.parallel_dims import ParallelDims
from torchtitan_loom.distributed.utils import DTYPES
from torchtitan_loom.model_cost import ModelCost, SegmentCost
from torchtitan_loom.models.loom.args import LoomModelArgs
from torchtitan_loom.models.loom.attention import resolve_attn_backend
from torchtitan_loom.models.loom.infra.expert_parallel import all_to_alls_per_call
from torchtitan_loom.models.loom.infra.parallelize import fsdp_units
from torchtitan_loom.models.loom.model import LoomTransformer
from torchtitan_loom.models.loom.moe import expert_capacity
from torchtitan_loom.models.loom.target import flash_attn_available

_F32, _I64 = 4, 8


def loom_cost(args: LoomModelArgs, dims: ParallelDims, cfg: Any) -> ModelCost:
    """The LOOM cost model for `cfg`'s batch geometry, precision and activation-checkpoint mode."""
    with torch.device("meta"):
        model = LoomTransformer(args)
    t = cfg.training
    B, S = t.micro_batch_size, t.seq_len
    compute_dtype = DTYPES[t.mixed_precision_param]
    c = compute_dtype.itemsize
    # Float8 experts quantise the rows as they come (the fp32 residual stream), so under EP the
    # rows travel in fp32; plain experts get them cast to the compute dtype first.
    row_bytes = _F32 if cfg.float8.enable and cfg.float8.experts else c
    device = "cpu" if t.device == "cpu" else "cuda"
    backend = resolve_attn_backend(args.attn_backend, device, compute_dtype, flash_attn_available())
    acts = _Activations(args, B, S, c, backend)
    mode = cfg.activation_checkpoint.mode
    loop_flops = model.flops_per_token(S, head_calls=0) / args.num_loops  # per token, one loop
    head_flops = 6 * args.vocab_size * args.dim
    router_numel = args.num_routed_experts * args.dim
    L, E, k, N = args.n_layers, args.num_routed_experts, args.routed_top_k, B * S

    def segment(loop_start: int, loop_end: int) -> SegmentCost:
        T = loop_end - loop_start + 1
        calls = {}
        for unit in units:
            calls[unit.name] = T if unit.name.startswith("layers.") else 1
        idle = L * (args.num_loops - T) * router_numel if args.router_per_loop else 0
        flops = N * (T * loop_flops + head_flops)
        recompute = (
            0.0 if mode == "none" else N * T * loop_flops / 3
        )  # the forward third, once more
        a2a: tuple[tuple[str, int, int], ...] = ()  # (what, calls, bytes per call)
        if dims.ep_enabled:  # per MoE call: L per loop; with capacity the E*C fixed slots travel
            capacity = expert_capacity(N, k, E, args.capacity_factor)
            rows = N * k if capacity is None else E * capacity
            a2a = tuple(
                (f"experts {what}", L * T, nbytes)
                for what, nbytes in all_to_alls_per_call(
                    rows, args.dim, E, row_bytes, recompute=mode != "none"
                )
            )
        return SegmentCost(
            unit_calls=calls,
            idle_params=idle,
            all_to_alls=a2a,
            activation_bytes=acts.peak(mode, T),
            logits_bytes=acts.logits(),
            carry_bytes=acts.carry(),
            flops=flops,
            recompute_flops=recompute,
        )

    units = fsdp_units(model, dims)
    return ModelCost(
        units=units,
        segment=segment,
        total_params=sum(p.numel() for p in model.parameters()),
        expert_counts=L * args.num_loops * E,
    )


class _Activations:
    """Activation bytes of one micro-batch of B rows × S tokens (see the module docstring)."""

    def __init__(self, args: LoomModelArgs, B: int, S: int, c: int, backend: str):
        self.args, self.c = args, c
        a, N = args, B * S
        k, D, I, E = a.routed_top_k, a.dim, a.expert_intermediate_size, a.num_routed_experts
        A, hd = N * k, a.head_dim
        self.N, self.A, self.D = N, A, D
        attention = c * (6 * N * a.n_heads * hd + N * a.n_kv_heads * hd // 2) + _F32 * N * a.n_heads
        if backend == "sdpa":
            attention += _F32 * B * S * S
        dense = c * 6 * N * D + _F32 * (2 * N * D + 10 * N + N * E + 3 * N * k)
        moe = c * (4 * A * I + 3 * A * D + a.num_shared_experts * 4 * N * I) + _I64 * (
            N * k + 3 * A
        )
        self.block = attention + dense + moe
        self.routing = N * k * (_F32 + _I64) + 2 * A * 2 * _I64  # recorded top-k and the two sorts
        self.loop_extra = c * N * D + _F32 * N
        self.working = c * A * (3 * I + D)
        self.outside = 2 * c * N * D + 2 * _F32 * N * hd  # embedding, head input, RoPE tables

    def carry(self) -> int:
        """z, the H memory's numerator (fp32) and denominator, and the pre-norm RMS (fp32) of one
        micro-batch."""
        return self.c * self.N * self.D + _F32 * (self.N * self.D + 2 * self.N)

    def logits(self) -> int:
        """fp32 logits kept by the loss, their gradient, and the compute-dtype head output."""
        return self.N * self.args.vocab_size * (2 * _F32 + self.c)

    def peak(self, mode: str, T: int) -> int:
        """Peak activation bytes of a segment of T loops under activation_checkpoint.mode `mode`."""
        L, N, D = self.args.n_layers, self.N, self.D
        loop = L * self.block + self.loop_extra
        block_inputs = self.c * N * D + 2 * (_F32 * N * D + _F32 * N) + self.routing
        loop_inputs = self.c * N * D + _F32 * (N * D + N) + L * self.routing
        kept = {
            "none": T * loop,
            "block": T * (L * block_inputs + self.loop_extra) + self.block,
            "loop": T * loop_inputs + loop,
            "segment": self.carry() + T * loop,
        }[mode]
        return kept + self.working + self.outside
