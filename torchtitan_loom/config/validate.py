"""Cross-field checks of a JobConfig, run before any process group or tensor exists, and the one
place that turns a config into what the run is built from: ``resolve(cfg, world_size)`` returns the
model args and the ParallelDims (every degree the trainer, the loaders and the loss divisor read).

Every problem found is reported (one line each) in a single ConfigError, so a user fixes a config
in one round trip. The world size comes from the launcher's environment (torchrun's WORLD_SIZE).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from typing import Any, NamedTuple

from torchtitan_loom.components.runtime.run_folder import relaunch_errors
from torchtitan_loom.config.fields import flavor_problem, overridden_args
from torchtitan_loom.config.gates import gated_problems
from torchtitan_loom.config.io_checks import bundled_errors, folder_errors, pack_errors
from torchtitan_loom.config.manager import INT_MAX, ConfigError, load_config
from torchtitan_loom.config.schema import JobConfig
from torchtitan_loom.config.section_checks import (
    checkpoint_errors,
    diagnostics_errors,
    estimate_errors,
    float8_errors,
    number_errors,
    pack_max_seq_len,
    profiling_errors,
    vocab_errors,
)
from torchtitan_loom.depth_sampling import depth_sampling_errors
from torchtitan_loom.distributed.parallel_dims import ParallelDims
from torchtitan_loom.protocols import get_train_spec


class Resolved(NamedTuple):
    """A checked config's model args and parallel degrees."""

    model_args: Any
    dims: ParallelDims


# Ranges the code can use: collective timeouts (timedelta and the backends' milliseconds overflow
# long before 2^63 s) and the tokens of one batch (kernels index a batch with 32-bit integers).
MAX_TIMEOUT_S = 7 * 24 * 3600
MAX_BATCH_TOKENS = 2**31 - 1


def resolve_model_args(cfg: JobConfig) -> Any:
    """The flavor's args with every non-None [model] override applied, validated."""
    try:
        get_train_spec(cfg.model.name)  # an unknown name is said here, the flavor below
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"model.name: {exc}") from None
    if problem := flavor_problem(cfg.model.name, cfg.model.flavor):
        raise ConfigError(problem)
    args = overridden_args(cfg)
    try:
        args.validate()
    except ValueError as exc:
        raise ConfigError(f"model: {exc}") from None
    return args


def _parallel_dims(
    cfg: JobConfig, world_size: int, args: Any, errors: list[str]
) -> ParallelDims | None:
    """The degrees (ParallelDims checks every divisibility rule, once), or None with the problems
    added; with parallelism.layout = "auto", the fastest layout that keeps the pinned degrees."""
    try:
        spec = get_train_spec(cfg.model.name)
        num_experts = (
            spec.num_experts_fn(args)
            if spec.num_experts_fn is not None and args is not None
            else None
        )
        if cfg.parallelism.layout == "auto" and world_size > 1 and args is not None:
            return _auto_layout(cfg, spec, args, world_size, errors)
        return ParallelDims.from_config(cfg.parallelism, world_size, num_experts=num_experts)
    except ValueError as exc:
        errors.extend(str(exc).splitlines())
        return None


# The degrees "auto" chooses. One given in the config (file or command line) is pinned, whatever
# its value (a degree given at its default is a choice too); dp_shard = -1 means "the rest" and
# stays free.
_FREE_DEGREES = ("dp_replicate", "dp_shard", "ep")


def _auto_layout(
    cfg: JobConfig, spec: Any, args: Any, world_size: int, errors: list[str]
) -> ParallelDims | None:
    from torchtitan_loom.distributed.estimate import choice_line, rank_layouts

    if spec.cost_fn is None:
        errors.append(
            f"parallelism.layout = 'auto': model '{cfg.model.name}' has no cost model "
            f"(TrainSpec.cost_fn) to rank layouts with; set parallelism.layout = 'degrees'"
        )
        return None
    pinned = {
        k: getattr(cfg.parallelism, k)
        for k in _FREE_DEGREES
        if f"parallelism.{k}" in cfg.given and getattr(cfg.parallelism, k) != -1
    }

    def allowed(dims: ParallelDims) -> bool:
        return all(getattr(dims, k) == v for k, v in pinned.items())

    ranked = rank_layouts(cfg, args, world_size, allowed)
    if not ranked:
        given = ", ".join(f"parallelism.{k} = {v}" for k, v in pinned.items()) or "no pinned degree"
        errors.append(
            f"parallelism.layout = 'auto': no valid layout of {world_size} ranks with {given}; "
            f"unpin a degree or set parallelism.layout = 'degrees' to see why"
        )
        return None
    return dataclasses.replace(ranked[0].dims, origin=choice_line(ranked))


def parallelism_errors(cfg: JobConfig, dims: ParallelDims | None, args: Any) -> list[str]:
    """[parallelism] rules beyond the degrees: the dry run keys, and the model's own layout rules
    (its TrainSpec's layout_errors_fn, e.g. how FSDP may split LOOM's expert rows)."""
    par, errors = cfg.parallelism, []
    if par.dry_run_world_size < 0:
        errors.append(
            f"parallelism.dry_run_world_size = {par.dry_run_world_size}: must be ≥ 0 (0 = WORLD_SIZE)"
        )
    if par.dry_run_world_size and not par.dry_run:
        errors.append("parallelism.dry_run_world_size needs parallelism.dry_run = true")
    if errors or args is None or dims is None:
        return errors
    return layout_errors(get_train_spec(cfg.model.name), args, dims)


def layout_errors(spec: Any, args: Any, dims: ParallelDims) -> list[str]:
    """The spec's own rules for this layout (none without a layout_errors_fn)."""
    return [] if spec.layout_errors_fn is None else spec.layout_errors_fn(args, dims)


def _batch_errors(cfg: JobConfig, dims: ParallelDims | None) -> list[str]:
    """The batch rows against the data-parallel ranks (training and eval)."""
    errors: list[str] = []
    t = cfg.training
    if t.global_batch_size == -1:  # TorchTitan's default: local_batch_size × the DP degree
        meant = "micro_batch_size × data-parallel ranks"
        if dims is not None:
            meant = f"{t.micro_batch_size * dims.dp} here ({t.micro_batch_size} × {dims.dp} ranks)"
        errors.append(
            "training.global_batch_size = -1 (TorchTitan: local_batch_size × data-parallel "
            "degree): give the rows per step over all ranks instead; that product is "
            f"{meant}, a multiple of it accumulates gradients over micro-batches"
        )
    if dims is not None:
        dp = dims.dp
        if (
            t.global_batch_size >= 1
            and t.micro_batch_size >= 1
            and t.global_batch_size % (dp * t.micro_batch_size)
        ):
            errors.append(
                f"training.global_batch_size = {t.global_batch_size}: must be divisible by data-parallel "
                f"ranks × micro_batch_size = {dp} × {t.micro_batch_size}"
            )
        eval_rows = cfg.eval.batch_size or t.global_batch_size
        if cfg.eval.batch_size < 0 or (eval_rows >= 1 and eval_rows % dp):
            errors.append(
                f"eval.batch_size = {cfg.eval.batch_size}: must be ≥ 0 and its rows ({eval_rows}) "
                f"divisible by the {dp} data-parallel ranks"
            )
    return errors


def _eval_and_metrics_errors(cfg: JobConfig, world_size: int) -> list[str]:
    """The [eval] schedule and the [metrics] keys."""
    errors: list[str] = []
    if cfg.eval.interval < 0 or cfg.eval.tokens < 1:
        errors.append("eval.interval must be ≥ 0 and eval.tokens ≥ 1")
    if cfg.metrics.log_freq < 1:
        errors.append(f"metrics.log_freq = {cfg.metrics.log_freq}: must be ≥ 1")
    if not 0 <= cfg.metrics.log_rank < world_size:
        errors.append(
            f"metrics.log_rank = {cfg.metrics.log_rank}: must be a rank in [0, {world_size})"
        )
    if cfg.metrics.expert_load_every < 0:
        errors.append(
            f"metrics.expert_load_every = {cfg.metrics.expert_load_every}: must be ≥ 0 (0 = eval steps only)"
        )
    return errors


def _limit_errors(cfg: JobConfig) -> list[str]:
    """The bounds a value must lie in for the code to hold it: gc interval, timeouts, seed, the
    tokens of one batch."""
    errors: list[str] = []
    t = cfg.training
    if t.gc_freq < 0:
        errors.append(f"training.gc_freq = {t.gc_freq}: must be ≥ 0 (0 = Python's automatic GC)")
    for key in ("init_timeout_seconds", "train_timeout_seconds"):
        if not 1 <= getattr(cfg.comm, key) <= MAX_TIMEOUT_S:
            errors.append(
                f"comm.{key} = {getattr(cfg.comm, key)}: must lie in [1, {MAX_TIMEOUT_S}] "
                f"(a week: a hung collective must fail while someone still waits for it)"
            )
    if not 0 <= t.seed <= INT_MAX:
        errors.append(f"training.seed = {t.seed}: must lie in [0, 2^63 - 1]")
    batches: list[tuple[str, int, int]] = [
        ("training.global_batch_size", t.global_batch_size, t.seq_len),
        ("training.micro_batch_size", t.micro_batch_size, t.seq_len),
        ("eval.batch_size", cfg.eval.batch_size, t.seq_len),
        ("eval.downstream_batch_size", cfg.eval.downstream_batch_size, t.seq_len),
    ]
    for key, rows, seq_len in batches:
        if rows * max(seq_len, 1) > MAX_BATCH_TOKENS:
            errors.append(
                f"{key} = {rows}: {rows:,} rows × seq_len {seq_len} tokens is over 2^31 tokens in "
                f"one batch (32-bit indexing in the attention and embedding kernels)"
            )
    return errors


def _pack_length_errors(cfg: JobConfig, args: Any, vocab_ok: bool) -> list[str]:
    """Each pack's record length against training.seq_len, then the pack's own checks when the
    model and its vocabulary are known (one line per problem)."""
    errors: list[str] = []
    t = cfg.training
    for key, path in (("data.path", cfg.data.path), ("data.val_path", cfg.data.val_path)):
        if path:
            max_len = pack_max_seq_len(path, key, errors)
            if max_len is not None and t.seq_len > max_len - 1:
                errors.append(
                    f"training.seq_len = {t.seq_len}: the pack {key}='{path}' holds records of at "
                    f"most {max_len} tokens, so seq_len must be ≤ {max_len - 1} (a record of N "
                    f"tokens holds N - 1 inputs and their next-token targets; a pack for "
                    f"seq_len {t.seq_len} is written with tools.pack --seq-len {t.seq_len + 1})"
                )
            elif max_len is not None and args is not None and vocab_ok:  # one line per problem
                errors += pack_errors(path, key, cfg, args)
    return errors


def resolve(cfg: JobConfig, world_size: int) -> Resolved:
    """Check everything that can be checked up front; return the model args and the parallel degrees."""
    errors: list[str] = []
    t = cfg.training
    for key in ("steps", "global_batch_size", "micro_batch_size", "seq_len"):
        if getattr(t, key) < 1 and not (key == "global_batch_size" and t.global_batch_size == -1):
            errors.append(f"training.{key} = {getattr(t, key)}: must be ≥ 1")
    if t.bp_segment_len < 0:
        errors.append(
            f"training.bp_segment_len = {t.bp_segment_len}: must be ≥ 0 (0 = all loops in one segment)"
        )
    args = None
    try:
        args = resolve_model_args(cfg)
    except ConfigError as exc:
        errors.append(str(exc))
    errors += depth_sampling_errors(t.sample_depth_min, t.sample_depth_max, t.bp_segment_len, args)
    dims = _parallel_dims(cfg, world_size, args, errors)
    errors += _batch_errors(cfg, dims)
    errors += _eval_and_metrics_errors(cfg, world_size)
    errors += profiling_errors(cfg)
    errors += estimate_errors(cfg)
    errors += number_errors(cfg)
    if t.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            errors.append(
                "training.device = 'cuda': no CUDA device is visible; use 'cpu' or 'auto'"
            )
    if args is not None and t.seq_len > args.max_seq_len:
        errors.append(
            f"training.seq_len = {t.seq_len}: the model flavor '{cfg.model.flavor}' supports at most "
            f"max_seq_len = {args.max_seq_len}"
        )
    vocab_problems = vocab_errors(cfg, args) if args is not None else []
    errors += vocab_problems
    if not cfg.parallelism.dry_run:  # the dry run lays out ranks; it reads no data
        errors += _pack_length_errors(cfg, args, vocab_ok=not vocab_problems)
        errors += bundled_errors(cfg)
        errors += folder_errors(cfg)
    spec = get_train_spec(cfg.model.name)
    if (
        args is not None and spec.config_errors_fn is not None
    ):  # the model's own rules (its keys, its layout)
        errors += spec.config_errors_fn(cfg, args, dims)
    errors += wrapper_errors(cfg, spec)
    if cfg.metrics.enable_wandb:
        if importlib.util.find_spec("wandb") is None:
            errors.append(
                "metrics.enable_wandb = true: the wandb package is not installed; "
                "pip install 'torchtitan_loom[wandb]' or set metrics.enable_wandb = false"
            )
    errors += diagnostics_errors(cfg)
    errors += gated_problems(cfg)[0]
    errors += _limit_errors(cfg)
    errors += parallelism_errors(cfg, dims, args)
    errors += float8_errors(cfg)
    # The run folder only once the config is valid (its refusal is no cause of another problem).
    if not errors:
        errors += relaunch_errors(cfg)
    errors += checkpoint_errors(cfg, args if not errors else None)
    if errors:
        raise ConfigError("\n".join(errors))
    assert dims is not None  # a layout that could not be built is one of the errors
    return Resolved(args, dims)


def load_and_resolve(
    argv: list[str], world_size_of: Callable[[JobConfig], int]
) -> tuple[JobConfig, Resolved]:
    """``load_config`` then ``resolve``, every problem of both in one ConfigError: when keys or
    values are bad, the config built from the valid ones is still checked (unknown keys, TorchTitan
    keys without meaning, bad values and flavor errors come out together). ``world_size_of``: the
    world size a config runs at (the launcher's environment, or the dry run's)."""
    try:
        cfg = load_config(argv)
    except ConfigError as exc:
        if exc.partial is None:
            raise
        try:
            resolve(exc.partial, world_size_of(exc.partial))
        except ConfigError as more:
            raise ConfigError(f"{exc}\n{more}") from None
        raise
    return cfg, resolve(cfg, world_size_of(cfg))


def wrapper_errors(cfg: Any, spec: Any) -> list[str]:
    """AC and compile only where the model declares them (TrainSpec.checkpoint_scopes,
    compile_units_fn): the trainer applies them through those, so anything else would be a silent
    no-op."""
    errors = []
    mode, name = cfg.activation_checkpoint.mode, cfg.model.name
    if mode != "none" and mode not in spec.checkpoint_scopes:
        valid = ", ".join(("none", *spec.checkpoint_scopes))
        errors.append(
            f"activation_checkpoint.mode = {mode!r}: model '{name}' declares no such checkpoint "
            f"scope (TrainSpec.checkpoint_scopes); valid for it: {valid}"
        )
    if cfg.compile.enable and spec.compile_units_fn is None:
        errors.append(
            f"compile.enable = true: model '{name}' declares nothing to compile "
            f"(TrainSpec.compile_units_fn); set compile.enable = false"
        )
    return errors
