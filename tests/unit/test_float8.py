"""Float8 converter (components/quantization/float8.py): which modules convert, padding at the expert seam,
parameter names, and the up-front checks (CPU without emulation, recipes, device capability)."""

import dataclasses
import importlib.util
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from torchtitan_loom.components.quantization.float8 import (
    Float8Converter,
    plan_float8,
    select_dense,
)
from torchtitan_loom.components.quantization.grouped_gemm import grouped_kernel, padded_rows
from torchtitan_loom.config import ConfigError, load_config
from torchtitan_loom.config.validate import resolve
from torchtitan_loom.models.loom import LoomTransformer, loom_flavors
from torchtitan_loom.models.loom.float8_experts import (
    Float8GroupedExperts,
    convert_float8_experts,
    swiglu_grouped,
)
from torchtitan_loom.models.loom.moe import RoutedExperts, run_experts
from torchtitan_loom.protocols import get_train_spec
from torchtitan_loom.train import main

LOOM = get_train_spec("loom")

needs_torchao = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None, reason="torchao not installed"
)

# The debug flavor: 2 layers, 2 shared experts. Exactly these modules become Float8Linear ...
DENSE = [
    f"layers.{l}.{m}"
    for l in range(2)
    for m in (
        "attention.wqkv",
        "attention.wo",
        "moe.shared_experts.0.w13",
        "moe.shared_experts.0.w2",
        "moe.shared_experts.1.w13",
        "moe.shared_experts.1.w2",
    )
]
# ... and these become Float8GroupedExperts; nothing else changes type.
EXPERTS = ["layers.0.moe.experts", "layers.1.moe.experts"]


def f8_section(**changes):
    base = dict(
        enable=True,
        recipe="tensorwise",
        emulate=False,
        experts=False,
        experts_recipe="auto",
        enable_fsdp_float8_all_gather=False,
        precompute_float8_dynamic_scale_for_fsdp=False,
        filter_fqns=[],
    )
    return SimpleNamespace(**{**base, **changes})


def meta_model(**changes):
    with torch.device("meta"):
        return LoomTransformer(loom_flavors["debug"].replace(**changes))


def converted(model, **changes):
    plan, errors = plan_float8(f8_section(emulate=True, **changes), "cpu", None, "cpu")
    assert not errors, errors
    return Float8Converter(plan, LOOM.float8_never_convert, LOOM.float8_experts_fn).convert(model)


# ------------------------------------------------------------------ which modules convert
@needs_torchao
def test_converter_touches_exactly_the_dense_linears_and_routed_experts():
    from torchao.float8.float8_linear import Float8Linear

    model = meta_model()
    before = {n: type(m) for n, m in model.named_modules()}
    report = converted(model, experts=True)
    after = {n: type(m) for n, m in model.named_modules()}
    assert sorted(report.dense) == sorted(DENSE) and report.experts == EXPERTS
    changed = {n for n in before if after.get(n) is not before[n]}
    assert changed == set(DENSE) | set(EXPERTS)
    assert all(after[n] is Float8Linear for n in DENSE)
    assert all(after[n] is Float8GroupedExperts for n in EXPERTS)
    # Never converted: the head stays a plain Linear, the embedding an Embedding, routers Parameters.
    assert after["output"] is nn.Linear and after["tok_embeddings"] is nn.Embedding
    assert report.skipped == {"output": "never converted (routers, tok_embeddings, output)"}
    assert all(type(p) is nn.Parameter for n, p in model.named_parameters() if ".routers." in n)
    assert "never converted: routers, tok_embeddings, output" in report.summary(
        plan_float8(f8_section(emulate=True), "cpu", None, "cpu")[0]
    )


@needs_torchao
def test_dense_only_by_default_and_filter_fqns_keeps_modules_high_precision():
    model = meta_model()
    report = converted(model, filter_fqns=["shared_experts"])
    assert sorted(report.dense) == sorted(n for n in DENSE if "attention" in n)
    assert report.experts == [] and type(model.layers[0].moe.experts) is RoutedExperts
    assert report.skipped["layers.0.moe.shared_experts.1.w2"] == "matches float8.filter_fqns"


def test_layers_whose_dims_are_not_multiples_of_16_are_skipped_and_named():
    # Expert width 120: shared w13 [240, 128] qualifies, shared w2 [128, 120] does not; the routed
    # experts need multiples of 32 for MXFP8 and are skipped too. Attention (dim 128) converts.
    model = meta_model(expert_intermediate_size=120)
    dense, skipped = select_dense(model, LOOM.float8_never_convert)
    assert sorted(dense) == sorted(n for n in DENSE if not n.endswith(".w2") or "attention" in n)
    assert skipped["layers.1.moe.shared_experts.0.w2"] == "weight [128, 120] not multiples of 16"
    # The model's own factory decides on its layout; the kernel's gemm is never called on meta.
    experts, skipped_experts = convert_float8_experts(model, kernel("mxfp8_emulated", 32, 32))
    assert experts == [] and set(skipped_experts) == set(EXPERTS)
    assert "expert width 120 not multiples of 32" in skipped_experts["layers.0.moe.experts"]
    assert all(type(m.experts) is RoutedExperts for m in model.moe_layers())
    assert convert_float8_experts(meta_model(), kernel("fp8_rowwise", 16, 16))[0] == EXPERTS


@needs_torchao
def test_state_dict_keys_shapes_and_parameter_order_are_unchanged():
    plain, model = meta_model(), meta_model()
    converted(model, experts=True)
    assert [(n, p.shape) for n, p in plain.named_parameters()] == [
        (n, p.shape) for n, p in model.named_parameters()
    ]
    assert {k: v.shape for k, v in plain.state_dict().items()} == {
        k: v.shape for k, v in model.state_dict().items()
    }


# ------------------------------------------------------------------ padding at the expert seam
def test_padded_layout_aligns_every_group_and_tiles_the_buffer():
    counts_E = torch.tensor([5, 0, 32, 33, 1, 0, 64, 7])
    A, a = int(counts_E.sum()), 32
    dest_A, ends_E, P = padded_rows(counts_E, a, A)
    assert P % a == 0 and P >= A + len(counts_E) * a - a and int(ends_E[-1]) == P
    starts_E = torch.cat([ends_E.new_zeros(1), ends_E[:-1]]).long()
    assert (starts_E % a == 0).all() and ((ends_E.long() - starts_E) >= a).all()
    assert len(set(dest_A.tolist())) == A  # no two rows share a slot
    src_start = 0
    for e, c in enumerate(counts_E.tolist()):  # group e keeps its rows, in order
        assert dest_A[src_start : src_start + c].tolist() == list(
            range(starts_E[e], starts_E[e] + c)
        )
        src_start += c


def plain_grouped_gemm(a_PK, b_EKN, ends_E):
    return torch._grouped_mm(a_PK, b_EKN, offs=ends_E)


def kernel(name, alignment, dim_multiple, gemm=plain_grouped_gemm):
    return grouped_kernel(name, alignment, dim_multiple, gemm)


@pytest.mark.parametrize("alignment", [16, 32])
def test_padding_does_not_change_the_expert_math(alignment):
    # With a high-precision grouped GEMM the padded path must equal the model's own experts
    # (forward, input gradient and weight gradients): padding only moves rows.
    torch.manual_seed(0)
    E, D, I = 6, 32, 48
    counts_E = torch.tensor([3, 0, 17, 40, 1, 9])
    x_AD = torch.randn(int(counts_E.sum()), D, requires_grad=True)
    w13 = torch.randn(E, 2 * I, D, requires_grad=True)
    w2 = torch.randn(E, D, I, requires_grad=True)
    g_AD = torch.randn(x_AD.shape[0], D)
    ref = run_experts(x_AD, counts_E, w13, w2, "loop")
    ref_grads = torch.autograd.grad(ref, (x_AD, w13, w2), g_AD)
    out = swiglu_grouped(x_AD, counts_E, w13, w2, kernel("plain", alignment, 16))
    grads = torch.autograd.grad(out, (x_AD, w13, w2), g_AD)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@needs_torchao
def test_emulated_mxfp8_experts_are_close_to_high_precision_but_not_equal():
    torch.manual_seed(0)
    experts = RoutedExperts(8, 128, 128, "grouped")
    with torch.no_grad():
        experts.w13.normal_(std=128**-0.5), experts.w2.normal_(std=128**-0.5)
    counts_E = torch.tensor([30, 0, 70, 5, 64, 1, 33, 53])
    x_AD = torch.randn(int(counts_E.sum()), 128)
    f8 = Float8GroupedExperts(experts, grouped_kernel("mxfp8_emulated", 32, 32))
    assert f8.w13 is experts.w13 and f8.w2 is experts.w2
    ref, out = experts(x_AD, counts_E), f8(x_AD, counts_E).float()
    rel = ((out - ref).norm() / ref.norm()).item()
    # Two MXFP8 (e4m3, 3 mantissa bits) GEMMs in a row: 0.067 measured; 0 would mean no quantisation.
    assert 1e-3 < rel < 0.15, rel


# ------------------------------------------------------------------ up-front checks
def config_errors(*argv):
    cfg = load_config(["--float8.enable", *argv])
    with pytest.raises(ConfigError) as exc:
        resolve(cfg, 1)
    return str(exc.value).splitlines()


@needs_torchao
def test_float8_on_cpu_without_emulation_is_one_clear_error():
    errors = config_errors("--training.device", "cpu")
    assert len(errors) == 1
    assert "float8.emulate = true" in errors[0] and "8.9" in errors[0]


@needs_torchao
def test_bad_combinations_are_one_error_each():
    [e] = config_errors(
        "--training.device",
        "cpu",
        "--float8.emulate",
        "--float8.recipe",
        "rowwise",
        "--float8.enable_fsdp_float8_all_gather",
    )
    assert "needs float8.recipe = 'tensorwise'" in e
    [e] = config_errors(
        "--training.device",
        "cpu",
        "--float8.emulate",
        "--float8.precompute_float8_dynamic_scale_for_fsdp",
    )
    assert "enable_fsdp_float8_all_gather = true" in e
    [e] = config_errors(
        "--training.device",
        "cpu",
        "--float8.emulate",
        "--float8.experts",
        "--float8.experts_recipe",
        "fp8_rowwise",
    )
    assert "no emulated kernel" in e
    [e] = config_errors(
        "--training.device", "cpu", "--float8.emulate", "--float8.experts", "--compile.enable"
    )
    assert "torch.compile fails on torchao's emulated MXFP8" in e


def test_unknown_recipe_is_rejected_naming_the_valid_ones():
    with pytest.raises(
        ConfigError, match=r"float8\.recipe: 'blockwise' is not one of tensorwise, rowwise"
    ):
        load_config(["--float8.recipe", "blockwise"])


@needs_torchao
def test_cli_exits_2_with_one_error_line(capsys):
    assert main(["--float8.enable", "--training.device", "cpu", "--check-config"]) == 2
    assert (
        len([ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("config error")])
        == 1
    )
    # One line per problem, all in one run: the bad recipe and (without emulate) the CPU rule.
    assert main(["--float8.enable", "--float8.recipe", "nope", "--check-config"]) == 2
    err = capsys.readouterr().err
    assert err.count("config error") == 2 and "float8.recipe" in err and "float8.emulate" in err
    assert (
        main(["--float8.enable", "--float8.emulate", "--float8.recipe", "nope", "--check-config"])
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("config error") == 1 and "float8.recipe" in err
    assert (
        main(["--float8.enable", "--float8.emulate", "--training.device", "cpu", "--check-config"])
        == 0
    )


@needs_torchao
@pytest.mark.parametrize(
    "cap, name, experts, expect",
    [
        ((8, 0), "NVIDIA A100", False, "compute capability 8.9+"),
        ((8, 9), "NVIDIA L40S", False, None),
        ((8, 9), "NVIDIA L40S", True, "fp8_rowwise needs SM90"),
        ((9, 0), "NVIDIA H200", True, "fp8_rowwise"),
        ((10, 0), "NVIDIA B200", True, "mxfp8"),
    ],
)
def test_capability_checks(cap, name, experts, expect):
    plan, errors = plan_float8(f8_section(experts=experts), "cuda", cap, name)
    if expect in ("fp8_rowwise", "mxfp8"):
        if expect == "fp8_rowwise" and importlib.util.find_spec("triton") is None:
            assert "needs triton" in errors[0]
            return
        assert not errors and plan.experts_kernel == expect
        assert plan.expert_alignment == {"fp8_rowwise": 16, "mxfp8": 32}[expect]
    elif expect is None:
        assert not errors and plan.experts_kernel is None and not plan.emulate
    else:
        assert len(errors) == 1 and expect in errors[0] and name in errors[0]
    # MXFP8 on an SM90 GPU is a clear error; emulation runs anywhere.
    _, errors = plan_float8(
        f8_section(experts=True, experts_recipe="mxfp8"), "cuda", (9, 0), "NVIDIA H200"
    )
    assert len(errors) == 1 and "needs an SM100 GPU" in errors[0]
    plan, errors = plan_float8(
        f8_section(experts=True, emulate=True), "cuda", (8, 0), "NVIDIA A100"
    )
    assert not errors and plan.experts_kernel == "mxfp8_emulated"


@needs_torchao
def test_float8_preset_is_loom_1p7b_plus_the_float8_section():
    from pathlib import Path

    configs = Path(__file__).resolve().parents[2] / "train_configs"
    base = load_config(
        ["--job.config_file", str(configs / "loom_1p7b.toml"), "--parallelism.dry_run", "true"]
    )
    f8 = load_config(
        [
            "--job.config_file",
            str(configs / "loom_1p7b_float8.toml"),
            "--parallelism.dry_run",
            "true",
        ]
    )
    assert f8.float8.enable and f8.float8.recipe == "tensorwise" and f8.float8.experts
    assert (
        f8.float8.enable_fsdp_float8_all_gather
        and f8.float8.precompute_float8_dynamic_scale_for_fsdp
    )
    for section in (
        "model",
        "training",
        "optimizer",
        "lr_scheduler",
        "spike_guard",
        "eval",
        "parallelism",
        "checkpoint",
        "data",
        "metrics",
        "compile",
        "activation_checkpoint",
    ):
        assert getattr(f8, section) == getattr(base, section), section
    f8 = load_config(
        [
            "--job.config_file",
            str(configs / "loom_1p7b_float8.toml"),
            "--parallelism.dry_run",
            "true",
            "--float8.emulate",
            "--training.device",
            "cpu",
            "--compile.enable",
            "false",
        ]
    )
    # valid as shipped once the device can run it (emulated float8 experts do not compile)
    assert resolve(f8, 8).model_args.num_loops == 9


def test_float8_section_is_documented():
    from torchtitan_loom.config.manager import section_fields
    from torchtitan_loom.config.schema import Float8

    for key, (_, f) in section_fields(Float8).items():
        assert f.metadata["doc"], key
    assert dataclasses.asdict(Float8())["filter_fqns"] == []
