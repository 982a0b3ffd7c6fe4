"""Float8 training through torchao: a model converter run on the meta model before parallelize.

What converts (LOOM_SPEC §14: float8 changes precision, never the math or the parameter names):
  - dense linears: attention `wqkv` / `wo` and the shared experts' `w13` / `w2` become torchao
    `Float8Linear` (recipe tensorwise or rowwise). The routers, `tok_embeddings` and the `output`
    head never convert; a linear whose weight dims are not multiples of 16 is skipped and named.
  - routed experts (`float8.experts`): the converter picks the grouped-GEMM kernel (fp8 rowwise on
    SM90, MXFP8 on SM100, MXFP8 emulated on any device; components/quantization/grouped_gemm.py)
    and hands it to the model's TrainSpec.float8_experts_fn, which swaps its experts for modules
    that compute with it (LOOM: models/loom/float8_experts.py). This file knows no expert layout.

Which kernels a device can run is decided up front by `float8_problems` (called from
config/section_checks.py), so a bad request fails before any tensor exists. torchao is imported only
inside `Float8Converter.convert` / the experts module, so the package works without it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchtitan_loom.components.quantization.recipes import DENSE_RECIPES, EXPERT_RECIPES

DIM_MULTIPLE = 16  # float8 GEMMs need both weight dims divisible by 16
# torch._scaled_mm also needs its inner dim divisible by 16; in the weight-gradient GEMM
# (grad_out^T @ x) that dim is the token count of a micro-batch (8 x 1023 = 8184 in loom_1p7b).
TOKEN_MULTIPLE = 16
# Token-group alignment (rows) of each grouped-GEMM kernel, and the weight-dim multiple it needs
# (MXFP8 scales blocks of 32 along the reduction dim).
EXPERT_ALIGNMENT = {"fp8_rowwise": 16, "mxfp8": 32, "mxfp8_emulated": 32}
EXPERT_DIM_MULTIPLE = {"fp8_rowwise": 16, "mxfp8": 32, "mxfp8_emulated": 32}
TORCHAO_HINT = "pip install torchao==0.18.0"


@dataclass(frozen=True)
class Float8Plan:
    """What the converter does, resolved from the [float8] section and the device."""

    recipe: str
    emulate: bool
    experts_kernel: str | None
    """None (experts stay high precision), 'fp8_rowwise', 'mxfp8' or 'mxfp8_emulated'."""
    fsdp_float8_all_gather: bool
    precompute_scale: bool
    filter_fqns: tuple[str, ...] = ()

    @property
    def expert_alignment(self) -> int | None:
        return EXPERT_ALIGNMENT.get(self.experts_kernel) if self.experts_kernel else None


# ----------------------------------------------------------------------------- device checks
def resolve_device(requested: str) -> tuple[str, tuple[int, int] | None, str]:
    """(device type, CUDA capability or None, device name) of `training.device`."""
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            return "cuda", None, "no CUDA device"
        return "cuda", torch.cuda.get_device_capability(), torch.cuda.get_device_name()
    return "cpu", None, "cpu"


def _experts_kernel(
    f8: Any, device: str, cap: tuple[int, int] | None, name: str
) -> tuple[str | None, list[str]]:
    """The grouped-GEMM kernel for the routed experts, or the reasons none fits."""
    if not f8.experts:
        return None, []
    where = f"{name} (SM{cap[0]}{cap[1]})" if cap else name
    recipe = f8.experts_recipe
    if f8.emulate:
        if recipe == "fp8_rowwise":
            return None, [
                "float8.experts_recipe = 'fp8_rowwise' has no emulated kernel in torchao; with "
                "float8.emulate = true use experts_recipe 'mxfp8' or 'auto' (MXFP8 emulated)"
            ]
        return "mxfp8_emulated", []
    if device != "cuda" or cap is None:
        return None, []  # the dense check already reports the missing GPU
    if recipe == "auto":
        recipe = {9: "fp8_rowwise", 10: "mxfp8"}.get(cap[0], "")
        if not recipe:
            return None, [
                f"float8.experts: {where} has no float8 grouped GEMM (fp8_rowwise needs SM90, mxfp8 "
                f"needs SM100); set float8.experts = false (dense linears only) or float8.emulate = true"
            ]
    if recipe == "fp8_rowwise":
        if cap[0] != 9:
            return None, [
                f"float8.experts_recipe = 'fp8_rowwise' needs an SM90 GPU (H100/H200), got {where}; "
                f"use 'mxfp8' on SM100, or float8.experts = false"
            ]
        if importlib.util.find_spec("triton") is None:
            return None, [
                "float8.experts_recipe = 'fp8_rowwise' needs triton (its quantisation kernels); install "
                "the triton that matches your torch, or set float8.experts = false"
            ]
        return "fp8_rowwise", []
    if cap[0] != 10:
        return None, [
            f"float8.experts_recipe = 'mxfp8' needs an SM100 GPU (B200/GB200), got {where}; use "
            f"'fp8_rowwise' on SM90, float8.emulate = true, or float8.experts = false"
        ]
    return "mxfp8", []


def float8_problems(f8: Any, requested_device: str) -> tuple[Float8Plan | None, list[str]]:
    """Check the [float8] section against `training.device`; (plan, []) when it can run, else
    (None, errors). `f8` is the config's Float8 section. Nothing here imports torchao."""
    if not f8.enable:
        return None, []
    return plan_float8(f8, *resolve_device(requested_device))


def plan_float8(
    f8: Any, device: str, cap: tuple[int, int] | None, name: str
) -> tuple[Float8Plan | None, list[str]]:
    """`float8_problems` for a given device type, CUDA capability and device name."""
    errors: list[str] = []
    if f8.recipe not in DENSE_RECIPES:
        errors.append(
            f"float8.recipe = {f8.recipe!r}: valid recipes are {', '.join(DENSE_RECIPES)}"
        )
    if f8.experts_recipe not in EXPERT_RECIPES:
        errors.append(
            f"float8.experts_recipe = {f8.experts_recipe!r}: valid: {', '.join(EXPERT_RECIPES)}"
        )
    if not f8.emulate:
        if device == "cpu":
            errors.append(
                "float8.enable = true on CPU needs float8.emulate = true: real float8 training needs a "
                "CUDA GPU with compute capability 8.9+ (SM89: L4/L40S/H100/H200/B200)"
            )
        elif cap is not None and cap < (8, 9):
            errors.append(
                f"float8.enable = true needs a GPU with compute capability 8.9+ (SM89), got {name} "
                f"(SM{cap[0]}{cap[1]}); set float8.emulate = true to emulate (slow, for tests)"
            )
    kernel, expert_errors = _experts_kernel(f8, device, cap, name)
    errors += expert_errors
    if f8.enable_fsdp_float8_all_gather and f8.recipe != "tensorwise":
        errors.append(
            f"float8.enable_fsdp_float8_all_gather = true needs float8.recipe = 'tensorwise' "
            f"(got {f8.recipe!r}); rowwise communicates in high precision"
        )
    if f8.precompute_float8_dynamic_scale_for_fsdp and not f8.enable_fsdp_float8_all_gather:
        errors.append(
            "float8.precompute_float8_dynamic_scale_for_fsdp = true needs "
            "float8.enable_fsdp_float8_all_gather = true (it precomputes that all-gather's scales)"
        )
    if importlib.util.find_spec("torchao") is None:
        errors.append(
            f"float8.enable = true needs torchao, which is not installed ({TORCHAO_HINT})"
        )
    if errors:
        return None, errors
    return Float8Plan(
        recipe=f8.recipe,
        emulate=f8.emulate,
        experts_kernel=kernel,
        fsdp_float8_all_gather=f8.enable_fsdp_float8_all_gather,
        precompute_scale=f8.precompute_float8_dynamic_scale_for_fsdp,
        filter_fqns=tuple(f8.filter_fqns),
    ), []


# ----------------------------------------------------------------------------- module selection
@dataclass
class Float8Report:
    """What a conversion touched: module names, and the skipped ones with the reason."""

    dense: list[str] = field(default_factory=list)
    padded_tokens: int | None = None
    """The micro-batch token count when it is not a multiple of TOKEN_MULTIPLE (so padded)."""
    experts: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    never_convert: tuple[str, ...] = ()
    """The model's module-name segments that are never converted (its TrainSpec says which)."""

    def summary(self, plan: Float8Plan) -> str:
        mode = ", emulated" if plan.emulate else ""
        text = f"float8: {len(self.dense)} linears -> Float8Linear ({plan.recipe}{mode})"
        if self.padded_tokens is not None:
            text += (
                f" with the token dim padded to a multiple of {TOKEN_MULTIPLE} "
                f"({self.padded_tokens} tokens per micro-batch)"
            )
        if plan.experts_kernel:
            text += (
                f"; {len(self.experts)} routed-expert modules -> {plan.experts_kernel} grouped GEMM "
                f"(groups padded to {plan.expert_alignment} rows)"
            )
        if plan.fsdp_float8_all_gather:
            text += "; FSDP float8 all-gather" + (
                " + scale precompute" if plan.precompute_scale else ""
            )
        other = {k: v for k, v in self.skipped.items() if not v.startswith("never")}
        if self.never_convert:
            text += f"; never converted: {', '.join(self.never_convert)}"
        if other:
            text += "; SKIPPED " + "; ".join(f"{k} ({v})" for k, v in other.items())
        return text


def select_dense(
    model: nn.Module, never_convert: tuple[str, ...], filter_fqns: tuple[str, ...] = ()
) -> tuple[list[str], dict[str, str]]:
    """(names of the nn.Linear modules to convert, {skipped name: reason}) — no torchao needed.
    ``never_convert``: module-name segments the model's TrainSpec keeps in high precision."""
    chosen, skipped = [], {}
    for fqn, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        out_f, in_f = mod.weight.shape
        if any(seg in never_convert for seg in fqn.split(".")):
            skipped[fqn] = f"never converted ({', '.join(never_convert)})"
        elif any(f in fqn for f in filter_fqns):
            skipped[fqn] = "matches float8.filter_fqns"
        elif out_f % DIM_MULTIPLE or in_f % DIM_MULTIPLE:
            skipped[fqn] = f"weight [{out_f}, {in_f}] not multiples of {DIM_MULTIPLE}"
        else:
            chosen.append(fqn)
    return chosen, skipped


# ----------------------------------------------------------------------------- the converter
class Float8Converter:
    """Swaps modules in place (on the meta model, before parallelize); parameter names unchanged.

    ``tokens_per_micro_batch`` (micro-batch rows x seq_len: what every converted linear sees on
    every layout, as there is no tensor or context parallelism): when it is not a multiple of
    TOKEN_MULTIPLE, torchao pads the inner dim of each float8 GEMM with zeros (``pad_inner_dim``;
    zeros add nothing, so results are unchanged). Off otherwise: the pad copies every operand,
    even where it adds no row (docs/gpu_and_float8.md, "Token counts").
    """

    def __init__(
        self,
        plan: Float8Plan,
        never_convert: tuple[str, ...] = (),
        experts_fn: Any = None,
        tokens_per_micro_batch: int | None = None,
    ):
        """``experts_fn``: the model's TrainSpec.float8_experts_fn (None: no routed experts)."""
        self.plan, self.never_convert, self.experts_fn = plan, tuple(never_convert), experts_fn
        self.pad_tokens = bool(tokens_per_micro_batch and tokens_per_micro_batch % TOKEN_MULTIPLE)
        self.tokens_per_micro_batch = tokens_per_micro_batch

    def convert(self, model: nn.Module) -> Float8Report:
        """Convert `model` in place; returns what was converted and what was skipped (and why)."""
        from torchtitan_loom.components.quantization.quiet_import import quiet_torchao_import

        with quiet_torchao_import():
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        plan = self.plan
        report = Float8Report(
            never_convert=self.never_convert,
            padded_tokens=self.tokens_per_micro_batch if self.pad_tokens else None,
        )
        report.dense, report.skipped = select_dense(model, self.never_convert, plan.filter_fqns)
        config = dataclasses.replace(
            Float8LinearConfig.from_recipe_name(plan.recipe),
            emulate=plan.emulate,
            enable_fsdp_float8_all_gather=plan.fsdp_float8_all_gather,
            pad_inner_dim=self.pad_tokens,
        )
        chosen = set(report.dense)
        convert_to_float8_training(
            model, config=config, module_filter_fn=lambda mod, fqn: fqn in chosen
        )
        # The routed experts after the dense linears: the model swaps them for modules that run
        # the kernel on its own weight layout (the dense pass never sees them).
        if plan.experts_kernel is not None and self.experts_fn is not None:
            experts, skipped_experts = self.experts_fn(
                model, self.grouped_kernel(), plan.filter_fqns
            )
            report.experts = experts
            report.skipped.update(skipped_experts)
        return report

    def grouped_kernel(self, gemm: Any = None) -> Any:
        """The plan's routed-expert kernel as a protocols.GroupedKernel (torchao's, or ``gemm``)."""
        from torchtitan_loom.components.quantization.grouped_gemm import grouped_kernel

        k = self.plan.experts_kernel
        assert k is not None, "the plan converts no routed experts"
        return grouped_kernel(k, EXPERT_ALIGNMENT[k], EXPERT_DIM_MULTIPLE[k], gemm)

    def precompute_applies(self, model: nn.Module) -> bool:
        """True when the scale precompute has work: the option is on and FSDP sharded float8 weights."""
        if not self.plan.precompute_scale:
            return False
        from torch.distributed.tensor import DTensor
        from torchao.float8.float8_linear import Float8Linear

        return any(
            isinstance(m, Float8Linear) and isinstance(m.weight, DTensor) for m in model.modules()
        )

    def post_optimizer_hook(self, model: nn.Module) -> None:
        """After each optimizer step: every float8 weight scale at once (one all-reduce of amaxes)."""
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)


def build_float8_converter(
    float8_section: Any, requested_device: str, spec: Any, tokens_per_micro_batch: int | None = None
) -> Float8Converter | None:
    """The converter for a validated config and the model's TrainSpec, or None when float8 is off."""
    plan, errors = float8_problems(float8_section, requested_device)
    if errors:  # validate() reports these before training starts; this guards direct callers
        raise ValueError("\n".join(errors))
    return (
        None
        if plan is None
        else Float8Converter(
            plan, spec.float8_never_convert, spec.float8_experts_fn, tokens_per_micro_batch
        )
    )
