"""The LOOM model package: flavors (spec §1.1) and the "loom" TrainSpec."""

import torch

from torchtitan_loom.models.loom.args import FIELD_CHOICES, LoomModelArgs
from torchtitan_loom.models.loom.attention import resolve_attn_backend
from torchtitan_loom.models.loom.infra.cost import loom_cost
from torchtitan_loom.models.loom.infra.checks import config_errors, layout_errors
from torchtitan_loom.models.loom.infra.parallelize import parallelize_loom
from torchtitan_loom.models.loom.model import LoomTransformer
from torchtitan_loom.models.loom.float8_experts import convert_float8_experts
from torchtitan_loom.models.loom.moe import moe_gemm_fallbacks
from torchtitan_loom.models.loom.target import flash_attn_available
from torchtitan_loom.protocols import Sharding, TrainSpec, register_train_spec

_LOOM_SIZES = dict(vocab_size=49152, num_loops=9, max_seq_len=1023)

loom_flavors = {
    # Tiny and CPU-fast: head_dim 64, 8 routed + 2 shared experts, 2 routed per token.
    "debug": LoomModelArgs(
        vocab_size=512,
        dim=128,
        n_layers=2,
        n_heads=2,
        n_kv_heads=1,
        num_loops=3,
        max_seq_len=256,
        num_routed_experts=8,
        num_shared_experts=2,
        top_k=4,
        expert_intermediate_size=128,
    ),
    # T_moe_L10: 313,863,168 parameters at H = 9.
    "loom_329m": LoomModelArgs(
        dim=512, n_layers=10, n_heads=8, n_kv_heads=4, expert_intermediate_size=512, **_LOOM_SIZES
    ),
    # T_moe_L15_E32: 1,644,913,920 parameters at H = 9.
    "loom_1p7b": LoomModelArgs(
        dim=1280,
        n_layers=15,
        n_heads=20,
        n_kv_heads=10,
        expert_intermediate_size=768,
        **_LOOM_SIZES,
    ),
}

for _args in loom_flavors.values():
    _args.validate()


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
        kernel_report_fn=kernel_report,
        arg_choices=FIELD_CHOICES,
        # Same math, or tunables a user may adjust mid-run.
        relaunch_tunable=(
            "attn_backend",
            "moe_impl",
            "capacity_factor",
            "load_balance_bias_lr",
            "router_z_loss_coef",
        ),
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
    ),
)

__all__ = ["LoomModelArgs", "LoomTransformer", "loom_flavors", "parallelize_loom"]
