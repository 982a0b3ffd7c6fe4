"""The one config schema: JobConfig, a dataclass per TOML section, every field typed, defaulted
and documented once (its ``opt`` help text, which ``--help`` prints; nothing else documents a key).

The field helper and the generated ``[model]`` section live in fields.py, the sections in
sections_train.py and sections_infra.py; this module assembles them and re-exports every name, so
``from torchtitan_loom.config.schema import X`` is the one import for any of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from torchtitan_loom.config.fields import (
    DEFAULT_MODEL,
    attribute_docs,
    default_model,
    model_section,
    opt,
)
from torchtitan_loom.config.sections_infra import (
    ActivationCheckpoint,
    Checkpoint,
    Comm,
    Compile,
    Estimate,
    Float8,
    Parallelism,
    Profiling,
)
from torchtitan_loom.config.sections_train import (
    Data,
    Eval,
    Job,
    LRScheduler,
    Metrics,
    Optimizer,
    SpikeGuard,
    Training,
)

__all__ = [
    "DEFAULT_MODEL",
    "SECTION_DOCS",
    "ActivationCheckpoint",
    "Checkpoint",
    "Comm",
    "Compile",
    "Data",
    "Estimate",
    "Eval",
    "Float8",
    "Job",
    "JobConfig",
    "LRScheduler",
    "Metrics",
    "Optimizer",
    "Parallelism",
    "Profiling",
    "SpikeGuard",
    "Training",
    "attribute_docs",
    "default_model",
    "model_section",
    "opt",
]


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Any = field(default_factory=default_model)
    """The chosen model's section (``model_section``); its class depends on ``model.name``."""
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    spike_guard: SpikeGuard = field(default_factory=SpikeGuard)
    data: Data = field(default_factory=Data)
    eval: Eval = field(default_factory=Eval)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    estimate: Estimate = field(default_factory=Estimate)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    comm: Comm = field(default_factory=Comm)

    def __post_init__(self) -> None:
        # Which keys a source set (dotted key -> the command line or a file's path), filled by
        # load_config; not a field, so the resolved config and its TOML hold values only. A
        # value equal to its default still counts as given (e.g. a degree pinned under "auto").
        self.given: dict[str, str] = {}

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


SECTION_DOCS = {
    "job": "Run identity and output folder.",
    "model": "Model spec and flavor; set keys override the flavor (None keeps it).",
    "training": "Batch geometry, steps, segmented backprop, precision.",
    "optimizer": "AdamW (LOOM_SPEC §7.2).",
    "lr_scheduler": "WSD or cosine schedule (LOOM_SPEC §7.1).",
    "spike_guard": "Per-segment loss-spike guard (LOOM_SPEC §7.4).",
    "data": "Packed-document corpus (LOOM_SPEC §8, §14).",
    "eval": "Held-out evaluation: full H loops plus the loss after every loop.",
    "metrics": "Console, metrics.jsonl and TensorBoard.",
    "profiling": "torch.profiler traces and CUDA memory snapshots every profile_freq steps.",
    "checkpoint": "DCP checkpoints: periodic + snapshots, atomic, resume at any world size, preemption.",
    "parallelism": "Data parallel (FSDP2 / HSDP) and expert parallel degrees; dry run.",
    "activation_checkpoint": "Activation recomputation per block, loop or segment.",
    "estimate": "Hardware assumptions of the dry run's step-time, MFU and layout estimate (a roofline).",
    "compile": "torch.compile per block.",
    "float8": "Float8 training via torchao.",
    "comm": "Process-group timeouts (TorchTitan's [comm]).",
}
