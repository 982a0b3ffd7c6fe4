"""Config sections of what a run trains and how it reports: [job], [training], [optimizer],
[lr_scheduler], [spike_guard], [data], [eval], [metrics]. Part of the one schema (schema.py
assembles JobConfig); each field is documented once, in its ``opt`` help text.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan_loom.components.optim.choices import LR_KINDS, OPTIMIZER_NAMES, OPTIMIZERS
from torchtitan_loom.components.optim.choices import (
    VALID_IMPLEMENTATIONS as OPTIMIZER_IMPLEMENTATIONS,
)
from torchtitan_loom.config.fields import opt
from torchtitan_loom.distributed.choices import DEVICES, DTYPE_NAMES


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
    sample_depth_min: int = opt(
        0,
        "Depth training: 0 = every step runs all H loops; N ≥ 1 = each step runs only its first "
        "D loops, D drawn uniformly from the backprop segments' last loops that are ≥ N (whole "
        "segments; Huginn's per-step depth sampling), from (training.seed, step), so a resume "
        "draws the same depths (depth_sampling.py). With sample_depth_max, 0 = H.",
    )
    sample_depth_max: int = opt(
        0,
        "Depth past H: 0 = no step runs past the model's H loops; N > H = a step's segments go on "
        "to loop N (loops H+1..N cut into bp_segment_len segments, their routers the 'last' "
        "beyond-H policy: router H) and D is drawn from the segment ends in [sample_depth_min or "
        "H, N], so the loops past H are trained (sample_depth_min = N: every step runs N loops) "
        "(depth_sampling.py).",
    )
    max_norm: float = opt(
        1.0, "Gradient clip on the global L2 norm before every optimizer step; ≤ 0 disables."
    )
    mixed_precision_param: str = opt(
        "bfloat16", "Compute dtype of parameters in forward/backward.", choices=tuple(DTYPE_NAMES)
    )
    mixed_precision_reduce: str = opt(
        "float32", "Dtype of gradient reductions across ranks.", choices=tuple(DTYPE_NAMES)
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
        "AdamW",
        "Optimizer (LOOM: AdamW, one parameter group; Lion: sign updates, one momentum, reads "
        "lr, beta1, beta2, weight_decay: try an lr 3-10x below AdamW's). Part of the run: a "
        "resume under another optimizer is refused.",
        choices=OPTIMIZER_NAMES,
    )
    lr: float = opt(3e-3, "Peak learning rate.")
    beta1: float = opt(0.9, "AdamW β1 (Lion: the momentum's weight in the update's sign).")
    beta2: float = opt(0.95, "AdamW β2 (Lion: the momentum's decay).")
    eps: float = opt(1e-8, "AdamW ε (Lion has none).")
    weight_decay: float = opt(0.1, "Decoupled weight decay, on every parameter.")
    implementation: str = opt("foreach", "AdamW kernel.", choices=OPTIMIZER_IMPLEMENTATIONS)

    # The optimizer table's figures for the chosen one (components/optim/choices.py), for readers
    # below the components layer (the dry run's estimate); not config keys.
    @property
    def state_bytes_per_param(self) -> int:
        return OPTIMIZERS[self.name].state_bytes_per_param

    @property
    def state_label(self) -> str:
        return OPTIMIZERS[self.name].state_label


@dataclass
class LRScheduler:
    kind: str = opt("wsd", "Schedule: warmup-stable-decay or warmup + cosine.", choices=LR_KINDS)
    warmup_ratio: float = opt(
        0.1,
        "Warmup as a fraction of training.steps: W = max(1, round(steps · ratio)); step s < W runs "
        "at s / W of the peak (W = 1: no warmup).",
    )
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
    noise_sigmas: float = opt(
        4.0,
        "k: the ratio and adaptive rules skip only a rise of at least k·σ, σ the segment loss's "
        "own batch-to-batch noise (from the squared change between consecutive accepted "
        "losses); 0 = the spec's fixed thresholds alone. The hard rule ignores the noise.",
    )
    noise_ema: float = opt(0.99, "EMA decay of the squared change that measures σ.")
    warmup_steps: int = opt(
        0,
        "Global steps during which no spike is skipped (a non-finite loss or gradient still "
        "stops the run; a warm-up step that breaks a spike rule proves no checkpoint).",
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
