"""LoomModelArgs validation, flavors, the TrainSpec registry, parameter counts (spec §2), FLOPs."""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from torchtitan_loom.models.loom import (
    LoomModelArgs,
    LoomTransformer,
    loom_flavors,
    parallelize_loom,
)
from torchtitan_loom.protocols import ModelProtocol, TrainSpec, get_train_spec, register_train_spec


def meta_model(args: LoomModelArgs) -> LoomTransformer:
    with torch.device("meta"):
        return LoomTransformer(args)


# ---------------------------------------------------------------- registry / protocol


def test_get_train_spec_imports_models_lazily_in_a_fresh_interpreter():
    # The acceptance command: nothing but protocols imported, 1.7B built on meta.
    code = (
        "from torchtitan_loom.protocols import get_train_spec; import torch\n"
        "s = get_train_spec('loom')\n"
        "with torch.device('meta'):\n"
        "    m = s.model_cls(s.model_args['loom_1p7b'])\n"
        "print(m.param_counts()['total'], next(m.parameters()).device)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1644913920", "meta"]


def test_spec_fields_and_protocol():
    spec = get_train_spec("loom")
    assert spec.name == "loom" and spec.model_cls is LoomTransformer
    assert set(spec.model_args) == {"debug", "loom_329m", "loom_1p7b"}
    assert spec.parallelize_fn is parallelize_loom
    assert isinstance(meta_model(spec.model_args["debug"]), ModelProtocol)


def test_registry_rejects_a_second_spec_under_a_taken_name_and_unknown_names():
    spec = get_train_spec("loom")
    register_train_spec("loom", spec)  # same object again: allowed (idempotent)
    with pytest.raises(ValueError, match="already registered"):
        register_train_spec(
            "loom", TrainSpec(name="loom", model_cls=LoomTransformer, model_args={})
        )
    with pytest.raises(ValueError, match="unknown train spec 'nope'.*loom"):
        get_train_spec("nope")


# ---------------------------------------------------------------- args


def test_flavors_match_spec_presets():
    d = loom_flavors["debug"]
    assert (d.vocab_size, d.dim, d.n_layers, d.n_heads, d.n_kv_heads, d.num_loops) == (
        512,
        128,
        2,
        2,
        1,
        3,
    )
    assert (d.num_routed_experts, d.num_shared_experts, d.routed_top_k, d.head_dim) == (8, 2, 2, 64)
    for name, (dim, L, nh, nkv, inter) in {
        "loom_329m": (512, 10, 8, 4, 512),
        "loom_1p7b": (1280, 15, 20, 10, 768),
    }.items():
        a = loom_flavors[name]
        assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.expert_intermediate_size) == (
            dim,
            L,
            nh,
            nkv,
            inter,
        )
        assert (a.vocab_size, a.num_loops, a.max_seq_len, a.head_dim, a.routed_top_k) == (
            49152,
            9,
            1023,
            64,
            6,
        )
        # recipe values of spec §1.3 / §14
        assert (a.capacity_factor, a.load_balance_bias_lr, a.router_z_loss_coef) == (1.5, 2e-3, 0.0)
        assert (a.cycle_scale_lambda, a.looping_residual_beta, a.rope_theta, a.norm_eps) == (
            0.5,
            0.5,
            1e4,
            1e-6,
        )
        assert (
            a.router_per_loop
            and a.cycle_residual_scale
            and a.looping_residual
            and a.per_layer_out_norm
        )
        assert (a.embed_inject_mode, a.ffn_branch_rms, a.attn_backend) == (
            "loop_start_mix_soft",
            "affine",
            "auto",
        )


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(dim=129), r"dim \(129\) must be divisible by n_heads"),
        (dict(dim=130), r"dim // n_heads = 65 must be even"),
        (dict(n_kv_heads=3, n_heads=2), r"n_heads \(2\) must be divisible by n_kv_heads"),
        (dict(num_loops=0), r"num_loops must be an integer >= 1"),
        (dict(top_k=11), r"top_k=11 gives 9 routed.*1..num_routed_experts=8"),
        (dict(top_k=2), r"top_k=2 gives 0 routed"),
        (dict(embed_inject_mode="add"), r"embed_inject_mode='add'.*none, loop_start_mix_soft"),
        (dict(ffn_branch_rms="unit"), r"ffn_branch_rms='unit'.*none, affine"),
        (dict(attn_backend="fa3"), r"attn_backend='fa3'.*auto, sdpa, flex, flash_attn"),
        (dict(moe_impl="fast"), r"moe_impl='fast'.*grouped, loop"),
        (dict(capacity_factor=-1.0), r"capacity_factor must be a number >= 0"),
        (dict(looping_residual_beta=1.5), r"looping_residual_beta must be in \[0, 1\]"),
        (dict(norm_eps=0.0), r"norm_eps must be a number > 0"),
    ],
)
def test_validate_names_the_field_and_valid_values(change, message):
    with pytest.raises(ValueError, match=message):
        loom_flavors["debug"].replace(**change)
    with pytest.raises(ValueError, match=message):  # the model validates too
        meta_model(dataclasses.replace(loom_flavors["debug"], **change))


def test_top_k_without_shared_counts_routed_only():
    args = loom_flavors["debug"].replace(top_k=3, top_k_includes_shared=False)
    assert args.routed_top_k == 3


def test_args_are_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        loom_flavors["debug"].num_loops = 2


# ---------------------------------------------------------------- counts (spec §2)


@pytest.mark.parametrize(
    "flavor, base, per_loop, total_h9, active",
    [
        ("loom_329m", 312_480_768, 153_600, 313_863_168, 73_559_040 + 2 * 25_165_824),
        ("loom_1p7b", 1_639_729_920, 576_000, 1_644_913_920, 452_793_600 + 2 * 62_914_560),
    ],
)
def test_param_counts_match_spec(flavor, base, per_loop, total_h9, active):
    args = loom_flavors[flavor]
    counts = meta_model(args).param_counts()
    assert counts == {"total": total_h9, "active": active}
    for H in (1, 3, 6, 12):
        assert meta_model(args.replace(num_loops=H)).param_counts()["total"] == base + per_loop * H
    # one router per layer: the total no longer grows with H, the active count does not change
    single = meta_model(args.replace(router_per_loop=False, num_loops=12)).param_counts()
    assert single == {"total": base + per_loop, "active": active}


def test_shapes_match_spec_checklist():
    m = meta_model(loom_flavors["loom_1p7b"])
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes["layers.0.attention.wqkv.weight"] == (3840, 1280)
    assert shapes["layers.0.attention.wo.weight"] == (1280, 1280)
    assert shapes["layers.0.moe.experts.w13"] == (30, 1536, 1280)
    assert shapes["layers.0.moe.experts.w2"] == (30, 1280, 768)
    assert shapes["layers.0.moe.shared_experts.1.w13.weight"] == (1536, 1280)
    assert shapes["layers.14.moe.routers.8"] == (30, 1280)
    assert shapes["layers.14.ffn_branch_norm.weight"] == (1280,)
    assert shapes["tok_embeddings.weight"] == shapes["output.weight"] == (49152, 1280)
    assert "layers.0.moe.routers.9" not in shapes
    assert dict(m.named_buffers())["layers.3.moe.expert_bias"].shape == (30,)


def test_flops_per_token_formula():
    args = loom_flavors["loom_329m"]
    m = meta_model(args)
    L, H, d, S = 10, 9, 512, 1023
    attention = (1536 + 512) * d
    per_loop = L * (attention + 6 * 3 * d * 512 + 2 * 3 * d * 512 + 30 * d)
    head = 49152 * d
    expected = 6 * (per_loop * H + head) + 12 * L * H * 8 * 64 * S
    assert m.flops_per_token(S) == pytest.approx(expected, rel=1e-12)
    assert m.flops_per_token(S, head_calls=3) - m.flops_per_token(S) == pytest.approx(12 * head)
