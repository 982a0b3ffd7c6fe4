"""The CUDA path of one training segment, traced on CPU (no GPU, no real weights).

A loom_1p7b-shaped model (micro-batch 8 x 1023, loops 1-3 = the preset's first segment) runs
forward, the trainer's loss and backward under FakeTensorMode with every kernel decision made for
CUDA (cuda_trace.py). From the recorded aten ops:
- every GEMM except the router's runs in bf16 (the routers' three fp32 GEMMs per layer and loop
  are by design: sigmoid routing decides top-k on them; the gate combine's per-row dot product,
  one bmm per layer and loop, is in the combine's dtype);
- the routed experts reach torch._grouped_mm with 16-byte-aligned strides (its CUDA kernel's rule);
- no floating S x S tensor (attention scores) is created: flex runs as one fused kernel;
- no op forces a device-to-host transfer (budget 0 inside the model: the trainer's one sync per
  segment is outside it, tests/unit/test_host_sync_budget.py);
- with float8 (the loom_1p7b_float8 preset on an H200), every linear the converter claims runs
  its three GEMMs per call on float8 tensors.
Every preset (debug, loom_329m, loom_1p7b, loom_1p7b_float8) is also traced at its own micro-batch,
seq_len and first segment, through the trainer's clip and AdamW step, and every recorded GEMM is
replayed on meta tensors (cuda_trace.replay_on_meta), where the CUDA kernels' shape and alignment
rules are checked (a CPU fake skips them). A CUDA rule found later becomes a case here.
"""

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch
from cuda_trace import (  # tests/unit/cuda_trace.py
    GEMMS,
    AtenRecorder,
    cuda_kernel,
    replay_on_meta,
    trace_segment,
)

from torchtitan_loom.config import load_config
from torchtitan_loom.config.validate import resolve_model_args
from torchtitan_loom.models.loom import loom_flavors

CONFIGS = Path(__file__).resolve().parents[2] / "train_configs"  # cwd-independent

ARGS = loom_flavors["loom_1p7b"]
B, S, LOOPS = 8, 1023, (1, 3)
T = LOOPS[1] - LOOPS[0] + 1
E = ARGS.num_routed_experts
ROUTER_GEMMS = 3  # logits = x @ w^T, and its two gradients


def tensors(op, n=2):
    return [a for a in op.args[:n] if isinstance(a, torch.Tensor)]


def score_like(t: torch.Tensor) -> bool:
    """A floating tensor whose last two dims are S (or S padded to a kernel block): attention scores."""
    return t.dim() >= 2 and t.is_floating_point() and all(S <= n < S + 128 for n in t.shape[-2:])


def aligned(t: torch.Tensor) -> bool:
    """torch._grouped_mm's rule: every non-unit stride and the start offset are 16-byte multiples."""
    size = t.element_size()
    strides_ok = all(st * size % 16 == 0 for st, n in zip(t.stride(), t.shape) if st != 1 and n > 1)
    return strides_ok and t.storage_offset() * size % 16 == 0


def check_cuda_segment(
    rec: AtenRecorder, n_layers: int, low_precision_gemm=lambda op: False
) -> None:
    LT = n_layers * T
    gemms = rec.named(*GEMMS)

    def row_dot(op):
        """The gate combine's gate gradient (models/loom/swiglu.py): one dot product per
        assignment row as a bmm [A, 1, D] x [A, D, 1] in the combine's dtype (fp32 under
        autocast, bf16 under FSDP), not a GEMM."""
        a, b = tensors(op)[:2]
        return op.name == "bmm" and a.shape[-2] == 1 and b.shape[-1] == 1

    dots = [op for op in gemms if row_dot(op)]
    assert len(dots) == LT
    high = [
        op
        for op in gemms
        if not low_precision_gemm(op)
        and not row_dot(op)
        and any(t.dtype != torch.bfloat16 for t in tensors(op))
    ]
    # The routers' GEMMs (an [*, E] operand, fp32), and nothing else outside bf16.
    assert all(
        any(E in t.shape for t in tensors(op))
        and all(t.dtype == torch.float32 for t in tensors(op))
        for op in high
    ), [(op.name, [(t.dtype, tuple(t.shape)) for t in tensors(op)]) for op in high][:5]
    assert len(high) == ROUTER_GEMMS * LT

    grouped = rec.named("_grouped_mm")
    assert len(grouped) == 6 * LT  # w13 and w2, forward and both gradients
    for op in grouped:
        assert all(t.dtype == torch.bfloat16 and aligned(t) for t in tensors(op)), [
            (t.dtype, tuple(t.shape), t.stride(), t.storage_offset()) for t in tensors(op)
        ]

    # Flex attention: one fused forward and backward per layer and loop, and no score tensor.
    assert (
        len(rec.named("flex_attention")) == LT and len(rec.named("flex_attention_backward")) == LT
    )
    scores = [
        (op.name, tuple(t.shape), t.dtype) for op in rec.ops for t in op.outputs if score_like(t)
    ]
    assert not scores, scores[:5]


@pytest.fixture(scope="module")
def autocast_trace():
    rec, _ = trace_segment(ARGS, micro_batch=B, seq_len=S, loops=LOOPS, precision="autocast")
    return rec


def test_one_gpu_segment_runs_the_cuda_kernels_in_bf16(autocast_trace):
    """One GPU, as benchmarks/gpu_check.sh runs it: bf16 autocast over fp32 parameters."""
    check_cuda_segment(autocast_trace, ARGS.n_layers)
    # The head: its three GEMMs in bf16 (the logits are upcast after it, for the loss).
    head = [
        op
        for op in autocast_trace.named("mm")
        if any(ARGS.vocab_size in t.shape for t in tensors(op))
    ]
    assert len(head) == 3 and all(t.dtype == torch.bfloat16 for op in head for t in tensors(op))


def test_fsdp_segment_runs_the_cuda_kernels_in_bf16():
    """Under FSDP the parameters arrive in bf16 (MixedPrecisionPolicy), without autocast; two
    layers of loom_1p7b's shape keep it quick (every layer is the same)."""
    args = dataclasses.replace(ARGS, n_layers=2)
    rec, _ = trace_segment(args, micro_batch=B, seq_len=S, loops=LOOPS, precision="fsdp")
    check_cuda_segment(rec, args.n_layers)


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao not installed")
def test_float8_segment_converts_what_it_claims():
    """loom_1p7b_float8 planned for an H200. The routed experts' fp8-rowwise kernels quantise with
    triton, which this CPU wheel lacks, so they stay bf16 here (tests/gpu runs them)."""
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    from torchtitan_loom.components.quantization.float8 import Float8Converter, plan_float8
    from torchtitan_loom.config import load_config
    from torchtitan_loom.protocols import get_train_spec

    cfg = load_config(
        ["--job.config_file", f"{CONFIGS}/loom_1p7b_float8.toml", "--float8.experts", "false"]
    )
    spec = get_train_spec("loom")
    plan, errors = plan_float8(cfg.float8, "cuda", (9, 0), "NVIDIA H200")
    assert not errors and plan is not None and not plan.emulate
    args = dataclasses.replace(ARGS, n_layers=2)
    rec, report = trace_segment(
        args,
        micro_batch=B,
        seq_len=S,
        loops=LOOPS,
        precision="autocast",
        convert=Float8Converter(
            plan, spec.float8_never_convert, spec.float8_experts_fn, B * S
        ).convert,
    )
    per_layer = (
        "attention.wqkv",
        "attention.wo",
        "moe.shared_experts.0.w13",
        "moe.shared_experts.0.w2",
        "moe.shared_experts.1.w13",
        "moe.shared_experts.1.w2",
    )
    assert sorted(report.dense) == sorted(
        f"layers.{i}.{n}" for i in range(args.n_layers) for n in per_layer
    )

    def is_float8(op):
        return all(isinstance(t, Float8TrainingTensor) for t in tensors(op))

    # Each claimed linear runs once per loop: forward and its two gradients, all on float8 tensors.
    assert len([op for op in rec.named("mm") if is_float8(op)]) == 3 * len(report.dense) * T
    check_cuda_segment(rec, args.n_layers, low_precision_gemm=is_float8)


def test_eager_flex_on_cuda_would_show_as_scores():
    """The check above can fail: flex attention left uncompiled on CUDA (what 'auto' ran before)
    computes the reference math, whose S x S scores the trace sees."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    with FakeTensorMode():
        q = torch.randn(1, 2, S, 64, requires_grad=True)
        mask = create_block_mask(lambda b, h, i, j: i >= j, 1, None, S, S, device="cpu")
        rec = AtenRecorder()
        with rec:
            cuda_kernel(flex_attention, q, q, q, block_mask=mask).sum().backward()
    assert any(score_like(t) for op in rec.ops for t in op.outputs)


def test_a_host_sync_in_the_segment_fails_the_trace():
    """The budget check can fail: the per-expert loop reads its group sizes on the host."""
    args = dataclasses.replace(ARGS, n_layers=1, moe_impl="loop")
    with pytest.raises(AssertionError, match=r"host sync: aten._local_scalar_dense"):
        trace_segment(args, micro_batch=1, seq_len=64, loops=(1, 1), precision="autocast")


# ---------------------------------------------------------------------------- every preset
PRESETS = ["debug_model.toml", "loom_329m.toml", "loom_1p7b.toml", "loom_1p7b_float8.toml"]
TRACE_LAYERS = 2  # every layer has the same shapes; two keep each case to seconds


def float8_convert(cfg, tokens: int):
    """The preset's converter as the trainer builds it, with the plan it gets on an H200. The
    routed experts' fp8-rowwise kernels need triton (absent here): tests/unit/test_float8_meta.py
    checks their layout against the grouped kernel's meta instead."""
    from torchtitan_loom.components.quantization.float8 import Float8Converter, plan_float8
    from torchtitan_loom.protocols import get_train_spec

    spec = get_train_spec(cfg.model.name)
    plan, errors = plan_float8(
        dataclasses.replace(cfg.float8, experts=False), "cuda", (9, 0), "NVIDIA H200"
    )
    assert not errors, errors
    return Float8Converter(plan, spec.float8_never_convert, spec.float8_experts_fn, tokens).convert


def trace_preset(preset: str):
    cfg = load_config(["--job.config_file", f"{CONFIGS}/{preset}"])
    t = cfg.training
    args = dataclasses.replace(resolve_model_args(cfg), n_layers=TRACE_LAYERS)
    fp32 = t.mixed_precision_param == "float32"
    convert = None
    if cfg.float8.enable:
        if importlib.util.find_spec("torchao") is None:
            pytest.skip("torchao not installed")
        convert = float8_convert(cfg, t.micro_batch_size * t.seq_len)
    rec, report = trace_segment(
        args,
        micro_batch=t.micro_batch_size,
        seq_len=t.seq_len,
        loops=(1, min(t.bp_segment_len, args.num_loops)),
        precision="fp32" if fp32 else "autocast",
        convert=convert,
        optimizer=cfg.optimizer,
        host_syncs=fp32,
        fake=not fp32,  # the fp32 loop reads group sizes: real tensors (the debug model is small)
    )
    return cfg, args, rec, report


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_runs_one_cuda_segment_and_step_within_the_kernel_rules(preset):
    cfg, args, rec, report = trace_preset(preset)
    gemms = rec.named(*GEMMS)
    assert gemms
    # Every GEMM again on meta tensors: torch._scaled_mm, torch._grouped_mm and the others check
    # their CUDA shape and alignment rules there.
    assert replay_on_meta(gemms) > 0
    # AdamW 'foreach' (the presets' implementation): a few multi-tensor kernels, each over every
    # parameter with a gradient, however many there are.
    assert cfg.optimizer.implementation == "foreach"
    foreach = [op for op in rec.step_ops if op.name.startswith("_foreach_")]
    assert foreach and len(foreach) < 20, len(foreach)
    lerp = [op for op in foreach if op.name == "_foreach_lerp_"]
    assert len(lerp) == 1 and len(lerp[0].args[0]) == len(rec.stepped) > 20
    if cfg.training.mixed_precision_param == "float32":
        # fp32 on CUDA: the experts take the per-expert loop (the grouped GEMM is bf16-only there),
        # the documented fallback (one host read of the group sizes per MoE call, a `.tolist()`
        # that real CPU tensors answer without dispatching, so the recorder cannot count it).
        assert not rec.named("_grouped_mm")
        experts_mm = [
            op for op in gemms if any(args.expert_intermediate_size in t.shape for t in tensors(op))
        ]
        assert len(experts_mm) >= args.num_routed_experts, len(experts_mm)
        assert all(t.dtype == torch.float32 for op in gemms for t in tensors(op))
        return
    assert rec.named("_grouped_mm")
    if report is not None:  # float8: each claimed linear's three GEMMs per loop on float8 tensors
        from torchao.float8.float8_training_tensor import Float8TrainingTensor

        loops = min(cfg.training.bp_segment_len, args.num_loops)
        fp8 = [
            op
            for op in rec.named("mm")
            if all(isinstance(t, Float8TrainingTensor) for t in tensors(op))
        ]
        assert len(fp8) == 3 * len(report.dense) * loops


def test_the_meta_replay_catches_a_rule_the_cpu_fake_skips():
    """The replay can fail: a float8 linear at 8 x 1023 tokens without the token pad runs on CPU
    fakes, and its replay on meta breaks torch._scaled_mm's rule."""
    if importlib.util.find_spec("torchao") is None:
        pytest.skip("torchao not installed")
    cfg = load_config(["--job.config_file", f"{CONFIGS}/loom_1p7b_float8.toml"])
    args = dataclasses.replace(resolve_model_args(cfg), n_layers=1)
    rec, _ = trace_segment(
        args,
        micro_batch=8,
        seq_len=1023,
        loops=(1, 1),
        precision="autocast",
        convert=float8_convert(cfg, None),  # no token count: no pad
    )
    with pytest.raises(AssertionError, match="divisible by 16"):
        replay_on_meta(rec.named(*GEMMS))
