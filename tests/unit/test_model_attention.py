"""Attention: RoPE convention, document masks, GQA mapping, backends agree (spec §4.4 steps 1-6)."""

import importlib.util
import math

import pytest
import torch

from torchtitan_loom.models.loom import LoomTransformer, loom_flavors
from torchtitan_loom.models.loom.attention import (
    GatedAttention,
    apply_rope,
    attend,
    build_attention_mask,
    document_cu_seqlens,
    rope_cos_sin,
)


def debug_model(**changes) -> LoomTransformer:
    model = LoomTransformer(loom_flavors["debug"].replace(**changes))
    model.init_weights()
    return model


def test_rope_rotates_pair_i_with_pair_i_plus_half_by_position_times_frequency():
    d, theta = 8, 10000.0
    positions = torch.tensor([[0, 3, 17]])
    x = torch.randn(1, 3, 1, d, dtype=torch.float64).float()
    out = apply_rope(x, *rope_cos_sin(positions, d, theta))
    for s, p in enumerate(positions[0].tolist()):
        for i in range(d // 2):
            angle = p * theta ** (-2 * i / d)
            a, b = x[0, s, 0, i].item(), x[0, s, 0, i + d // 2].item()
            assert out[0, s, 0, i].item() == pytest.approx(
                a * math.cos(angle) - b * math.sin(angle), abs=1e-5
            )
            assert out[0, s, 0, i + d // 2].item() == pytest.approx(
                b * math.cos(angle) + a * math.sin(angle), abs=1e-5
            )


def test_rope_scores_depend_only_on_relative_position_and_keep_dtype():
    d = 64
    q, k = torch.randn(1, 1, 1, d), torch.randn(1, 1, 1, d)

    def score(pq, pk):
        cq, sq = rope_cos_sin(torch.tensor([[pq]]), d, 1e4)
        ck, sk = rope_cos_sin(torch.tensor([[pk]]), d, 1e4)
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum().item()

    assert score(10, 4) == pytest.approx(score(106, 100), abs=1e-4)
    assert (
        apply_rope(q.bfloat16(), *rope_cos_sin(torch.tensor([[5]]), d, 1e4)).dtype == torch.bfloat16
    )


def test_sdpa_mask_is_same_document_and_causal():
    doc = torch.tensor([[0, 0, 1, 1, 1, -1], [2, 2, 2, 2, 2, 2]])
    mask = build_attention_mask("sdpa", doc).kernel
    assert mask.shape == (2, 1, 6, 6) and mask.dtype == torch.bool
    for b in range(2):
        for i in range(6):
            for j in range(6):
                assert mask[b, 0, i, j].item() == (doc[b, i].item() == doc[b, j].item() and j <= i)


def test_varlen_segments_split_documents_and_rows():
    doc = torch.tensor([[0, 0, 1, 1, 1, -1], [1, 1, 1, 2, 2, 2]])  # doc 1 at the row boundary
    assert document_cu_seqlens(doc).tolist() == [0, 2, 5, 6, 9, 12]
    assert document_cu_seqlens(doc).dtype == torch.int32


def test_gqa_query_head_h_uses_kv_head_h_div_group():
    B, S, H, K, d = 1, 5, 4, 2, 8
    q, k, v = torch.randn(B, S, H, d), torch.randn(B, S, K, d), torch.randn(B, S, K, d)
    mask = build_attention_mask("sdpa", torch.zeros(B, S, dtype=torch.long))
    out = attend("sdpa", q, k, v, mask.kernel)
    v2 = v.clone()
    v2[:, :, 1] += 1.0  # touch kv head 1 only
    out2 = attend("sdpa", q, k, v2, mask.kernel)
    assert torch.equal(out[:, :, :2], out2[:, :, :2]) and not torch.equal(
        out[:, :, 2:], out2[:, :, 2:]
    )


def test_output_gate_and_fused_projection_order():
    args = loom_flavors["debug"]
    attn = GatedAttention(args)
    torch.nn.init.normal_(attn.wqkv.weight, std=0.1)
    torch.nn.init.normal_(attn.wo.weight, std=0.1)
    h = torch.randn(1, 4, args.dim)
    rope = rope_cos_sin(torch.arange(4)[None], args.head_dim, args.rope_theta)
    mask = build_attention_mask("sdpa", torch.zeros(1, 4, dtype=torch.long))
    base = attn(h, rope, mask)
    with torch.no_grad():  # rows 64..127 are head 1's gate: zero them -> sigmoid(0) = 1/2 on head 1
        attn.wqkv.weight[64:128].zero_()
    expected_half = attn(h, rope, mask)
    gate, q, k, v = attn.wqkv(h).split([128, 128, 64, 64], dim=-1)
    assert torch.all(gate[..., 64:] == 0)
    # with gate logits 0, head 1 output is exactly half of the ungated attention
    qr = apply_rope(q.view(1, 4, 2, 64), *rope)
    kr = apply_rope(k.view(1, 4, 1, 64), *rope)
    plain = attend("sdpa", qr, kr, v.view(1, 4, 1, 64), mask.kernel)
    gated = torch.cat(
        [torch.sigmoid(gate[..., :64]).view(1, 4, 1, 64) * plain[:, :, :1], 0.5 * plain[:, :, 1:]],
        2,
    )
    torch.testing.assert_close(expected_half, attn.wo(gated.reshape(1, 4, 128)), rtol=0, atol=1e-6)
    assert not torch.allclose(base, expected_half)


def _row_with_two_docs(seed: int):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 512, (1, 32), generator=g)
    doc = torch.tensor([[0] * 10 + [1] * 22])
    positions = torch.cat([torch.arange(10), torch.arange(22)])[None]
    return tokens, positions, doc


def test_changing_document_a_never_changes_outputs_at_document_b():
    # capacity_factor=0: capacity dropping couples all tokens of a micro-batch by design (spec
    # §4.6), which is not what this test is about.
    model = debug_model(capacity_factor=0.0)
    tokens, positions, doc = _row_with_two_docs(0)
    other = tokens.clone()
    other[0, :10] = torch.randint(0, 512, (10,), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        a = model(tokens, positions, doc).logits_BSV
        b = model(other, positions, doc).logits_BSV
    # Masked keys contribute exactly 0; what remains is the expert GEMMs batching rows differently
    # when other tokens change (fp32 reassociation, ~1e-6). A leak would be O(0.1): see control.
    torch.testing.assert_close(a[0, 10:], b[0, 10:], rtol=0, atol=1e-5)
    assert not torch.allclose(a[0, :10], b[0, :10])
    with torch.no_grad():  # control: one document -> the same change does reach B's positions
        one_doc = torch.zeros_like(doc)
        leak = (
            model(tokens, positions, one_doc).logits_BSV
            - model(other, positions, one_doc).logits_BSV
        )
    assert leak[0, 10:].abs().max() > 1e-2
    # positions restart per document: document B alone at the start of a row gives the same logits
    alone = torch.zeros(1, 32, dtype=torch.long)
    alone[0, :22] = tokens[0, 10:]
    alone_doc = torch.tensor([[0] * 22 + [-1] * 10])
    alone_pos = torch.cat([torch.arange(22), torch.zeros(10, dtype=torch.long)])[None]
    with torch.no_grad():
        c = model(alone, alone_pos, alone_doc).logits_BSV
    # same math, different attention row lengths -> fp32 reassociation only
    torch.testing.assert_close(c[0, :22], a[0, 10:], rtol=0, atol=1e-5)


def test_flex_backend_equals_sdpa_on_cpu_without_grad_and_refuses_backward():
    sdpa, flex = debug_model(), debug_model(attn_backend="flex")
    tokens, positions, doc = _row_with_two_docs(1)
    with torch.no_grad():
        ref = sdpa(tokens, positions, doc).logits_BSV
        out = flex(tokens, positions, doc).logits_BSV
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)  # different kernels, fp32 reassociation
    with pytest.raises(RuntimeError, match="attn_backend='flex' has no backward on CPU"):
        flex(tokens, positions, doc)


@pytest.mark.skipif(
    importlib.util.find_spec("flash_attn") is not None, reason="flash_attn is installed"
)
def test_flash_attn_backend_without_the_package_says_what_to_do():
    model = debug_model(attn_backend="flash_attn")
    tokens, positions, doc = _row_with_two_docs(2)
    with pytest.raises(ImportError, match="attn_backend='flash_attn' needs the flash-attn package"):
        model(tokens, positions, doc)


def _padded_batch():
    """Row 0: two documents + 3 padding slots; row 1: padding only (doc id -1 everywhere)."""
    doc = torch.tensor([[0, 0, 0, 1, 1, -1, -1, -1], [-1] * 8])
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 0], [0] * 8])
    return positions, doc


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_padding_queries_get_exactly_zero_attention_output(backend):
    # LOOM_SPEC §4.4 step 4: padding rows get zero output, with no NaN even for a fully padded row.
    from torchtitan_loom.models.loom.args import LoomModelArgs

    args = LoomModelArgs(
        vocab_size=512,
        n_layers=1,
        expert_intermediate_size=64,
        dim=128,
        n_heads=2,
        n_kv_heads=1,
        attn_backend=backend,
    )
    attn = GatedAttention(args)
    positions, doc = _padded_batch()
    h = torch.randn(2, 8, 128, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = attn(h, rope_cos_sin(positions, 64, 1e4), build_attention_mask(backend, doc))
    assert torch.isfinite(out).all()
    assert out[doc == -1].abs().max().item() == 0.0
    assert out[doc != -1].abs().min().item() > 0.0
    # Real tokens are unchanged by whatever sits in the padding slots.
    h2 = h.clone()
    h2[doc == -1] = torch.randn(int((doc == -1).sum()), 128)
    with torch.no_grad():
        out2 = attn(h2, rope_cos_sin(positions, 64, 1e4), build_attention_mask(backend, doc))
    torch.testing.assert_close(out2[doc != -1], out[doc != -1], rtol=0, atol=0)


def test_padding_output_has_finite_zero_gradients():
    from torchtitan_loom.models.loom.args import LoomModelArgs

    attn = GatedAttention(
        LoomModelArgs(
            vocab_size=512,
            n_layers=1,
            expert_intermediate_size=64,
            dim=128,
            n_heads=2,
            n_kv_heads=1,
        )
    )
    positions, doc = _padded_batch()
    h = torch.randn(2, 8, 128, generator=torch.Generator().manual_seed(4), requires_grad=True)
    attn(h, rope_cos_sin(positions, 64, 1e4), build_attention_mask("sdpa", doc)).sum().backward()
    assert torch.isfinite(h.grad).all()
    assert h.grad[1].abs().max().item() == 0.0  # a fully padded row influences nothing
