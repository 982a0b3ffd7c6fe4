"""What a Trainer is made of, as typed values: the ``Setting`` a launch gives (config, ranks,
resolved model arguments and layout, the dtypes that follow), and the parts build.py makes from it
in TorchTitan's order, each group returned by the function that builds it: ``ModelParts`` (the
parallelized, initialised model and its gradient hooks), ``TrainingParts`` (segments, optimizer,
schedule, guards, data, metrics), ``Services`` (stop signals, evals, checkpoints) and, last, the
step. ``TrainerParts`` holds them all; the Trainer (loop.py) owns one and runs the loop over it.
Every part is set once, when built; the objects inside change as training runs (the model's
weights, the optimizer's state, the train state), the assignments never do.

Legend (the package's, see protocols.py): B rows, S sequence length.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from torchtitan_loom.components.checkpoint import CheckpointManager
from torchtitan_loom.components.data import TrainLoader
from torchtitan_loom.components.evaluation.downstream import DownstreamScorer
from torchtitan_loom.components.evaluation.held_out import HeldOutEval
from torchtitan_loom.components.observability.diagnostics import BranchDiagnostics
from torchtitan_loom.components.observability.metrics import MetricsLogger
from torchtitan_loom.components.optim.divergence import DivergenceMonitor
from torchtitan_loom.components.optim.spike_guard import SpikeGuard
from torchtitan_loom.components.quantization.float8 import Float8Converter
from torchtitan_loom.components.runtime.preemption import PreemptionWatcher
from torchtitan_loom.components.runtime.train_state import TrainState
from torchtitan_loom.config import JobConfig
from torchtitan_loom.depth_sampling import DepthSampler
from torchtitan_loom.distributed import utils as dist_utils
from torchtitan_loom.distributed.parallel_dims import ParallelDims
from torchtitan_loom.protocols import ModelProtocol, TrainSpec
from torchtitan_loom.trainer.step import Batch, SegmentedStep


@dataclass(frozen=True)
class Setting:
    """What one launch trains with, known before anything is built; every builder reads it."""

    cfg: JobConfig
    info: dist_utils.DistInfo
    run_id: str
    model_args: Any
    """The model's resolved arguments (config.resolve: the TrainSpec's own args type)."""
    parallel_dims: ParallelDims
    spec: TrainSpec
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    use_autocast: bool
    """bf16 autocast without FSDP; under FSDP its MixedPrecisionPolicy casts the parameters."""

    @property
    def device(self) -> torch.device:
        return self.info.device

    def log(self, msg: str) -> None:
        """A console line from the metrics rank only."""
        if self.info.rank == self.cfg.metrics.log_rank:
            print(f"[torchtitan_loom] {msg}", flush=True)

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast without FSDP (a single process included); under FSDP its MixedPrecisionPolicy
        computes with bf16 parameters instead; fp32 runs are plain."""
        if not self.use_autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    def micro_batches(self, batch: Batch) -> list[Batch]:
        """This rank's rows of a global batch, in micro-batches of training.micro_batch_size, on
        the device (each value B×S, B at most micro_batch_size)."""
        mb = self.cfg.training.micro_batch_size
        rows = batch["input_ids"].shape[0]
        return [
            {k: v[i : i + mb].to(self.device, non_blocking=True) for k, v in batch.items()}
            for i in range(0, rows, mb)
        ]


@dataclass(frozen=True)
class ModelParts:
    """The model after meta → converters → AC, compile → parallelize → materialise → init."""

    model: ModelProtocol
    params: list[torch.Tensor]
    """The trainable parameters."""
    float8: Float8Converter | None
    float8_precompute: bool
    """Whether FSDP shards float8 weights: their scales are precomputed after each update."""
    compiled_units: int
    finish_gradients: Callable[[], None]
    before_micro_batch: Callable[[bool], None]


@dataclass(frozen=True)
class TrainingParts:
    """What training needs around the model: segments, update, guards, data, metrics."""

    segments: list[tuple[int, int]]
    depth: DepthSampler | None
    diagnostics: BranchDiagnostics
    optimizer: torch.optim.Optimizer
    lr_scheduler: LambdaLR
    spike_guard: SpikeGuard
    state: TrainState
    divergence: DivergenceMonitor
    data_path: str | Path
    tokenizer_name: str | None
    dataloader: TrainLoader
    metrics: MetricsLogger
    flops_per_token: float


@dataclass(frozen=True)
class Services:
    """Built last, once everything they watch or save exists."""

    stop_signals: PreemptionWatcher
    held_out: HeldOutEval
    downstream: DownstreamScorer | None
    """None when eval.downstream_interval is 0."""
    checkpointer: CheckpointManager


@dataclass(frozen=True)
class TrainerParts:
    """Everything a Trainer is made of (build.py's ``build``), each group from its own builder."""

    setting: Setting
    model_parts: ModelParts
    training: TrainingParts
    services: Services
    step: SegmentedStep
