"""The one config schema: a dataclass per TOML section, every field typed, defaulted and documented.

The help text of a field lives in its metadata (``doc``); ``--help`` prints it and nothing else
documents the key. A field may also carry ``choices`` (valid string values) and ``pending`` (the
issue that implements it: until then any non-default value is rejected as "not supported yet",
never silently ignored).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


def opt(default: Any, doc: str, *, choices: tuple[str, ...] | None = None, pending: str | None = None):
    """A documented config field (``default`` may be a list; it is copied per instance)."""
    meta = {"doc": doc, "choices": choices, "pending": pending}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


_PAR = "the parallelism issue (#5)"
_CKPT = "the checkpoint issue (#6)"
_F8 = "the float8 issue (#7)"


@dataclass
class Job:
    config_file: str = opt("", "TOML file read before the CLI overrides (CLI > TOML > defaults).")
    dump_folder: str = opt("./outputs", "Run directory: metrics.jsonl, tb/, config.toml, checkpoints.")
    description: str = opt("", "Free text, printed at start and saved with the resolved config.")
    print_config: bool = opt(False, "Print the resolved config as TOML at start.")


@dataclass
class Model:
    name: str = opt("loom", "Registered TrainSpec name.")
    flavor: str = opt("debug", "Size preset of the spec (loom: debug, loom_329m, loom_1p7b).")
    num_loops: int | None = opt(None, "H, loops over the L blocks (None: the flavor's; LOOM uses 9).")
    cycle_residual_scale: bool | None = opt(
        None, "Residual scale γ = λ/(H√L) on every branch write; false → γ = 1 (seed CYCLE_RESIDUAL_SCALE).")
    cycle_scale_lambda: float | None = opt(None, "λ of the residual scale and the injection gate (LOOM 0.5).")
    embed_inject_mode: str | None = opt(
        None, "Embedding re-injection at loop start (seed EMBED_INJECT_MODE).",
        choices=("none", "loop_start_mix_soft"))
    ffn_branch_rms: str | None = opt(
        None, "RMSNorm on the MoE output before γ (seed FFN_BRANCH_RMS).", choices=("none", "affine"))
    looping_residual: bool | None = opt(None, "Looping Residual carry on the attention branch; false → x + o.")
    looping_residual_beta: float | None = opt(None, "β of the Looping Residual EMAs (LOOM 0.5).")
    router_per_loop: bool | None = opt(None, "One router per loop (true, LOOM) or one per layer.")
    capacity_factor: float | None = opt(None, "MoE capacity factor per micro-batch call; 0 disables dropping.")
    router_z_loss_coef: float | None = opt(None, "Router z-loss coefficient (LOOM as run: 0.0).")
    load_balance_bias_lr: float | None = opt(None, "Aux-loss-free expert-bias step; 0 disables the update.")
    attn_backend: str | None = opt(None, "Attention kernel (same math).", choices=("sdpa", "flex", "flash_attn"))
    moe_impl: str | None = opt(None, "Routed-expert GEMM: grouped (torch._grouped_mm) or a per-expert loop.",
                               choices=("grouped", "loop"))


@dataclass
class Training:
    steps: int = opt(300, "Global steps to train (one global batch each).")
    global_batch_size: int = opt(16, "Rows (sequences of seq_len tokens) per global step, over all ranks.")
    micro_batch_size: int = opt(8, "Rows per micro-batch per data-parallel rank (MoE capacity is per micro-batch).")
    seq_len: int = opt(256, "Tokens per row S; at most the pack's max_seq_len − 1 and the model's max_seq_len.")
    bp_segment_len: int = opt(3, "K loops per backprop segment (seed BP_K); 0 = one segment of all H loops.")
    max_norm: float = opt(1.0, "Gradient clip on the global L2 norm before every optimizer step; ≤ 0 disables.")
    mixed_precision_param: str = opt("bfloat16", "Compute dtype of parameters in forward/backward.",
                                     choices=("bfloat16", "float32"))
    mixed_precision_reduce: str = opt("float32", "Dtype of gradient reductions across ranks.",
                                      choices=("bfloat16", "float32"))
    seed: int = opt(0, "Seed of the layout-independent weight init and of torch RNGs.")
    deterministic: bool = opt(False, "Use deterministic algorithms (slower).")
    device: str = opt("auto", "auto: cuda when available, else cpu.", choices=("auto", "cpu", "cuda"))


@dataclass
class Optimizer:
    name: str = opt("AdamW", "Optimizer (LOOM: AdamW, one parameter group).", choices=("AdamW",))
    lr: float = opt(3e-3, "Peak learning rate.")
    beta1: float = opt(0.9, "AdamW β1.")
    beta2: float = opt(0.95, "AdamW β2.")
    eps: float = opt(1e-8, "AdamW ε.")
    weight_decay: float = opt(0.1, "Decoupled weight decay, on every parameter.")
    implementation: str = opt("foreach", "AdamW kernel.", choices=("foreach", "fused", "for-loop"))


@dataclass
class LRScheduler:
    kind: str = opt("wsd", "Schedule: warmup-stable-decay or warmup + cosine.", choices=("wsd", "cosine"))
    warmup_ratio: float = opt(0.1, "Warmup steps as a fraction of training.steps.")
    decay_ratio: float = opt(0.1, "Final linear-decay steps as a fraction of training.steps (wsd).")
    min_ratio: float = opt(0.1, "Final lr as a fraction of the peak.")


@dataclass
class SpikeGuard:
    enable: bool = opt(True, "Skip a segment's update when its loss spikes (LOOM_SPEC §7.4).")
    delta: float = opt(0.18, "Absolute rise over the segment's EMA that counts as a spike.")
    rel: float = opt(0.06, "Relative rise (× EMA) that counts as a spike; the larger of delta and rel·EMA wins.")
    ratio: float = opt(0.09, "Skip when loss ≥ EMA·(1 + ratio).")
    hard: float = opt(1.5, "Skip when the rise is at least this, whatever the EMA.")
    ema: float = opt(0.9, "EMA decay of the per-segment baseline.")
    warmup_steps: int = opt(0, "Global steps during which only non-finite losses/gradients are skipped.")
    abort_on_spike: bool = opt(True, "Stop after a step with a skipped segment, exit code 2.")


@dataclass
class Data:
    path: str = opt("", "Packed corpus directory; empty = the bundled synthetic corpus (built on first use).")
    val_path: str = opt("", "Separate eval pack (its epoch_0); empty = the holdout epoch of data.path.")
    tokenizer: str = opt("", "If set, the tokenizer name the pack must record ('byte', or the HF name/path); "
                               "checked at start. Empty: not checked.")
    cache_dir: str = opt("", "Where the bundled corpus is built; empty = $TORCHTITAN_LOOM_CACHE or ~/.cache/torchtitan_loom.")


@dataclass
class Eval:
    interval: int = opt(100, "Evaluate every N global steps and at the last step; 0 disables.")
    tokens: int = opt(200_000, "Valid holdout tokens per evaluation (global; LOOM: 1,000,000).")
    batch_size: int = opt(0, "Rows per eval batch over all ranks; 0 = training.global_batch_size.")


@dataclass
class Metrics:
    log_freq: int = opt(10, "Log a console line, metrics.jsonl row and TensorBoard scalars every N steps.")
    enable_tensorboard: bool = opt(True, "Write TensorBoard event files under <dump_folder>/<tb_folder>.")
    tb_folder: str = opt("tb", "TensorBoard sub-folder of job.dump_folder.")
    log_rank: int = opt(0, "The rank that writes logs.")


@dataclass
class Checkpoint:
    enable: bool = opt(False, "Save and resume DCP checkpoints under <dump_folder>/<folder>.", pending=_CKPT)
    folder: str = opt("checkpoint", "Checkpoint sub-folder of job.dump_folder.", pending=_CKPT)
    interval: int = opt(500, "Save every N steps.", pending=_CKPT)
    keep_latest_k: int = opt(2, "Periodic checkpoints kept (0 keeps all).", pending=_CKPT)
    snapshot_interval: int = opt(0, "Immutable snapshot every N steps; 0 disables.", pending=_CKPT)
    snapshot_keep: int = opt(2, "Snapshots kept (0 keeps all).", pending=_CKPT)
    load_step: int = opt(-1, "Resume from this step; -1 = the newest complete checkpoint.", pending=_CKPT)
    initial_load_path: str = opt("", "Model-only warm start from this checkpoint directory.", pending=_CKPT)
    async_mode: str = opt("disabled", "Asynchronous save.", choices=("disabled", "async"), pending=_CKPT)


@dataclass
class Parallelism:
    dp_replicate: int = opt(1, "Replicated data-parallel degree (HSDP outer axis).", pending=_PAR)
    dp_shard: int = opt(-1, "FSDP degree; -1 = every remaining rank. Until FSDP lands, ranks replicate "
                            "the model and all-reduce gradients.")
    ep: int = opt(1, "Expert-parallel degree, carved from dp_shard.", pending=_PAR)
    tp: int = opt(1, "Tensor parallel: not supported.", pending="no issue (unsupported)")
    cp: int = opt(1, "Context parallel: not supported.", pending="no issue (unsupported)")
    pp: int = opt(1, "Pipeline parallel: not supported.", pending="no issue (unsupported)")
    fsdp_reshard_after_forward: str = opt("default", "FSDP2 reshard_after_forward policy.",
                                          choices=("default", "always", "never"), pending=_PAR)
    dry_run: bool = opt(False, "Validate the config and print the layout, then exit.", pending=_PAR)


@dataclass
class ActivationCheckpoint:
    mode: str = opt("none", "Recompute activations per block, per loop or per segment.",
                    choices=("none", "block", "loop", "segment"), pending=_PAR)


@dataclass
class Compile:
    enable: bool = opt(False, "torch.compile each block (one graph serves every loop).", pending=_PAR)


@dataclass
class Float8:
    enable: bool = opt(False, "Float8 training through torchao.", pending=_F8)
    recipe: str = opt("tensorwise", "Scaling recipe.", choices=("tensorwise", "rowwise"), pending=_F8)
    emulate: bool = opt(False, "Emulate float8 (CPU / pre-SM89).", pending=_F8)


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    spike_guard: SpikeGuard = field(default_factory=SpikeGuard)
    data: Data = field(default_factory=Data)
    eval: Eval = field(default_factory=Eval)
    metrics: Metrics = field(default_factory=Metrics)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)

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
    "checkpoint": "DCP checkpoints (issue #6).",
    "parallelism": "Data/expert parallel degrees (issue #5).",
    "activation_checkpoint": "Activation recomputation (issue #5).",
    "compile": "torch.compile (issue #5).",
    "float8": "Float8 training via torchao (issue #7).",
}
