"""Per-section checks of a JobConfig, each returning one line per problem (the key, the value and
what is valid): numbers in range ([optimizer], [lr_scheduler], [spike_guard], [estimate]), the
packs' sequence length and tokenizer size, [float8], [checkpoint], [profiling], and the diagnostics
and downstream-eval keys. validate.py's ``resolve`` runs them all and reports every line at once;
nothing here creates a process group or a tensor of real memory.
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path
from typing import Any

from torchtitan_loom.config.schema import JobConfig
from torchtitan_loom.protocols import get_train_spec


def pack_max_seq_len(path: str, key: str, errors: list[str]) -> int | None:
    meta = os.path.join(path, "metadata.json")
    if not os.path.isdir(path):
        errors.append(
            f"{key}: no such directory '{path}' (a packed corpus; see python -m torchtitan_loom.tools.pack)"
        )
        return None
    if not os.path.lexists(meta):
        errors.append(
            f"{key}: '{path}' has no metadata.json; is it a pack written by torchtitan_loom.tools.pack?"
        )
        return None
    from torchtitan_loom.components.data.pack_format import PackError, read_metadata

    try:  # no link or FIFO followed, its size capped, every field's type and range checked
        return read_metadata(Path(path))["max_seq_len"]
    except PackError as exc:
        errors.append(f"{key}: {exc}")
        return None


def number_errors(cfg: JobConfig) -> list[str]:
    """[optimizer], [lr_scheduler], [spike_guard], training.max_norm: finite and in range (a NaN
    compares false with everything, so every check is written to fail for it)."""
    errors = []

    def need(key: str, value: float, ok: bool, valid: str) -> None:
        if not (math.isfinite(value) and ok):
            errors.append(f"{key} = {value}: {valid}")

    o, s, g = cfg.optimizer, cfg.lr_scheduler, cfg.spike_guard
    need("optimizer.lr", o.lr, o.lr > 0, "must be a finite number > 0")
    need("optimizer.beta1", o.beta1, 0 <= o.beta1 < 1, "must lie in [0, 1)")
    need("optimizer.beta2", o.beta2, 0 <= o.beta2 < 1, "must lie in [0, 1)")
    need("optimizer.eps", o.eps, o.eps > 0, "must be a finite number > 0")
    need(
        "optimizer.weight_decay", o.weight_decay, o.weight_decay >= 0, "must be a finite number ≥ 0"
    )
    need(
        "training.max_norm",
        cfg.training.max_norm,
        True,
        "must be a finite number (≤ 0 disables clipping)",
    )
    for key in ("warmup_ratio", "decay_ratio", "min_ratio"):
        v = getattr(s, key)
        need(f"lr_scheduler.{key}", v, 0 <= v <= 1, "must lie in [0, 1]")
    if s.kind == "wsd" and s.warmup_ratio + s.decay_ratio > 1:
        errors.append(
            f"lr_scheduler.warmup_ratio + decay_ratio = {s.warmup_ratio} + {s.decay_ratio}: must be ≤ 1 "
            f"(warmup and decay would overlap)"
        )
    need("spike_guard.ema", g.ema, 0 <= g.ema < 1, "must lie in [0, 1)")
    need("spike_guard.noise_ema", g.noise_ema, 0 <= g.noise_ema < 1, "must lie in [0, 1)")
    for key in ("delta", "rel", "ratio", "hard", "noise_sigmas"):
        v = getattr(g, key)
        need(
            f"spike_guard.{key}",
            v,
            v >= 0,
            "must be a finite number ≥ 0 (a threshold on the rise of the loss)",
        )
    for key in ("warmup_steps", "max_consecutive_skips"):
        if getattr(g, key) < 0:
            errors.append(f"spike_guard.{key} = {getattr(g, key)}: must be ≥ 0")
    return errors


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def vocab_errors(cfg: JobConfig, args: Any) -> list[str]:
    """model.vocab_size against each pack's tokenizer: the embedding needs a row for every token id.
    The suggestion rounds the tokenizer's size up to a multiple of 256 (LOOM_SPEC §8.2)."""
    errors = []
    from torchtitan_loom.components.data.pack_format import PackError, read_metadata

    for key, path in (("data.path", cfg.data.path), ("data.val_path", cfg.data.val_path)):
        if not path:
            continue
        try:
            tok_vocab = read_metadata(Path(path))["tokenizer_info"]["vocab_size"]
        except (PackError, OSError):
            continue  # a missing or broken pack is reported by pack_max_seq_len / open_pack
        if args.vocab_size < tok_vocab:
            set_by = (
                "model.vocab_size"
                if cfg.model.vocab_size is not None
                else f"the flavor '{cfg.model.flavor}'"
            )
            errors.append(
                f"model.vocab_size = {args.vocab_size} (from {set_by}) is smaller than the tokenizer of "
                f"{key}='{path}' ({tok_vocab:,} ids); set --model.vocab_size "
                f"{_round_up(tok_vocab, 256)} (its size rounded up to a multiple of 256)"
            )
    return errors


def float8_errors(cfg: JobConfig) -> list[str]:
    """[float8]: torchao present, recipes known, the device able to run them (or emulate)."""
    if not cfg.float8.enable:
        return []
    from torchtitan_loom.components.quantization.float8 import float8_problems

    plan, errors = float8_problems(cfg.float8, cfg.training.device)
    if plan is not None and plan.experts_kernel == "mxfp8_emulated" and cfg.compile.enable:
        # Measured (torch 2.13, torchao 0.18, CPU): inductor fails compiling its backward.
        errors.append(
            "compile.enable = true with emulated float8 experts (float8.emulate + float8.experts): "
            "torch.compile fails on torchao's emulated MXFP8 grouped GEMM; set compile.enable = false "
            "or float8.experts = false (emulated dense float8 compiles)"
        )
    return errors


def checkpoint_errors(cfg: JobConfig, args: Any) -> list[str]:
    """[checkpoint]: ranges, keys that need enable, and a checkpoint to load that fits the model."""
    c, errors = cfg.checkpoint, []
    if c.interval < 1:
        errors.append(f"checkpoint.interval = {c.interval}: must be ≥ 1")
    for key in ("keep_latest_k", "snapshot_interval", "snapshot_keep", "exit_after_step"):
        if getattr(c, key) < 0:
            errors.append(f"checkpoint.{key} = {getattr(c, key)}: must be ≥ 0")
    if c.load_step == 0 or c.load_step < -1:
        errors.append(
            f"checkpoint.load_step = {c.load_step}: must be -1 (the newest complete checkpoint) "
            f"or a saved step ≥ 1"
        )
    if not c.folder or os.path.isabs(c.folder):
        errors.append(
            f"checkpoint.folder = {c.folder!r}: must be a non-empty path relative to job.dump_folder"
        )
    if not c.enable:
        for key, default in (("load_step", -1), ("initial_load_path", ""), ("exit_after_step", 0)):
            if getattr(c, key) != default:
                errors.append(
                    f"checkpoint.{key} = {getattr(c, key)!r} needs checkpoint.enable = true"
                )
    if (
        errors or args is None or not c.enable or cfg.job.overwrite
    ):  # overwrite moves the old checkpoints away
        return errors

    def expected_shapes() -> dict[str, tuple[int, ...]]:
        # The configured model on the meta device: shapes without memory or a process group.
        import torch

        with torch.device("meta"):
            model = get_train_spec(cfg.model.name).model_cls(args)
        return {k: tuple(v.shape) for k, v in model.state_dict().items()}

    from torchtitan_loom.components.checkpoint.resolve import config_errors

    return config_errors(cfg, args, expected_shapes)


def estimate_errors(cfg: JobConfig) -> list[str]:
    """[estimate]: every assumption a positive finite number; the GEMM fraction at most 1."""
    e, errors = cfg.estimate, []
    for key in ("peak_tflops", "intra_node_gbps", "inter_node_gbps", "memory_gib"):
        value = getattr(e, key)
        if not (math.isfinite(value) and value > 0):
            errors.append(f"estimate.{key} = {value}: must be a finite number > 0")
    if not (math.isfinite(e.latency_us) and e.latency_us >= 0):
        errors.append(f"estimate.latency_us = {e.latency_us}: must be a finite number ≥ 0")
    if not (math.isfinite(e.achievable_fraction) and 0 < e.achievable_fraction <= 1):
        errors.append(f"estimate.achievable_fraction = {e.achievable_fraction}: must lie in (0, 1]")
    if e.gpus_per_node < 1:
        errors.append(f"estimate.gpus_per_node = {e.gpus_per_node}: must be ≥ 1")
    return errors


def profiling_errors(cfg: JobConfig) -> list[str]:
    from torchtitan_loom.components.observability.profiling import profile_schedule_problems

    p = cfg.profiling
    errors = profile_schedule_problems(p.profile_freq, p.profiler_warmup, p.profiler_active)
    for key in ("save_traces_folder", "save_memory_snapshot_folder"):
        value = getattr(p, key)
        if not value or os.path.isabs(value):
            errors.append(
                f"profiling.{key} = {value!r}: must be a non-empty path relative to job.dump_folder"
            )
    return errors


def diagnostics_errors(cfg: JobConfig) -> list[str]:
    """metrics.diag_* and eval.downstream_* (the task names are looked up only when scoring is on)."""
    m, e = cfg.metrics, cfg.eval
    errors = []
    if m.diag_interval < 0:
        errors.append(
            f"metrics.diag_interval = {m.diag_interval}: must be ≥ 0 (0 = no diagnostics)"
        )
    for key in ("downstream_interval", "downstream_limit"):
        if getattr(e, key) < 0:
            errors.append(
                f"eval.{key} = {getattr(e, key)}: must be ≥ 0 (0 = {'off' if 'interval' in key else 'all'})"
            )
    if e.downstream_batch_size < 1:
        errors.append(f"eval.downstream_batch_size = {e.downstream_batch_size}: must be ≥ 1")
    if e.downstream_interval <= 0 or errors:
        return errors
    if not e.downstream_tasks:
        return [
            "eval.downstream_interval > 0 needs eval.downstream_tasks: lm-eval task names, e.g. "
            "['arc_easy'], or the tasks of eval.downstream_tasks_dir"
        ]
    if e.downstream_tasks_dir and not os.path.isdir(e.downstream_tasks_dir):
        return [f"eval.downstream_tasks_dir = '{e.downstream_tasks_dir}': not a directory"]
    if e.downstream_only_tasks_dir and not e.downstream_tasks_dir:
        return ["eval.downstream_only_tasks_dir = true needs eval.downstream_tasks_dir"]
    if importlib.util.find_spec("lm_eval") is None:
        return [
            "eval.downstream_interval > 0: the lm-eval package is not installed; pip install "
            "'torchtitan_loom[eval]' or set eval.downstream_interval = 0"
        ]
    from torchtitan_loom.components.evaluation.downstream import unknown_tasks

    return [
        f"eval.downstream_tasks: {msg}"
        for msg in unknown_tasks(
            e.downstream_tasks, e.downstream_tasks_dir or None, e.downstream_only_tasks_dir
        )
    ]
