"""What a person waiting on the trainer is told up front: what is being built, a rough memory and
time estimate of one step on this device, and a warning when that is far beyond the machine.

The estimate is deliberately simple (the dry run's estimate adds gathered parameters and the
communication; benchmarks/memory_time.py measures): per rank, parameters + gradients + the
optimizer's state in fp32 (8 bytes per parameter + the optimizer table's state bytes: AdamW 8,
Lion 4; divided by the FSDP degree), plus the activation bytes of the
model's own cost model (TrainSpec.cost_fn, the one the dry run reads: the largest segment's
activations of one micro-batch, its logits and gradient, the carries). Time: the step's training FLOPs on this rank over the rate that a
matmul reaches on this device right now (measured in a fraction of a second), i.e. a lower bound.
Nothing here refuses to run.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from torchtitan_loom.components.optim.choices import OPTIMIZERS
from torchtitan_loom.components.runtime.messages import count
from torchtitan_loom.depth_sampling import flops_per_token as expected_flops
from torchtitan_loom.depth_sampling import training_depth
from torchtitan_loom.model_cost import ModelCost

_GIB = float(1 << 30)
# Warn on CPU when one step needs more than this share of the RAM, or at least this many seconds.
RAM_SHARE_WARN = 0.8
STEP_SECONDS_WARN = 60.0


@dataclass(frozen=True)
class StepEstimate:
    params: int
    active: int
    state_gib: float
    """Parameters, gradients and the optimizer's state on one rank."""
    activation_gib: float
    """Activations one micro-batch keeps for the largest segment, its logits and their gradient, and
    the carries of the rank's micro-batches (TrainSpec.cost_fn's figures)."""
    step_tflop: float
    """Training FLOPs of one step on one rank."""
    activations_known: bool = True
    """False when the model's TrainSpec has no cost model (activation_gib is then 0)."""

    @property
    def total_gib(self) -> float:
        return self.state_gib + self.activation_gib


def estimate_step(
    cfg: Any,
    dims: Any,
    counts: dict[str, int],
    flops_per_token: float,
    cost: ModelCost | None,
    num_loops: int,
) -> StepEstimate:
    """The activation term is the dry run's own (TrainSpec.cost_fn, one activation model for both):
    the largest segment's activations of one micro-batch, its logits and the carries of the rank's
    micro-batches. None (a spec without a cost model): the activation term is not estimated (0)."""
    t = cfg.training
    rows_per_rank = t.global_batch_size // dims.dp
    activation = 0
    if cost is not None:
        segs = [cost.segment(a, b) for a, b in training_depth(t, num_loops)[0]]
        micro = rows_per_rank // t.micro_batch_size
        activation = (
            max(s.activation_bytes for s in segs)
            + segs[0].logits_bytes
            + micro * segs[0].carry_bytes
        )
    per_param = 8 + OPTIMIZERS[cfg.optimizer.name].state_bytes_per_param  # fp32 weight + gradient
    state = per_param * counts["total"] / max(dims.dp_shard, 1)
    return StepEstimate(
        params=counts["total"],
        active=counts["active"],
        state_gib=state / _GIB,
        activation_gib=activation / _GIB,
        step_tflop=flops_per_token * rows_per_rank * t.seq_len / 1e12,
        activations_known=cost is not None,
    )


def matmul_tflops(device: torch.device, dtype: torch.dtype, seconds: float = 0.2) -> float:
    """The rate (TFLOP/s) of a square matmul on ``device`` in ``dtype``, measured for ~``seconds``."""
    n = 512 if device.type == "cpu" else 4096
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        done += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 2 * n**3 * done / max(time.perf_counter() - start, 1e-9) / 1e12


def device_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / _GIB
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / _GIB


def start_lines(cfg: Any, est: StepEstimate, device: torch.device, rate_tflops: float) -> list[str]:
    """The first line (what is built, its estimate) and, on CPU, a warning when it is far beyond the machine."""
    mem = device_memory_gib(device)
    seconds = est.step_tflop / max(rate_tflops, 1e-9)
    where = (
        f"{count(torch.get_num_threads(), 'CPU thread')}, {mem:.0f} GiB RAM"
        if device.type == "cpu"
        else f"{torch.cuda.get_device_name(device)}, {mem:.0f} GiB"
    )
    acts = (
        f"{est.activation_gib:.2f} activations of one micro-batch"
        if est.activations_known
        else "activations not estimated: the model's TrainSpec has no cost_fn"
    )
    lines = [
        f"building {cfg.model.name}/{cfg.model.flavor}: {est.params / 1e6:,.2f}M parameters "
        f"({est.active / 1e6:,.2f}M active per token); estimated per rank: {est.total_gib:.2f} GiB "
        f"({est.state_gib:.2f} parameters + gradients + {cfg.optimizer.name}, {acts}), ≥ {seconds:,.1f} s per step at the {rate_tflops * 1e3:,.0f} GFLOP/s a "
        f"{cfg.training.mixed_precision_param} matmul reaches on {device.type} ({where})"
    ]
    if device.type == "cpu" and (
        est.total_gib > RAM_SHARE_WARN * mem or seconds > STEP_SECONDS_WARN
    ):
        lines.append(
            f"warning: one step of this config needs ~{est.total_gib:.1f} GiB and at least "
            f"{seconds / 60:,.1f} min on this CPU ({mem:.0f} GiB RAM); it will run, but a GPU or a "
            f"smaller flavor / micro_batch_size / seq_len is what this config is meant for"
        )
    return lines


def start_report(
    cfg: Any,
    dims: Any,
    meta_model: Any,
    num_segments: int,
    device: torch.device,
    dtype: torch.dtype,
    cost_fn: Any = None,
) -> list[str]:
    """The start lines for a model still on the meta device (nothing allocated yet); ``cost_fn``:
    the TrainSpec's cost model (None: no activation estimate)."""
    t = cfg.training
    segs, sampler = training_depth(t, meta_model.num_loops)
    fpt = expected_flops(meta_model, t.seq_len, segs, sampler)
    cost = None if cost_fn is None else cost_fn(meta_model.args, dims, cfg)
    est = estimate_step(cfg, dims, meta_model.param_counts(), fpt, cost, meta_model.num_loops)
    return start_lines(cfg, est, device, matmul_tflops(device, dtype))


def final_line(
    steps: int, code: int, dump_folder: str, last_eval: tuple[int, list[float]] | None
) -> str:
    line = f"done: {steps} steps, exit code {code}; outputs in {os.path.abspath(dump_folder)}"
    if last_eval is not None:
        at, losses = last_eval
        line += f"; last eval (step {at}) loss after loop " + " / ".join(f"{v:.4f}" for v in losses)
    return line
