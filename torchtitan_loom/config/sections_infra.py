"""Config sections of how a run executes: [profiling], [checkpoint], [parallelism], [estimate],
[activation_checkpoint], [compile], [float8], [comm]. Part of the one schema (schema.py assembles
JobConfig); each field is documented once, in its ``opt`` help text, and ``choices`` are the tuples
of the implementing modules.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan_loom.components.checkpoint.modes import ASYNC_MODES, DEFAULT_FOLDER
from torchtitan_loom.components.quantization.recipes import DENSE_RECIPES, EXPERT_RECIPES
from torchtitan_loom.config.fields import opt
from torchtitan_loom.distributed.choices import (
    AC_MODES,
    COMPILE_BACKENDS,
    FSDP_SYNC,
    LAYOUTS,
    RESHARD_AFTER_FORWARD,
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
    folder: str = opt(DEFAULT_FOLDER, "Checkpoint sub-folder of job.dump_folder.")
    interval: int = opt(500, "Save step-N/ every N steps (and always at the last step).")
    keep_latest_k: int = opt(
        2,
        "Periodic step-N/ checkpoints kept up to the newest one followed by 2 healthy steps "
        "(0 keeps all); every newer one, and the newest complete one, is never deleted.",
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
        "On SIGTERM, SIGUSR1 or SIGINT (acknowledged at once): stop at the next eval "
        "micro-batch, or after the step in progress (dropped when its first update has not "
        "happened yet), save, exit 0 (130 for SIGINT).",
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
        "per backprop segment of K loops (segment), where the model declares the scope (LOOM: "
        "all three); routing decisions are saved, never recomputed differently.",
        choices=AC_MODES,
    )


@dataclass
class Compile:
    enable: bool = opt(
        False,
        "torch.compile the modules the model declares (LOOM: each block; one graph serves "
        "every loop, no per-loop recompile).",
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
