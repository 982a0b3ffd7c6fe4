"""Whole-model forward: outputs, loop ranges with a carried state, per-loop router gradients,
ablation switches, and "all off + H = 1 = a plain pre-norm MoE transformer" (spec §4, §6, §14)."""

import math

import pytest
import torch

from torchtitan_loom.models.loom import LoomTransformer, loom_flavors
from torchtitan_loom.models.loom.attention import build_attention_mask, rope_cos_sin
from torchtitan_loom.models.loom.looping_residual import LoopCarry


def debug_model(**changes) -> LoomTransformer:
    model = LoomTransformer(loom_flavors["debug"].replace(**changes))
    model.init_weights()
    return model


def batch(B=2, S=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 512, (B, S), generator=g)
    doc = torch.tensor([[0] * 9 + [1] * (S - 9)] + [[0] * S] * (B - 1))
    positions = torch.stack(
        [torch.cat([torch.arange(9), torch.arange(S - 9)])] + [torch.arange(S)] * (B - 1)
    )
    return tokens, positions, doc


def rms(x, w=None):
    y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    return y if w is None else y * w


def composed_forward(model, tokens, positions, doc, pre_norm_rms=None):
    """Spec §4.9 written out with straight loops, reusing only the model's attention and MoE modules
    (tested on their own elsewhere). Every switch is read from model.args. ``pre_norm_rms``, a list,
    receives each loop's per-token stream RMS [B, S] after its last block's update, before any norm."""
    a = model.args
    L, H = a.n_layers, a.num_loops
    e = model.tok_embeddings.weight[tokens] * math.sqrt(a.dim)
    rope = rope_cos_sin(positions, a.head_dim, a.rope_theta)
    mask = build_attention_mask("sdpa", doc)
    gamma = a.cycle_scale_lambda / (H * math.sqrt(L)) if a.cycle_residual_scale else 1.0
    z, h_num, h_den = e, 0.0, 0.0
    for t in range(1, H + 1):
        if t >= 2 and a.embed_inject_mode == "loop_start_mix_soft":
            g = min(1.0, a.cycle_scale_lambda / (t * math.sqrt(L)))
            z = (1 - g) * z + g * e
        l_num, l_den = 0.0, 0.0
        for layer in model.layers:
            o = gamma * layer.attention(rms(z), rope, mask)
            if a.looping_residual:
                l_num, l_den = 0.5 * l_num + o, 0.5 * l_den + 1
                r_L = l_num / l_den
                h_num, h_den = 0.5 * h_num + r_L, 0.5 * h_den + 1
                z = z + r_L + h_num / h_den
            else:
                z = z + o
            router = layer.moe.routers[t - 1 if a.router_per_loop else 0]
            m = layer.moe(rms(z), router)[0]
            if a.ffn_branch_rms == "affine":
                m = rms(m, layer.ffn_branch_norm.weight)
            z = z + gamma * m
            last_rms = z.pow(2).mean(-1).sqrt()  # before the layer's out norm and the loop's
            if a.per_layer_out_norm:
                z = rms(z)
        if pre_norm_rms is not None:
            pre_norm_rms.append(last_rms)
        z = rms(z)
    return z @ model.output.weight.t()


# ---------------------------------------------------------------- outputs


def test_outputs_shapes_dtypes_and_counts():
    model = debug_model()
    tokens, positions, doc = batch()
    out = model(tokens, positions, doc)
    assert out.logits_BSV.shape == (2, 24, 512) and out.logits_BSV.dtype == torch.float32
    assert out.counts_LTE.shape == (2, 3, 8) and out.counts_LTE.dtype == torch.int64
    # N = 48 tokens, k = 2: 96 assignments per call, capacity C = floor(1.5 * 48 * 2 / 8) = 18
    assert torch.all(out.counts_LTE.sum(-1) <= 96) and out.counts_LTE.max() == 18
    assert out.aux_loss.item() == 0.0 and out.aux_loss.shape == ()
    assert out.carry.h_num_BSD.dtype == out.carry.h_den_BS1.dtype == torch.float32
    # 3 loops x 2 layers = 6 H-memory writes: D = 2(1 - 2^-6)
    torch.testing.assert_close(out.carry.h_den_BS1, torch.full((2, 24, 1), 2 * (1 - 2**-6)))
    assert out.carry.z_BSD.requires_grad and not out.carry.detach().z_BSD.requires_grad
    assert all(b.shape == (8,) and not b.any() for b in (m.expert_bias for m in model.moe_layers()))


def test_default_model_matches_composed_spec_forward():
    model = debug_model()
    tokens, positions, doc = batch()
    with torch.no_grad():
        # fp32, same kernels, different association of a few sums: 1e-5 on O(1) logits
        torch.testing.assert_close(
            model(tokens, positions, doc).logits_BSV,
            composed_forward(model, tokens, positions, doc),
            rtol=0,
            atol=1e-5,
        )


def test_input_validation_messages():
    model = debug_model()
    tokens, positions, doc = batch()
    with pytest.raises(ValueError, match=r"loop range \[2, 4\] invalid.*H=3"):
        model(
            tokens,
            positions,
            doc,
            loop_start=2,
            loop_end=4,
            carry=model(tokens, positions, doc, 1, 1).carry,
        )
    with pytest.raises(ValueError, match="pass carry=None"):
        model(tokens, positions, doc, loop_start=1, carry=model(tokens, positions, doc).carry)
    with pytest.raises(ValueError, match=r"loop_start=2 continues.*\[1, 1\]"):
        model(tokens, positions, doc, loop_start=2)
    with pytest.raises(ValueError, match="must have the shape of tokens_BS"):
        model(tokens, positions[:, :5], doc)
    with pytest.raises(ValueError, match="exceeds max_seq_len=256"):
        model(
            torch.zeros(1, 257, dtype=torch.long),
            torch.zeros(1, 257, dtype=torch.long),
            torch.zeros(1, 257, dtype=torch.long),
        )


# ---------------------------------------------------------------- segments


def test_stream_rms_is_measured_before_each_loops_closing_norm():
    """The eval's stream statistic reads the stream where it can move: each loop's per-token RMS
    after its last block's update, before the layer's out norm and the loop's closing RMSNorm,
    equals the composed forward's (same 1e-5 as the logits: the same sums), and it is not the
    post-norm 1 (which it would be to ~1e-7, the norm's eps). With and without the per-layer norm."""
    for per_layer_out_norm in (True, False):
        _check_stream_rms(debug_model(per_layer_out_norm=per_layer_out_norm))


def _check_stream_rms(model):
    tokens, positions, doc = batch()
    want: list[torch.Tensor] = []
    with torch.no_grad():
        composed_forward(model, tokens, positions, doc, pre_norm_rms=want)
        carry = None
        for t in range(1, model.num_loops + 1):
            carry = model(tokens, positions, doc, t, t, carry=carry).carry
            got = model.stream_rms(carry)
            torch.testing.assert_close(got, want[t - 1], rtol=0, atol=1e-5)
            assert (got - 1).abs().max() > 1e-2, got  # a value that can move
            post = model.carry_stream(carry).float().pow(2).mean(-1).sqrt()
            torch.testing.assert_close(post, torch.ones_like(post), rtol=0, atol=1e-5)


def test_segments_with_carry_equal_one_full_forward():
    model = debug_model(num_loops=9)
    tokens, positions, doc = batch()
    with torch.no_grad():
        full = model(tokens, positions, doc, 1, 9)
        carry, counts = None, []
        for a, b in ((1, 3), (4, 6), (7, 9)):
            seg = model(tokens, positions, doc, a, b, carry=carry)
            # entropy_BS is None without the exit head
            carry = LoopCarry(*(None if t is None else t.clone() for t in seg.carry.detach()))
            counts.append(seg.counts_LTE)
    # The segmented run executes the same kernels on the same shapes in the same order; only the
    # (recomputed) embedding is produced twice. Results are expected bitwise equal; 1e-6 absolute
    # only leaves room for run-to-run reduction-order noise of threaded CPU kernels.
    torch.testing.assert_close(seg.logits_BSV, full.logits_BSV, rtol=0, atol=1e-6)
    assert seg.carry.entropy_BS is None and full.carry.entropy_BS is None
    for got, want in zip(seg.carry[:4], full.carry[:4]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert torch.equal(torch.cat(counts, dim=1), full.counts_LTE)


def test_segment_backward_reaches_only_the_routers_of_its_loops():
    model = debug_model(num_loops=9)
    tokens, positions, doc = batch()
    carry = model(tokens, positions, doc, 1, 3).carry.detach()
    out = model(tokens, positions, doc, 4, 6, carry=carry)
    out.logits_BSV.logsumexp(-1).mean().backward()
    for layer in model.layers:
        with_grad = [t for t, r in enumerate(layer.moe.routers) if r.grad is not None]
        assert with_grad == [3, 4, 5]
    assert model.tok_embeddings.weight.grad is not None  # injection of the recomputed embedding
    assert model.layers[0].attention.wqkv.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------- ablations


ABLATIONS = [
    dict(cycle_residual_scale=False),
    dict(embed_inject_mode="none"),
    dict(ffn_branch_rms="none"),
    dict(looping_residual=False),
    dict(per_layer_out_norm=False),
    dict(num_loops=2),
]


@pytest.mark.parametrize("change", ABLATIONS, ids=lambda c: next(iter(c)))
def test_each_ablation_switch_does_what_the_spec_says(change):
    model, default = debug_model(**change), debug_model()
    tokens, positions, doc = batch()
    with torch.no_grad():
        logits = model(tokens, positions, doc).logits_BSV
        torch.testing.assert_close(
            logits, composed_forward(model, tokens, positions, doc), rtol=0, atol=1e-5
        )
        # parameters shared by name are initialised identically, so any difference is the switch
        assert (logits - default(tokens, positions, doc).logits_BSV).abs().max() > 1e-3


def test_ffn_branch_rms_none_has_no_norm_weight():
    names = {n for n, _ in debug_model(ffn_branch_rms="none").named_parameters()}
    assert not any("ffn_branch_norm" in n for n in names)


def test_router_per_loop_uses_router_t_in_loop_t_and_the_switch_shares_router_0():
    per_loop, shared = debug_model(), debug_model(router_per_loop=False)
    assert [n for n, _ in shared.named_parameters() if "routers" in n] == [
        "layers.0.moe.routers.0",
        "layers.1.moe.routers.0",
    ]
    tokens, positions, doc = batch()
    with torch.no_grad():
        # routers start as copies of router 0: identical results at init
        torch.testing.assert_close(
            per_loop(tokens, positions, doc).logits_BSV,
            shared(tokens, positions, doc).logits_BSV,
            rtol=0,
            atol=0,
        )
        before_1 = per_loop(tokens, positions, doc, 1, 1).logits_BSV
        before_2 = per_loop(tokens, positions, doc, 1, 2).logits_BSV
        for layer in per_loop.layers:
            layer.moe.routers[1].add_(torch.randn_like(layer.moe.routers[1]))
        assert torch.equal(
            per_loop(tokens, positions, doc, 1, 1).logits_BSV, before_1
        )  # loop 1: router 0
        assert not torch.allclose(per_loop(tokens, positions, doc, 1, 2).logits_BSV, before_2)
        torch.testing.assert_close(
            shared(tokens, positions, doc).logits_BSV,
            composed_forward(shared, tokens, positions, doc),
            rtol=0,
            atol=1e-5,
        )


def test_all_recipe_parts_off_and_one_loop_is_a_plain_pre_norm_moe_transformer():
    model = debug_model(
        num_loops=1,
        cycle_residual_scale=False,
        embed_inject_mode="none",
        ffn_branch_rms="none",
        looping_residual=False,
        per_layer_out_norm=False,
        router_per_loop=False,
    )
    tokens, positions, doc = batch()
    rope = rope_cos_sin(positions, 64, 1e4)
    mask = build_attention_mask("sdpa", doc)
    with torch.no_grad():
        x = model.tok_embeddings.weight[tokens] * math.sqrt(128)
        for layer in model.layers:
            x = x + layer.attention(rms(x), rope, mask)
            x = x + layer.moe(rms(x), layer.moe.routers[0])[0]
        expected = rms(x) @ model.output.weight.t()
        torch.testing.assert_close(
            model(tokens, positions, doc).logits_BSV, expected, rtol=0, atol=1e-5
        )


def test_router_z_loss_enters_aux_loss_only():
    tokens, positions, doc = batch()
    off, on = debug_model(), debug_model(router_z_loss_coef=1e-3)
    with torch.no_grad():
        out_off, out_on = off(tokens, positions, doc), on(tokens, positions, doc)
        assert torch.equal(out_off.logits_BSV, out_on.logits_BSV)
        assert out_off.aux_loss.item() == 0.0
        # expected: coef * sum over layers and loops of the MoE z terms (checked in test_model_moe)
        terms = []
        for layer in on.layers:
            layer.moe.register_forward_hook(lambda mod, args, output: terms.append(output[2]))
        on(tokens, positions, doc)
    assert len(terms) == 6
    torch.testing.assert_close(out_on.aux_loss, 1e-3 * torch.stack(terms).sum(), rtol=1e-6, atol=0)
    assert out_on.aux_loss > 0


def test_one_compiled_block_serves_every_loop():
    # The router and gamma reach the block as tensors, so more loops (or later segments) must not
    # recompile. The only variants come from requires_grad of the fresh zero memories (3 at most).
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    try:
        model = debug_model(num_loops=4).to(torch.bfloat16)  # grouped GEMM traces in bf16 only
        tokens, positions, doc = batch()
        eager = model(tokens, positions, doc).logits_BSV
        counter = CompileCounter()
        for i, layer in enumerate(model.layers):
            model.layers[i] = torch.compile(layer, backend=counter, fullgraph=True)
        compiled = model(tokens, positions, doc, 1, 2)
        frames = counter.frame_count
        assert frames <= 3
        out = model(tokens, positions, doc, 3, 4, carry=compiled.carry.detach())
        assert counter.frame_count == frames
        torch.testing.assert_close(out.logits_BSV, eager, rtol=0, atol=0)  # eager-backend tracing
    finally:
        torch._dynamo.reset()
