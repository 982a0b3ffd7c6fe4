"""Every float8 preset's converted layers, forward + backward at the preset's real token count, on
meta tensors: torch's meta kernels check the CUDA kernels' shape rules (torch._scaled_mm's inner
dim divisible by 16, for one), which CPU tensors and the emulated path skip.

The plan is the one the preset gets on the GPU it is written for (an H200, SM90). The dense
linears go through torchao's Float8Linear as converted by the project's Float8Converter; the
routed experts' torchao wrapper needs triton (fp8 rowwise) or SM100 kernels (MXFP8), neither
reachable here, so the experts run the project's padded layout (models/loom/float8_experts.py,
swiglu_grouped on grouped_gemm.padded_rows) into torch._scaled_grouped_mm itself, the GEMM that
wrapper ends in.

Legend: M tokens of a micro-batch, A expert-assignment rows, D model dim, E routed experts.
"""

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

from torchtitan_loom.config import load_config
from torchtitan_loom.config.validate import resolve_model_args
from torchtitan_loom.protocols import get_train_spec

CONFIGS = Path(__file__).resolve().parents[2] / "train_configs"  # cwd-independent

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None, reason="torchao not installed"
)
ROOT = Path(__file__).resolve().parents[2]
H200 = ("cuda", (9, 0), "NVIDIA H200")


def float8_presets() -> list[str]:
    names = []
    for path in sorted((ROOT / "train_configs").glob("*.toml")):
        if load_config(["--job.config_file", str(path)]).float8.enable:
            names.append(path.name)
    return names


PRESETS = float8_presets()


def test_there_is_a_float8_preset():
    assert PRESETS == ["loom_1p7b_float8.toml"]


def converted_meta_model(cfg, tokens: int | None):
    from torchtitan_loom.components.quantization.float8 import Float8Converter, plan_float8

    spec = get_train_spec(cfg.model.name)
    # The experts' plan needs triton, absent here: the dense plan is the same either way.
    plan, errors = plan_float8(dataclasses.replace(cfg.float8, experts=False), *H200)
    assert not errors and not plan.emulate, errors
    with torch.device("meta"):
        model = spec.model_cls(resolve_model_args(cfg)).to(torch.bfloat16)  # FSDP's param dtype
    converter = Float8Converter(plan, spec.float8_never_convert, spec.float8_experts_fn, tokens)
    return model, converter.convert(model)


def run_dense(model, report, tokens: int) -> list[tuple[int, int]]:
    """Forward + backward of each distinct converted linear shape at `tokens` rows; the shapes."""
    shapes = {}
    for fqn in report.dense:
        mod = model.get_submodule(fqn)
        shapes.setdefault((mod.in_features, mod.out_features), mod)
    for (d_in, _), mod in shapes.items():
        x_MD = torch.randn(tokens, d_in, device="meta", dtype=torch.bfloat16, requires_grad=True)
        mod(x_MD).sum().backward()
        assert x_MD.grad.shape == x_MD.shape and mod.weight.grad is not None
    return sorted(shapes)


@pytest.mark.parametrize("preset", PRESETS)
def test_float8_preset_dense_linears_run_at_the_real_token_count(preset):
    cfg = load_config(["--job.config_file", f"{CONFIGS}/{preset}"])
    tokens = cfg.training.micro_batch_size * cfg.training.seq_len  # per rank, on every layout
    model, report = converted_meta_model(cfg, tokens)
    assert report.dense and (report.padded_tokens == tokens) == bool(tokens % 16)
    shapes = run_dense(model, report, tokens)
    assert len(shapes) >= 2, shapes  # attention and shared experts


def test_without_the_pad_the_preset_token_count_is_refused_by_the_kernel_rule():
    """The check above can fail: 8 x 1023 tokens, unpadded, breaks torch._scaled_mm's rule."""
    cfg = load_config(["--job.config_file", f"{CONFIGS}/loom_1p7b_float8.toml"])
    tokens = cfg.training.micro_batch_size * cfg.training.seq_len
    assert tokens % 16, tokens
    model, report = converted_meta_model(cfg, None)  # no token count: no pad
    assert report.padded_tokens is None
    with pytest.raises(RuntimeError, match="divisible by 16"):
        run_dense(model, report, tokens)


def scaled_grouped_gemm(a_PK, b_EKN, ends_E):
    """torch._scaled_grouped_mm with rowwise fp8 operands, as torchao's fp8-rowwise kernel calls it
    (A row-major, B column-major per expert, fp32 scales per row / per output column)."""
    a_fp8 = a_PK.to(torch.float8_e4m3fn)
    b_fp8 = b_EKN.transpose(-2, -1).contiguous().transpose(-2, -1).to(torch.float8_e4m3fn)
    a_scale = torch.ones(a_PK.shape[0], device=a_PK.device)
    b_scale = torch.ones(b_EKN.shape[0], b_EKN.shape[-1], device=a_PK.device)
    return torch._scaled_grouped_mm(
        a_fp8, b_fp8, a_scale, b_scale, offs=ends_E, out_dtype=torch.bfloat16
    )


class ScaledGroupedMM(torch.autograd.Function):
    """Forward and both gradients through the fp8 grouped GEMM, as torchao's autograd does."""

    @staticmethod
    def forward(ctx, a_PK, b_EKN, ends_E):
        ctx.save_for_backward(a_PK, b_EKN, ends_E)
        return scaled_grouped_gemm(a_PK, b_EKN, ends_E)

    @staticmethod
    def backward(ctx, g_PN):
        a_PK, b_EKN, ends_E = ctx.saved_tensors
        grad_a = scaled_grouped_gemm(g_PN, b_EKN.transpose(-2, -1), ends_E)
        # Weight gradient, per group g^T a: 2d x 2d operands grouped along the token dim, which
        # is their inner dim (g^T row-major, a column-major, one scale per group and column).
        E = b_EKN.shape[0]
        g_t = g_PN.t().contiguous().to(torch.float8_e4m3fn)
        a_col = a_PK.t().contiguous().t().to(torch.float8_e4m3fn)
        grad_b_ENK = torch._scaled_grouped_mm(
            g_t,
            a_col,
            torch.ones(E * g_PN.shape[1], device=a_PK.device),
            torch.ones(E * a_PK.shape[1], device=a_PK.device),
            offs=ends_E,
            out_dtype=torch.bfloat16,
        )
        grad_b = grad_b_ENK.transpose(-2, -1)
        return grad_a, grad_b, None


def run_experts(preset: str, alignment: int) -> None:
    """Forward + backward of one layer's routed experts at the preset's assignment count."""
    from torchtitan_loom.components.quantization.grouped_gemm import grouped_kernel
    from torchtitan_loom.models.loom.float8_experts import swiglu_grouped

    cfg = load_config(["--job.config_file", f"{CONFIGS}/{preset}"])
    args = resolve_model_args(cfg)
    tokens = cfg.training.micro_batch_size * cfg.training.seq_len
    E, D, inter = args.num_routed_experts, args.dim, args.expert_intermediate_size
    A = tokens * (args.top_k - args.num_shared_experts * args.top_k_includes_shared)
    with torch.device("meta"):
        w13 = torch.empty(E, 2 * inter, D, dtype=torch.bfloat16, requires_grad=True)
        w2 = torch.empty(E, D, inter, dtype=torch.bfloat16, requires_grad=True)
        x_AD = torch.empty(A, D, dtype=torch.bfloat16, requires_grad=True)
    # Group sizes are data: made on the CPU, then handed over as meta (the layout is computed
    # on the device from them, as in training).
    counts_E = torch.full((E,), A // E)
    counts_E[0] += A - int(counts_E.sum())
    kernel = grouped_kernel("fp8_rowwise", alignment, 16, ScaledGroupedMM.apply)
    y = swiglu_grouped(x_AD, counts_E.to("meta"), w13, w2, kernel)
    y.sum().backward()
    assert y.shape == (A, D) and w13.grad.shape == w13.shape and w2.grad.shape == w2.shape


@pytest.mark.parametrize("preset", PRESETS)
def test_float8_preset_routed_experts_padded_layout_meets_the_grouped_kernel(preset):
    from torchtitan_loom.components.quantization.float8 import EXPERT_ALIGNMENT

    run_experts(preset, EXPERT_ALIGNMENT["fp8_rowwise"])  # the H200's kernel


def test_unpadded_expert_groups_break_the_grouped_kernel_rule():
    """The check above can fail: without the 16-row alignment the weight-gradient operand's
    stride (the padded row count) is not a multiple of 16 bytes."""
    with pytest.raises(RuntimeError, match="multiple of 16 bytes"):
        run_experts(PRESETS[0], 1)


def test_the_token_pad_changes_no_result():
    """Zero rows added to the inner dim add nothing: emulated on CPU (which runs either way), a
    21-token micro-batch gives the same output and gradients padded and not."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    results = []
    for pad in (False, True):
        torch.manual_seed(0)
        lin = torch.nn.Sequential(torch.nn.Linear(32, 48, bias=False))
        config = dataclasses.replace(
            Float8LinearConfig.from_recipe_name("tensorwise"), emulate=True, pad_inner_dim=pad
        )
        convert_to_float8_training(lin, config=config)
        assert lin[0].config.pad_inner_dim == pad
        x_MD = torch.randn(21, 32, requires_grad=True)
        out = lin(x_MD)
        out.square().sum().backward()
        results.append((out.detach(), x_MD.grad, lin[0].weight.grad))
    for unpadded, padded in zip(*results):
        torch.testing.assert_close(padded, unpadded, rtol=1e-6, atol=1e-6)
