"""TorchTitan v0.2.2 spellings: the one table of keys that mean the same here under another name.

A TorchTitan user's TOML and command line keep working: ``--parallelism.data_parallel_shard_degree 4``
sets ``parallelism.dp_shard``. ``--help`` prints the alias next to our key; the resolved
``config.toml`` always writes our (canonical) name. A value that needs translating is translated
here and nowhere else:

- ``activation_checkpoint.mode full`` is ``block`` (the whole block recomputed in backward);
  ``selective`` (TorchTitan's per-op / every-N-layer SAC) has no counterpart and is refused.
- ``lr_scheduler.warmup_steps N`` becomes ``warmup_ratio = N / training.steps`` once every source is
  read (the ratio is the one source of truth: the LOOM presets state warmup as a fraction, and a
  run whose ``training.steps`` changes keeps the same schedule shape; ``lr_scale`` rounds
  ``steps × ratio`` back to exactly N). Setting both is refused.
- ``lr_scheduler.decay_type linear`` is our ``kind = wsd``; its sqrt / cosine decay phases are not
  implemented (our ``kind = cosine`` is warmup + one cosine over every remaining step).

Keys with no meaning here are refused with one line saying what to use instead (``NO_MEANING``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Alias:
    key: str
    """Our dotted key."""
    values: dict[str, str] | None = None
    """TorchTitan value → ours; a value not listed passes through unchanged unless ``refuse`` lists it."""
    refuse: dict[str, str] | None = None
    """TorchTitan values with no counterpart → what to use instead."""
    per_training_step: bool = False
    """The value is a step count turned into a fraction of training.steps after loading."""


ALIASES: dict[str, Alias] = {
    "parallelism.data_parallel_shard_degree": Alias("parallelism.dp_shard"),
    "parallelism.data_parallel_replicate_degree": Alias("parallelism.dp_replicate"),
    "parallelism.expert_parallel_degree": Alias("parallelism.ep"),
    "parallelism.tensor_parallel_degree": Alias("parallelism.tp"),
    "parallelism.context_parallel_degree": Alias("parallelism.cp"),
    "parallelism.pipeline_parallel_degree": Alias("parallelism.pp"),
    "training.local_batch_size": Alias("training.micro_batch_size"),
    "debug.seed": Alias("training.seed"),
    "debug.deterministic": Alias("training.deterministic"),
    "metrics.save_tb_folder": Alias("metrics.tb_folder"),
    "validation.freq": Alias("eval.interval"),
    "lr_scheduler.warmup_steps": Alias("lr_scheduler.warmup_ratio", per_training_step=True),
    "lr_scheduler.min_lr_factor": Alias("lr_scheduler.min_ratio"),
    "lr_scheduler.decay_type": Alias(
        "lr_scheduler.kind",
        values={"linear": "wsd"},
        refuse={
            v: "lr_scheduler.kind = wsd (linear decay over decay_ratio) or cosine (warmup + one cosine "
            "over every remaining step)"
            for v in ("sqrt", "cosine")
        },
    ),
    "activation_checkpoint.mode": Alias(
        "activation_checkpoint.mode",
        values={"full": "block"},
        refuse={
            "selective": "activation_checkpoint.mode = block (TorchTitan's full), loop or segment",
            "memory_budget": "activation_checkpoint.mode = block (TorchTitan's full), loop or segment",
        },
    ),
    "quantize.linear.float8.enable_fsdp_float8_all_gather": Alias(
        "float8.enable_fsdp_float8_all_gather"
    ),
    "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp": Alias(
        "float8.precompute_float8_dynamic_scale_for_fsdp"
    ),
    "quantize.linear.float8.recipe_name": Alias("float8.recipe"),
    "quantize.linear.float8.filter_fqns": Alias("float8.filter_fqns"),
    "quantize.linear.float8.emulate": Alias("float8.emulate"),
}

# TorchTitan keys that mean nothing here → what to use instead (one line each).
NO_MEANING: dict[str, str] = {
    "model.converters": "set float8.enable = true (and float8.experts for the routed experts) instead of "
    'converters = ["float8"]',
    "model.hf_assets_path": "the tokenizer is fixed when packing (python -m torchtitan_loom.tools.pack "
    "--tokenizer ...); data.tokenizer checks the pack's",
    "model.tokenizer_path": "the tokenizer is fixed when packing (python -m torchtitan_loom.tools.pack "
    "--tokenizer ...); data.tokenizer checks the pack's",
    "training.dataset": "pack the corpus (python -m torchtitan_loom.tools.pack --hf-dataset NAME ...) and "
    "set data.path; empty data.path = the bundled corpus",
    "training.dataset_path": "pack it with python -m torchtitan_loom.tools.pack and set data.path",
    "parallelism.enable_async_tensor_parallel": "there is no tensor parallelism; scale with parallelism.dp_shard "
    "(FSDP), dp_replicate and ep",
    "parallelism.pipeline_parallel_schedule": "there is no pipeline parallelism; scale with parallelism.dp_shard "
    "(FSDP), dp_replicate and ep",
    "parallelism.expert_tensor_parallel_degree": "experts are split whole over parallelism.ep ranks; no expert "
    "tensor parallelism",
    "activation_checkpoint.selective_ac_option": "activation_checkpoint.mode = block, loop or segment",
    "compile.components": "compile.enable compiles every block (the loss is not compiled separately)",
    "metrics.disable_color_printing": "console lines are plain text (no colors to disable)",
    "metrics.save_for_all_ranks": "metrics.log_rank picks the one rank that writes metrics",
    "validation.enable": "held-out evaluation runs every eval.interval steps (validation.freq); 0 disables it",
    "checkpoint.last_save_model_only": "python -m torchtitan_loom.tools.export writes a model-only copy",
    "checkpoint.export_dtype": "python -m torchtitan_loom.tools.export writes a model-only copy",
}

# The parallel degrees we do not implement: only 1 is accepted (a larger one gets this line).
_ONLY_ONE = {"parallelism.tp": "tensor", "parallelism.cp": "context", "parallelism.pp": "pipeline"}


class AliasError(ValueError):
    """A TorchTitan key or value without a counterpart here (one line)."""


def aliases_of(key: str) -> list[str]:
    """The TorchTitan spellings of our dotted ``key`` (for --help)."""
    return [tt for tt, a in ALIASES.items() if a.key == key and tt != key]


def translate(dotted: str, value: Any) -> tuple[str, Any, bool]:
    """(our key, our value, per_training_step) for a dotted key as written; unknown keys pass through."""
    if dotted in NO_MEANING:
        raise AliasError(f"{dotted} (TorchTitan) has no meaning here: {NO_MEANING[dotted]}")
    alias = ALIASES.get(dotted)
    if alias is None:
        return dotted, value, False
    if isinstance(value, str):
        if alias.refuse and value in alias.refuse:
            raise AliasError(
                f"{dotted} = {value!r} (TorchTitan) has no counterpart here; use {alias.refuse[value]}"
            )
        if alias.values:
            value = alias.values.get(value, value)
    if alias.key in _ONLY_ONE and dotted != alias.key and str(value).strip() not in ("1",):
        what = _ONLY_ONE[alias.key]
        raise AliasError(
            f"{dotted} = {value}: {what} parallelism is not implemented here; leave it at 1 and "
            f"scale with parallelism.data_parallel_shard_degree (FSDP), "
            f"data_parallel_replicate_degree and expert_parallel_degree"
        )
    return alias.key, value, alias.per_training_step
