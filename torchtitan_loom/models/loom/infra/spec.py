"""The "loom" TrainSpec: the model, its flavors, parallelize function, checks, costs and the tools'
hooks, registered under "loom" when this module is imported (protocols.get_train_spec does that
on the first lookup; models/__init__.py names this module)."""

from typing import cast

import torch
from torch import nn

from torchtitan_loom.models.loom.args import (
    FIELD_CHOICES,
    RELAUNCH_TUNABLE,
    LoomModelArgs,
    loom_flavors,
)
from torchtitan_loom.models.loom.attention import resolve_attn_backend
from torchtitan_loom.models.loom.float8_experts import convert_float8_experts
from torchtitan_loom.models.loom.infra.checks import config_errors, layout_errors
from torchtitan_loom.models.loom.infra.cost import loom_cost
from torchtitan_loom.models.loom.infra.hf_source import loom_hf_export
from torchtitan_loom.models.loom.infra.parallelize import parallelize_loom
from torchtitan_loom.models.loom.model import LoomTransformer
from torchtitan_loom.models.loom.moe import moe_gemm_fallbacks
from torchtitan_loom.models.loom.target import flash_attn_available
from torchtitan_loom.protocols import Sharding, TrainSpec, register_train_spec


def kernel_report(
    model: LoomTransformer, device_type: str, dtype: torch.dtype, compiling: bool
) -> list[str]:
    """The attention backend "auto" resolves to here, and every layer whose routed experts fall back
    to the per-expert loop (a pure function of static inputs, so said once at start)."""
    requested = model.args.attn_backend
    chosen = resolve_attn_backend(requested, device_type, dtype, flash_attn_available())
    return [
        f"attention backend: {chosen} (attn_backend={requested})",
        *moe_gemm_fallbacks(model.moe_layers(), device_type, dtype, compiling),
    ]


def portable_args(args: LoomModelArgs, decoding: bool) -> LoomModelArgs:
    """sdpa attention everywhere; decoding also turns capacity dropping off (with capacity on, a
    token's experts depend on the call size)."""
    return args.replace(attn_backend="sdpa", **({"capacity_factor": 0} if decoding else {}))


register_train_spec(
    "loom",
    TrainSpec(
        name="loom",
        model_cls=LoomTransformer,
        model_args=loom_flavors,
        parallelize_fn=parallelize_loom,
        checkpoint_scopes=("block", "loop", "segment"),  # model.py's _region scopes
        # One compiled graph per block serves every loop: the loop-dependent inputs (router weight,
        # gamma, memories) are tensors; at most 3 variants (requires_grad of the fresh memories).
        compile_units_fn=lambda model: list(cast(nn.ModuleList, model.layers)),
        kernel_report_fn=kernel_report,
        arg_choices=FIELD_CHOICES,
        relaunch_tunable=RELAUNCH_TUNABLE,
        config_errors_fn=config_errors,
        layout_errors_fn=layout_errors,
        num_experts_fn=lambda args: args.num_routed_experts,
        sharding=Sharding(repeated_unit=r"^layers\.(\d+)\.", unit_name="layer"),
        cost_fn=loom_cost,
        # LOOM_SPEC §14: the per-loop routers (Parameters, listed so the rule is explicit), the embedding, the head.
        float8_never_convert=("routers", "tok_embeddings", "output"),
        float8_experts_fn=convert_float8_experts,
        # The expert bias decides routing: the inference tools keep it fp32 in a bf16 model.
        inference_fp32_fn=lambda name: name.endswith(".expert_bias"),
        portable_args_fn=portable_args,
        hf_export_fn=loom_hf_export,
    ),
)
