"""The one config schema: a dataclass per TOML section, every field typed, defaulted and documented.

The help text of a field lives in its metadata (``doc``); ``--help`` prints it and nothing else
documents the key. A field may also carry ``choices``: the valid string values, always the tuple
that the implementing module defines (imported below), never a copy. The ``[model]`` keys are the
chosen model's: generated from the args dataclass of its registered TrainSpec (``model_section``),
with that dataclass's own field docs and the spec's choices; no model is imported here.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from dataclasses import dataclass, field
from typing import Any

from torchtitan_loom.components.checkpoint.manager import ASYNC_MODES
from torchtitan_loom.distributed.estimate import LAYOUTS
from torchtitan_loom.components.quantization.float8 import DENSE_RECIPES, EXPERT_RECIPES
from torchtitan_loom.components.optim.lr_scheduler import VALID_KINDS as LR_KINDS
from torchtitan_loom.components.optim.optimizer import OPTIMIZER_NAMES
from torchtitan_loom.components.optim.optimizer import (
    VALID_IMPLEMENTATIONS as OPTIMIZER_IMPLEMENTATIONS,
)
from torchtitan_loom.distributed.activation_checkpoint import AC_MODES
from torchtitan_loom.distributed.utils import (
    COMPILE_BACKENDS,
    DEVICES,
    DTYPES,
    FSDP_SYNC,
    RESHARD_AFTER_FORWARD,
)
from torchtitan_loom.protocols import TrainSpec, get_train_spec


def opt(default: Any, doc: str, *, choices: tuple[str, ...] | None = None):
    """A documented config field (``default`` may be a list; it is copied per instance)."""
    meta = {"doc": doc, "choices": choices}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def attribute_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass (its one documentation)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
        ):
            docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


# Model args that are not [model] keys: the init seed is training.seed (one seed per run).
_NOT_MODEL_KEYS = ("init_seed",)
DEFAULT_MODEL = "loom"


def model_section(spec: TrainSpec) -> type:
    """[model] of ``spec``: name, flavor, then one optional override per field of its args dataclass
    (None keeps the flavor's value)."""
    args_cls = type(next(iter(spec.model_args.values())))
    docs, hints = attribute_docs(args_cls), typing.get_type_hints(args_cls)
    fields = [
        ("name", str, opt(spec.name, "Registered TrainSpec name; the keys below are its model's.")),
        (
            "flavor",
            str,
            opt(
                next(iter(spec.model_args)),
                f"Size preset of the spec ({spec.name}: {', '.join(spec.model_args)}).",
            ),
        ),
    ]
    for f in dataclasses.fields(args_cls):
        if f.name not in _NOT_MODEL_KEYS:
            fields.append(
                (
                    f.name,
                    hints[f.name] | None,
                    opt(None, docs.get(f.name, ""), choices=spec.arg_choices.get(f.name)),
                )
            )
    # Equal by values (each call makes a new class, so the dataclass __eq__'s class check would fail).
    return dataclasses.make_dataclass(
        "Model", fields, eq=False, namespace={"__eq__": _same_section}
    )


def _same_section(a: Any, b: Any) -> bool:
    return (
        type(b).__name__ == "Model"
        and dataclasses.is_dataclass(b)
        and dataclasses.asdict(a) == dataclasses.asdict(b)
    )


def default_model() -> Any:
    """The [model] section of the default model, all keys unset."""
    return model_section(get_train_spec(DEFAULT_MODEL))()


@dataclass
class Job:
    config_file: str = opt("", "TOML file read before the CLI overrides (CLI > TOML > defaults).")
    dump_folder: str = opt(
        "./outputs", "Run directory: metrics.jsonl, tb/, config.toml, checkpoints."
    )
    description: str = opt("", "Free text, printed at start and saved with the resolved config.")
    print_config: bool = opt(False, "Print the resolved config as TOML at start.")
    overwrite: bool = opt(
        False,
        "Start a new run in a dump_folder that holds a different or finished run: "
        "its files move to <dump_folder>/replaced-<run_id>/ first (see run.json).",
    )


@dataclass
class Training:
    steps: int = opt(300, "Global steps to train (one global batch each).")
    global_batch_size: int = opt(
        16, "Rows (sequences of seq_len tokens) per global step, over all ranks."
    )
    micro_batch_size: int = opt(
        8, "Rows per micro-batch per data-parallel rank (MoE capacity is per micro-batch)."
    )
    seq_len: int = opt(
        256, "Tokens per row S; at most the pack's max_seq_len − 1 and the model's max_seq_len."
    )
    bp_segment_len: int = opt(
        3, "K loops per backprop segment (seed BP_K); 0 = one segment of all H loops."
    )
    max_norm: float = opt(
        1.0, "Gradient clip on the global L2 norm before every optimizer step; ≤ 0 disables."
    )
    mixed_precision_param: str = opt(
        "bfloat16", "Compute dtype of parameters in forward/backward.", choices=tuple(DTYPES)
    )
    mixed_precision_reduce: str = opt(
        "float32", "Dtype of gradient reductions across ranks.", choices=tuple(DTYPES)
    )
    seed: int = opt(
        0,
        "Seed of torch RNGs and of the layout-independent weight init (it becomes the "
        "model args' init_seed; the start line prints it).",
    )
    deterministic: bool = opt(False, "Use deterministic algorithms (slower).")
    device: str = opt("auto", "auto: cuda when available, else cpu.", choices=DEVICES)
    gc_freq: int = opt(
        50,
        "Python's automatic GC is off; gc.collect(1) runs after every N-th step on every rank "
        "at once, so no rank stalls at a random step and holds the others up; 0 leaves "
        "Python's GC on.",
    )


@dataclass
class Optimizer:
    name: str = opt(
        "AdamW", "Optimizer (LOOM: AdamW, one parameter group).", choices=OPTIMIZER_NAMES
    )
    lr: float = opt(3e-3, "Peak learning rate.")
    beta1: float = opt(0.9, "AdamW β1.")
    beta2: float = opt(0.95, "AdamW β2.")
    eps: float = opt(1e-8, "AdamW ε.")
    weight_decay: float = opt(0.1, "Decoupled weight decay, on every parameter.")
    implementation: str = opt("foreach", "AdamW kernel.", choices=OPTIMIZER_IMPLEMENTATIONS)


@dataclass
class LRScheduler:
    kind: str = opt("wsd", "Schedule: warmup-stable-decay or warmup + cosine.", choices=LR_KINDS)
    warmup_ratio: float = opt(0.1, "Warmup steps as a fraction of training.steps.")
    decay_ratio: float = opt(0.1, "Final linear-decay steps as a fraction of training.steps (wsd).")
    min_ratio: float = opt(0.1, "Final lr as a fraction of the peak.")


@dataclass
class SpikeGuard:
    enable: bool = opt(True, "Skip a segment's update when its loss spikes (LOOM_SPEC §7.4).")
    delta: float = opt(0.18, "Absolute rise over the segment's EMA that counts as a spike.")
    rel: float = opt(
        0.06, "Relative rise (× EMA) that counts as a spike; the larger of delta and rel·EMA wins."
    )
    ratio: float = opt(0.09, "Skip when loss ≥ EMA·(1 + ratio).")
    hard: float = opt(1.5, "Skip when the rise is at least this, whatever the EMA.")
    ema: float = opt(0.9, "EMA decay of the per-segment baseline.")
    warmup_steps: int = opt(
        0, "Global steps during which only non-finite losses/gradients are skipped."
    )
    abort_on_spike: bool = opt(
        True, "Stop after a step with a skipped segment, exit code 2 (that step is not saved)."
    )
    max_consecutive_skips: int = opt(
        10,
        "With abort_on_spike off: stop (exit 2, SPIKE_ABORT.txt) after this many "
        "skipped steps in a row; 0 = never. A non-finite loss, gradient or weight "
        "at any step always stops the run.",
    )


@dataclass
class Data:
    path: str = opt(
        "", "Packed corpus directory; empty = the bundled synthetic corpus (built on first use)."
    )
    val_path: str = opt(
        "", "Separate eval pack (its epoch_0); empty = the holdout epoch of data.path."
    )
    tokenizer: str = opt(
        "",
        "If set, the tokenizer name the pack must record ('byte', or the HF name/path); "
        "checked at start. Empty: not checked.",
    )
    cache_dir: str = opt(
        "",
        "Where the bundled corpus is built; empty = $TORCHTITAN_LOOM_CACHE or ~/.cache/torchtitan_loom.",
    )


@dataclass
class Eval:
    interval: int = opt(100, "Evaluate every N global steps and at the last step; 0 disables.")
    tokens: int = opt(200_000, "Valid holdout tokens per evaluation (global; LOOM: 1,000,000).")
    batch_size: int = opt(0, "Rows per eval batch over all ranks; 0 = training.global_batch_size.")
    downstream_interval: int = opt(
        0,
        "Score the live model on eval.downstream_tasks every N global steps and at "
        "the last step (the adapter of tools.lm_eval; logged as "
        "downstream/<task>/<metric>); 0 disables.",
    )
    downstream_tasks: list[str] = opt(
        [],
        "lm-eval task names scored every eval.downstream_interval steps "
        "(pip install 'torchtitan_loom[eval]').",
    )
    downstream_tasks_dir: str = opt(
        "", "Extra folder of lm-eval task YAML files (as tools.lm_eval --tasks-dir)."
    )
    downstream_only_tasks_dir: bool = opt(
        False,
        "Index only eval.downstream_tasks_dir, not lm-eval's own task "
        "configs (which take ~30 s to index).",
    )
    downstream_limit: int = opt(0, "At most N documents per downstream task; 0 = all.")
    downstream_batch_size: int = opt(
        8, "Sequences per forward while scoring (scores do not depend on it)."
    )


@dataclass
class Metrics:
    log_freq: int = opt(
        10, "Log a console line, metrics.jsonl row and TensorBoard scalars every N steps."
    )
    enable_tensorboard: bool = opt(
        True, "Write TensorBoard event files under <dump_folder>/<tb_folder>."
    )
    tb_folder: str = opt("tb", "TensorBoard sub-folder of job.dump_folder.")
    log_rank: int = opt(0, "The rank that writes logs.")
    expert_load_every: int = opt(
        0,
        "Add the expert_load list ([layer][loop][expert] kept assignments of the step) "
        "to metrics.jsonl at logged steps that are multiples of N; 0 = at eval "
        "steps only (it is L·H·E numbers per row).",
    )
    routing_images: bool = opt(
        True,
        "At every eval, write TensorBoard images: a loop × expert load heatmap "
        "per layer and the eval loss after each loop, with axes, labels and values.",
    )
    diag_interval: int = opt(
        0,
        "Branch diagnostics every N global steps, from the step's own forward passes "
        "(diag/<branch>/<stat>/layer_<l>/loop_<t>, docs/inside_the_loops.md); "
        "0 disables. The LOOM presets use 50.",
    )
    diag_activations: bool = opt(
        True,
        "At diagnostic steps: each branch output's mean token L2 norm and element "
        "variance per layer and loop.",
    )
    diag_rank: bool = opt(
        True,
        "At diagnostic steps: the rank-collapse trio (effective rank, top singular value "
        "share, mean pairwise cosine) of each branch output on 64 token rows.",
    )
    diag_grad: bool = opt(
        False,
        "At diagnostic steps: each submodule's gradient norm per backprop segment "
        "(diag/grad_norm/<submodule>/segment_<j>).",
    )
    enable_wandb: bool = opt(
        False,
        "Also log the same scalars to Weights & Biases (pip install wandb; project "
        "from $WANDB_PROJECT, default torchtitan_loom; WANDB_MODE=offline writes "
        "under <dump_folder>/wandb without a network).",
    )


@dataclass
class Profiling:
    enable_profiling: bool = opt(
        False,
        "Write torch.profiler traces (Chrome-trace JSON for Perfetto / "
        "chrome://tracing) per rank under <dump_folder>/<save_traces_folder>/"
        "iteration_<step>/.",
    )
    save_traces_folder: str = opt("profile_traces", "Trace sub-folder of job.dump_folder.")
    profile_freq: int = opt(10, "One trace (and one memory snapshot) per this many steps.")
    profiler_warmup: int = opt(
        3, "Steps recorded but discarded before the traced ones, in each window."
    )
    profiler_active: int = opt(1, "Steps kept in each trace; warmup + active ≤ profile_freq.")
    enable_memory_snapshot: bool = opt(
        False,
        "CUDA only: record the allocator history and dump a snapshot "
        "pickle every profile_freq steps (pytorch.org/memory_viz); on CPU "
        "a message says none is written.",
    )
    save_memory_snapshot_folder: str = opt(
        "memory_snapshot", "Memory-snapshot sub-folder of job.dump_folder."
    )


@dataclass
class Checkpoint:
    enable: bool = opt(
        False,
        "Save DCP checkpoints under <dump_folder>/<folder> and resume from the newest "
        "complete one there at start (any world size).",
    )
    folder: str = opt("checkpoint", "Checkpoint sub-folder of job.dump_folder.")
    interval: int = opt(500, "Save step-N/ every N steps (and always at the last step).")
    keep_latest_k: int = opt(
        2,
        "Periodic step-N/ checkpoints kept (0 keeps all); the newest complete one "
        "is never deleted.",
    )
    snapshot_interval: int = opt(
        0, "Also save an immutable snapshots/step-N/ every N steps; 0 disables."
    )
    snapshot_keep: int = opt(2, "Snapshots kept (0 keeps all).")
    load_step: int = opt(
        -1,
        "Resume from this step (a complete step-N/ or snapshots/step-N/ of this run); "
        "-1 = the newest complete checkpoint.",
    )
    initial_load_path: str = opt(
        "",
        "Model-only warm start from this checkpoint directory (or a checkpoint "
        "folder: its newest complete one), used when this run has no checkpoint "
        "yet; optimizer, schedule, data and step start fresh.",
    )
    async_mode: str = opt(
        "disabled",
        "async: stage to CPU memory, then write in a background thread over "
        "its own gloo group while training continues. async_with_pinned_mem: the "
        "same, staging into CPU buffers allocated once and reused by every save "
        "(page-locked on CUDA, copied with non-blocking DMA).",
        choices=ASYNC_MODES,
    )
    save_on_signal: bool = opt(
        True,
        "On SIGTERM, SIGUSR1 or SIGINT (acknowledged at once): stop at the next "
        "micro-batch (of eval, or of a step before its first update; else after "
        "the step), save, exit 0 (130 for SIGINT).",
    )
    exit_after_step: int = opt(
        0,
        "Save and exit 0 after this global step (job chains under a time "
        "limit; the next launch resumes); 0 = off.",
    )


@dataclass
class Parallelism:
    layout: str = opt(
        "degrees",
        "How the degrees are chosen: degrees = dp_replicate, dp_shard and ep as written; auto = at "
        "launch (and in the dry run) the layout of this world size with the shortest estimated step "
        "time that fits in estimate.memory_gib (the dry run's estimate, assumptions under "
        "[estimate]), logged with the runner-up; a degree set to other than its default "
        "(dp_replicate 1, dp_shard -1, ep 1) is kept as given. Re-chosen at every (re)start.",
        choices=LAYOUTS,
    )
    dp_replicate: int = opt(
        1,
        "Replicated data-parallel degree: HSDP's outer axis when dp_shard > 1, plain "
        "replicas (gradients all-reduced) when dp_shard = 1. dp_replicate × dp_shard "
        "= world size.",
    )
    dp_shard: int = opt(
        -1,
        "FSDP2 degree (parameters, gradients and optimizer state sharded over these ranks); "
        "-1 = world size / dp_replicate. 1 = no FSDP.",
    )
    ep: int = opt(
        1,
        "Expert-parallel degree: routed experts split over ep ranks carved from dp_shard (must "
        "divide dp_shard and the routed-expert count); tokens go to their experts' owners.",
    )
    tp: int = opt(1, "Tensor parallel degree: not supported, must be 1.")
    cp: int = opt(1, "Context parallel degree: not supported, must be 1.")
    pp: int = opt(1, "Pipeline parallel degree: not supported, must be 1.")
    fsdp_reshard_after_forward: str = opt(
        "default",
        "Free gathered parameters after forward (always) or keep them until backward (never). "
        "default = never: each block runs K times per forward, so 'always' re-gathers it per loop.",
        choices=tuple(RESHARD_AFTER_FORWARD),
    )
    fsdp_sync: str = opt(
        "segment",
        "When FSDP reduces gradients and frees gathered parameters within a backprop segment: "
        "segment = after its last micro-batch (one all-gather and one reduce-scatter per unit "
        "and segment; each rank holds unsharded fp32 gradients meanwhile), micro_batch = after "
        "every micro-batch's backward (sharded gradients only, traffic × micro-batches).",
        choices=FSDP_SYNC,
    )
    dry_run: bool = opt(
        False,
        "Validate the config, print the mesh layout, batch split, per-rank parameter "
        "shards, and an estimate of per-rank memory, communication per step, FLOPs, "
        "step time and MFU with the fastest layout that fits (hardware assumptions "
        "under [estimate]), then exit 0 without training (one process, fake process "
        "group).",
    )
    dry_run_world_size: int = opt(
        0, "World size the dry run lays out; 0 = the launcher's WORLD_SIZE."
    )


@dataclass
class Estimate:
    peak_tflops: float = opt(
        989.0,
        "Dense bf16 peak TFLOP/s of one GPU, for the dry run's step-time and MFU "
        "estimate (H100 / H200 SXM: 989; B200: 2250; A100: 312).",
    )
    achievable_fraction: float = opt(
        0.6,
        "Fraction of peak_tflops the model's GEMMs reach (0 < f ≤ 1); the "
        "estimated compute time is FLOPs / (peak × fraction).",
    )
    intra_node_gbps: float = opt(
        360.0,
        "Collective bus bandwidth per GPU inside a node in GB/s (NVLink; "
        "H100 / H200: ~360 measured by nccl-tests).",
    )
    inter_node_gbps: float = opt(
        45.0,
        "Collective bus bandwidth per GPU between nodes in GB/s (one 400 Gb/s "
        "InfiniBand NIC per GPU: ~45).",
    )
    gpus_per_node: int = opt(
        8,
        "GPUs per node: a collective whose ranks lie within one node runs at "
        "intra_node_gbps, else at inter_node_gbps.",
    )
    latency_us: float = opt(15.0, "Fixed cost of one collective call in microseconds.")
    memory_gib: float = opt(
        141.0,
        "Memory of one GPU in GiB (H200: 141; H100: 80); the recommended layout must fit in it.",
    )


@dataclass
class ActivationCheckpoint:
    mode: str = opt(
        "none",
        "Recompute activations in backward: per block call (block), per loop (loop) or "
        "per backprop segment of K loops (segment); routing decisions are saved, never "
        "recomputed differently.",
        choices=AC_MODES,
    )


@dataclass
class Compile:
    enable: bool = opt(
        False, "torch.compile each block; one graph serves every loop (no per-loop recompile)."
    )
    backend: str = opt(
        "inductor",
        "torch.compile backend (aot_eager / eager: tracing without code generation, "
        "for debugging).",
        choices=COMPILE_BACKENDS,
    )


@dataclass
class Float8:
    enable: bool = opt(
        False,
        "Float8 training through torchao (components/quantization/float8.py): attention wqkv/wo and "
        "the shared experts become Float8Linear; routers, embedding and output head never "
        "convert. Needs torchao and a CUDA GPU of compute capability 8.9+, or emulate.",
    )
    recipe: str = opt(
        "tensorwise",
        "Scaling of the dense linears: tensorwise (one dynamic scale per tensor; "
        "allows the FSDP float8 all-gather) or rowwise (one per row, power-of-2 "
        "scales; communication stays high precision).",
        choices=DENSE_RECIPES,
    )
    emulate: bool = opt(
        False,
        "Emulate the float8 GEMMs (quantise, then multiply in high precision): required "
        "on CPU and below SM89; for tests, not speed.",
    )
    experts: bool = opt(
        False,
        "Also run the routed experts' grouped GEMMs in low precision "
        "(torchao.prototype.moe_training); each expert's token group is zero-padded to "
        "the kernel's alignment (16 fp8, 32 MXFP8) and the padding dropped after.",
    )
    experts_recipe: str = opt(
        "auto",
        "Routed-expert kernel: fp8_rowwise (SM90, triton), mxfp8 (SM100; emulated "
        "anywhere with emulate); auto = mxfp8 when emulating or on SM100, "
        "fp8_rowwise on SM90.",
        choices=EXPERT_RECIPES,
    )
    enable_fsdp_float8_all_gather: bool = opt(
        False,
        "tensorwise only: FSDP all-gathers the Float8Linear weights "
        "in float8 (half the bytes of bf16); no effect without FSDP.",
    )
    precompute_float8_dynamic_scale_for_fsdp: bool = opt(
        False,
        "With the float8 all-gather: compute every weight's scale after each optimizer step in one "
        "all-reduce, instead of per weight in forward. Applied only when FSDP shards the model.",
    )
    filter_fqns: list[str] = opt(
        [],
        "Module-name substrings whose linears / routed experts stay high precision "
        "(comma-separated), on top of the routers, embedding and head.",
    )


@dataclass
class Comm:
    init_timeout_seconds: int = opt(
        300,
        "Timeout of the process group's collectives from start until the first "
        "training step (rendezvous, init, checkpoint load, compile).",
    )
    train_timeout_seconds: int = opt(
        100,
        "Timeout of every collective once the first step finished (a hung "
        "rank fails the job after this long instead of the init timeout).",
    )


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
