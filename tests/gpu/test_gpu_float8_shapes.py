"""Real float8 dense linears at the presets' token count, as the float8 cell runs them: each
distinct linear shape of loom_1p7b_float8, converted by the project's Float8Converter with the
preset's token count (8 x 1023 = 8184: the token pad on), forward + backward on the GPU against
the same linear in bf16. Without the pad the kernel refuses 8184 tokens (the rule this guards).

The comparison runs on the CPU too (emulated float8, small widths), so it is exercised in CI.

Legend: M tokens, K input width, N output width.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

from torchtitan_loom.config import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "train_configs"  # cwd-independent

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None, reason="torchao not installed"
)
PRESET = f"{CONFIGS}/loom_1p7b_float8.toml"
# float8 e4m3 forward / e5m2 gradients against bf16: a few per cent relative error.
TOL = 0.1


def preset_tokens() -> int:
    t = load_config(["--job.config_file", PRESET]).training
    return t.micro_batch_size * t.seq_len


def preset_linear_shapes() -> list[tuple[int, int]]:
    """(in, out) of each distinct linear the converter takes in the preset's model."""
    from torchtitan_loom.components.quantization.float8 import select_dense
    from torchtitan_loom.config.validate import resolve_model_args
    from torchtitan_loom.protocols import get_train_spec

    cfg = load_config(["--job.config_file", PRESET])
    spec = get_train_spec(cfg.model.name)
    with torch.device("meta"):
        model = spec.model_cls(resolve_model_args(cfg))
    names, _ = select_dense(model, spec.float8_never_convert)
    mods = [model.get_submodule(n) for n in names]
    return sorted({(m.in_features, m.out_features) for m in mods})


def test_the_preset_linear_shapes():
    assert len(preset_linear_shapes()) == 4  # wqkv, wo and the shared experts' w13, w2


def float8_vs_bf16(device: str, emulate: bool, tokens: int | None, shapes, m: int):
    """Relative errors (output, input grad, weight grad) of each converted linear of `shapes`
    against its bf16 copy, at `m` tokens; `tokens` is what the converter is told."""
    from torchtitan_loom.components.quantization.float8 import Float8Converter, Float8Plan

    plan = Float8Plan("tensorwise", emulate, None, False, False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(k, n, bias=False) for k, n in shapes])
    model = model.to(device, torch.bfloat16)
    ref = [torch.nn.Linear(k, n, bias=False).to(device, torch.bfloat16) for k, n in shapes]
    for r, lin in zip(ref, model):
        r.weight.data.copy_(lin.weight.data)
    report = Float8Converter(plan, tokens_per_micro_batch=tokens).convert(model)
    assert len(report.dense) == len(shapes)
    errors = []
    for lin, r, (k, _) in zip(model, ref, shapes):
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        outs = []
        for layer in (lin, r):
            xi = x.clone().requires_grad_()
            y = layer(xi)
            y.float().square().sum().backward()
            outs.append((y.detach(), xi.grad, layer.weight.grad))
        errors.append(
            [((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(*outs)]
        )
    return errors


def test_cpu_emulated_float8_tracks_bf16_at_an_unaligned_token_count():
    errors = float8_vs_bf16("cpu", True, 8184, [(64, 96), (96, 64)], 8184)
    assert all(0 < e < TOL for row in errors for e in row), errors


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="real float8 needs compute capability 8.9+",
)
def test_real_float8_dense_at_the_preset_token_count():
    shapes = preset_linear_shapes()
    tokens = preset_tokens()
    assert tokens % 16, tokens  # the case the pad exists for
    errors = float8_vs_bf16("cuda", False, tokens, shapes, tokens)
    assert all(0 < e < TOL for row in errors for e in row), errors
    with pytest.raises(RuntimeError, match="divisible by 16"):
        float8_vs_bf16("cuda", False, None, shapes[:1], tokens)  # no pad: the kernel's rule
