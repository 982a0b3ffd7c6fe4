"""Parity of the LOOM model with the independent loop-by-loop reference in loom_reference.py.

Part 1 checks the reference itself against the numbers printed in LOOM_SPEC §4.3, §4.6 and §13.
Part 2 builds the real model through the public TrainSpec API and compares logits, carries and
expert counts with the reference on a small batch with several documents per row and padding.

Tolerance: the reference runs in float64, the model in float32. Every block re-normalises the
stream to unit RMS and the weights are ~1/√d-scaled, so all intermediates are O(1); the logits
go through a few hundred fp32 ops (each rounding ≈ 6e-8 relative), which bounds the model's
error at ~1e-6 on O(1) logits. 1e-5 leaves a 10× margin and is still far below any real
deviation (a wrong γ, g_t, router, bias or mask changes logits by ≥ 1e-3 here).

Shape legend: B rows, S sequence, V vocab, D dim, L layers, T loops, E routed experts.
"""

import dataclasses

import pytest
import torch
from loom_reference import (
    capacity,
    ema_read,
    ema_write,
    gamma,
    inject_g,
    reference_forward,
    rope,
)

ATOL = 1e-5
CFG_FIELDS = (
    "vocab_size dim n_layers n_heads n_kv_heads num_loops num_routed_experts num_shared_experts "
    "top_k top_k_includes_shared expert_intermediate_size capacity_factor cycle_residual_scale "
    "cycle_scale_lambda embed_inject_mode ffn_branch_rms looping_residual looping_residual_beta "
    "router_per_loop per_layer_out_norm rope_theta norm_eps"
).split()
# Small shapes: head dim 64 as in the presets, 8 routed experts, routed top-2 + 1 shared.
SMALL = dict(
    vocab_size=512,
    dim=128,
    n_layers=2,
    n_heads=2,
    n_kv_heads=1,
    num_routed_experts=8,
    num_shared_experts=1,
    top_k=3,
    top_k_includes_shared=True,
    expert_intermediate_size=32,
    capacity_factor=1.5,
)
# Row 0: documents of 7, 10, 5 tokens + 2 padding; row 1: 3, 15 tokens + 6 padding.
DOC_LENGTHS = ([7, 10, 5], [3, 15])
S = 24


# ---------------------------------------------------------------------------------------------
# Part 1: the reference against the spec's own numbers


@pytest.mark.parametrize(
    "H, eps10, eps15",
    [
        (1, 0.158114, 0.129099),
        (3, 0.052705, 0.043033),
        (6, 0.026352, 0.021517),
        (9, 0.017568, 0.014344),
        (12, 0.013176, 0.010758),
    ],
)
def test_gamma_matches_spec_table(H, eps10, eps15):
    assert gamma(H, 10, 0.5) == pytest.approx(eps10, abs=5e-7)
    assert gamma(H, 15, 0.5) == pytest.approx(eps15, abs=5e-7)


def test_inject_g_matches_spec_table():
    g10 = [
        0.07906,
        0.05270,
        0.03953,
        0.03162,
        0.02635,
        0.02259,
        0.01976,
        0.01757,
        0.01581,
        0.01437,
        0.01318,
    ]
    g15 = [
        0.06455,
        0.04303,
        0.03227,
        0.02582,
        0.02152,
        0.01844,
        0.01614,
        0.01434,
        0.01291,
        0.01174,
        0.01076,
    ]
    for t, (a, b) in enumerate(zip(g10, g15), start=2):
        assert inject_g(t, 10, 0.5) == pytest.approx(a, abs=5e-6)
        assert inject_g(t, 15, 0.5) == pytest.approx(b, abs=5e-6)
        assert inject_g(t, 10, 0.5) == pytest.approx(gamma(t, 10, 0.5))  # g_H = ε (§4.3)
    assert inject_g(1, 1, 4.0) == 1.0  # clamped to [0, 1]


def test_looping_residual_denominators_and_cascade():
    u = torch.randn(3, 1, 5, dtype=torch.float64)
    l_num = l_den = h_num = h_den = None
    for n, want in enumerate([1.0, 1.5, 1.75], start=1):
        l_num, l_den = ema_write(l_num, l_den, u, 0.5)
        r_l = ema_read(l_num, l_den)
        h_num, h_den = ema_write(h_num, h_den, r_l, 0.5)
        r_h = ema_read(h_num, h_den)
        assert torch.all(l_den == want) and torch.all(h_den == want)
        assert want == 2 * (1 - 2.0**-n)  # closed form of §4.4
        torch.testing.assert_close(r_h + r_l, 2 * u)  # constant o = u → each write is 2u (§13)


def test_capacity_matches_spec_numbers():
    assert capacity(1.5, 16 * 1023, 6, 30) == 4910
    assert capacity(1.5, 8 * 1023, 6, 30) == 2455
    assert capacity(0.0, 100, 6, 30) is None
    assert capacity(0.01, 10, 1, 30) == 1


def test_rope_is_relative():
    q, k = torch.randn(2, 1, 1, 64, dtype=torch.float64)

    def score(pq, pk):
        return (rope(q, torch.tensor([pq]), 1e4) * rope(k, torch.tensor([pk]), 1e4)).sum()

    assert score(7, 3) == pytest.approx(float(score(104, 100)), abs=1e-10)
    torch.testing.assert_close(rope(q, torch.tensor([0]), 1e4), q)


def random_state_dict(cfg, seed=0):
    """Random weights with the CONTRACTS.md names, for reference-only checks."""
    g = torch.Generator().manual_seed(seed)
    D, I, E = cfg["dim"], cfg["expert_intermediate_size"], cfg["num_routed_experts"]
    hd = D // cfg["n_heads"]

    def r(*shape, std):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * std

    sd = {
        "tok_embeddings.weight": r(cfg["vocab_size"], D, std=D**-0.5),
        "output.weight": r(cfg["vocab_size"], D, std=D**-0.5),
    }
    for l in range(cfg["n_layers"]):
        p = f"layers.{l}."
        sd[p + "attention.wqkv.weight"] = r(
            (2 * cfg["n_heads"] + 2 * cfg["n_kv_heads"]) * hd, D, std=D**-0.5
        )
        sd[p + "attention.wo.weight"] = r(D, cfg["n_heads"] * hd, std=D**-0.5)
        for t in range(cfg["num_loops"]):
            sd[p + f"moe.routers.{t}"] = r(E, D, std=D**-0.5)
        sd[p + "moe.expert_bias"] = r(E, std=0.05)
        sd[p + "moe.experts.w13"] = r(E, 2 * I, D, std=D**-0.5)
        sd[p + "moe.experts.w2"] = r(E, D, I, std=I**-0.5)
        for s in range(cfg["num_shared_experts"]):
            sd[p + f"moe.shared_experts.{s}.w13.weight"] = r(2 * I, D, std=D**-0.5)
            sd[p + f"moe.shared_experts.{s}.w2.weight"] = r(D, I, std=I**-0.5)
        sd[p + "ffn_branch_norm.weight"] = 1 + r(D, std=0.1)
    return sd


def default_cfg(**over):
    cfg = dict(
        SMALL,
        num_loops=3,
        cycle_residual_scale=True,
        cycle_scale_lambda=0.5,
        embed_inject_mode="loop_start_mix_soft",
        ffn_branch_rms="affine",
        looping_residual=True,
        looping_residual_beta=0.5,
        router_per_loop=True,
        per_layer_out_norm=True,
        rope_theta=10000.0,
        norm_eps=1e-6,
    )
    cfg.update(over)
    return cfg


def make_batch(vocab_size, seed=0, canonical_padding=False):
    """tokens/positions/doc ids [2, S]: several documents per row, right padding (doc id -1).

    Canonical padding (token 0, position 0, as the loader makes it) gives padding slots states that
    are equal up to rounding noise, so under capacity pressure which of them is dropped is decided
    by that noise (differently in fp32 and fp64). By default padding therefore gets random tokens
    and ascending positions: the model must not care, and every position becomes comparable.
    """
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, vocab_size, (len(DOC_LENGTHS), S), generator=g)
    positions = torch.zeros_like(tokens)
    doc_ids = torch.full_like(tokens, -1)
    for b, lengths in enumerate(DOC_LENGTHS):
        start = 0
        for d, n in enumerate(lengths):
            positions[b, start : start + n] = torch.arange(n)
            doc_ids[b, start : start + n] = d
            start += n
        if canonical_padding:
            tokens[b, start:] = 0
        else:
            positions[b, start:] = torch.arange(S - start)
    return tokens, positions, doc_ids


def test_reference_documents_are_isolated_and_segments_compose():
    cfg = default_cfg(
        capacity_factor=0.0, num_loops=2
    )  # no capacity: tokens only couple via attention
    sd = random_state_dict(cfg)
    tokens, pos, docs = make_batch(cfg["vocab_size"])
    full, carry_full = reference_forward(sd, cfg, tokens, pos, docs)
    changed = tokens.clone()
    changed[0, 7:17] = (changed[0, 7:17] + 1) % cfg["vocab_size"]  # row 0, document 1 only
    other, _ = reference_forward(sd, cfg, changed, pos, docs)
    keep = torch.ones(len(DOC_LENGTHS), S, dtype=torch.bool)
    keep[0, 7:17] = False
    torch.testing.assert_close(other[keep], full[keep], rtol=0, atol=1e-12)
    assert (other[0, 7:17] - full[0, 7:17]).abs().max() > 1e-3
    # [1,1] then [2,2] with the carry equals [1,2]
    _, carry = reference_forward(sd, cfg, tokens, pos, docs, loop_end=1)
    seg, carry_seg = reference_forward(sd, cfg, tokens, pos, docs, loop_start=2, carry=carry)
    torch.testing.assert_close(seg, full, rtol=0, atol=1e-12)
    for a, b in zip(carry_seg, carry_full):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Part 2: the model against the reference


def build_model(H=3, **over):
    """Model from the public TrainSpec API, with expert bias, routers and norm weight perturbed."""
    from torchtitan_loom.protocols import get_train_spec

    spec = get_train_spec("loom")
    args = dataclasses.replace(spec.model_args["debug"], **{**SMALL, "num_loops": H, **over})
    args.validate()
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            # init copies router 0 into every loop and sets bias 0 / norm weight 1; perturb them so
            # that per-loop routers, the bias selection path and the affine weight are exercised
            if ".moe.routers." in name or name.endswith("expert_bias"):
                t.add_(torch.randn(t.shape, generator=g) * 0.05)
            elif name.endswith("ffn_branch_norm.weight"):
                t.add_(torch.randn(t.shape, generator=g) * 0.1)
    cfg = {f: getattr(args, f) for f in CFG_FIELDS if hasattr(args, f)}
    cfg.setdefault("per_layer_out_norm", True)
    missing = set(CFG_FIELDS) - set(cfg)
    assert not missing, f"LoomModelArgs lacks fields {sorted(missing)}"
    return model, cfg


def check_counts(out, stats, loop_start, n_layers):
    """Model's kept-assignment counts [L, T, E] equal the reference's for the loops of `out`."""
    counts_LTE = out.counts_LTE
    assert counts_LTE.shape[0] == n_layers
    loop_end = loop_start + counts_LTE.shape[1] - 1
    for (l, t), want in stats["counts"].items():
        if loop_start <= t <= loop_end:
            assert counts_LTE[l, t - loop_start].tolist() == want, f"layer {l} loop {t}"


def run_parity(H=3, **over):
    model, cfg = build_model(H, **over)
    tokens, pos, docs = make_batch(cfg["vocab_size"])
    sd = model.state_dict()
    with torch.no_grad():
        out = model(tokens, pos, docs)
    stats = {}
    want, (z, h_num, h_den) = reference_forward(sd, cfg, tokens, pos, docs, stats=stats)
    assert out.logits_BSV.dtype == torch.float32
    assert torch.isfinite(out.logits_BSV).all()  # padding included
    torch.testing.assert_close(out.logits_BSV.double(), want, rtol=0, atol=ATOL)
    torch.testing.assert_close(out.carry.z_BSD.double(), z, rtol=0, atol=ATOL)
    if cfg["looping_residual"]:
        torch.testing.assert_close(out.carry.h_num_BSD.double(), h_num, rtol=0, atol=ATOL)
        torch.testing.assert_close(out.carry.h_den_BS1.double(), h_den, rtol=0, atol=ATOL)
    check_counts(out, stats, 1, cfg["n_layers"])
    return stats


@pytest.mark.parametrize("H", [3, 4])
def test_full_forward_parity(H):
    run_parity(H)


def test_capacity_dropping_parity():
    stats = run_parity(3, capacity_factor=0.5)
    assert stats["dropped"] > 0


@pytest.mark.parametrize(
    "ablation",
    [
        dict(cycle_residual_scale=False),
        dict(embed_inject_mode="none"),
        dict(ffn_branch_rms="none"),
        dict(looping_residual=False),
        dict(router_per_loop=False),
    ],
    ids=lambda a: next(iter(a)),
)
def test_ablation_parity(ablation):
    run_parity(3, **ablation)


def test_segmented_parity():
    """[1,2] then [3,4] with the model's carry equals the reference's single [1,4] run."""
    model, cfg = build_model(4)
    tokens, pos, docs = make_batch(cfg["vocab_size"], seed=3)
    sd = model.state_dict()
    with torch.no_grad():
        first = model(tokens, pos, docs, loop_start=1, loop_end=2)
        second = model(tokens, pos, docs, loop_start=3, loop_end=4, carry=first.carry)
    stats = {}
    full, _ = reference_forward(sd, cfg, tokens, pos, docs, stats=stats)
    torch.testing.assert_close(second.logits_BSV.double(), full, rtol=0, atol=ATOL)
    check_counts(second, stats, 3, cfg["n_layers"])
    mid, (z, h_num, h_den) = reference_forward(sd, cfg, tokens, pos, docs, loop_end=2)
    torch.testing.assert_close(first.logits_BSV.double(), mid, rtol=0, atol=ATOL)
    torch.testing.assert_close(first.carry.z_BSD.double(), z, rtol=0, atol=ATOL)
    torch.testing.assert_close(first.carry.h_num_BSD.double(), h_num, rtol=0, atol=ATOL)
    torch.testing.assert_close(first.carry.h_den_BS1.double(), h_den, rtol=0, atol=ATOL)
    check_counts(first, stats, 1, cfg["n_layers"])
    assert first.counts_LTE.shape[1] == 2 and second.counts_LTE.shape[1] == 2


def test_aux_loss_is_router_z_loss():
    from torchtitan_loom.protocols import get_train_spec

    if not hasattr(get_train_spec("loom").model_args["debug"], "router_z_loss_coef"):
        pytest.fail("LoomModelArgs has no router_z_loss_coef field (CONTRACTS.md out.aux_loss)")
    model, cfg = build_model(3, router_z_loss_coef=1e-2)
    tokens, pos, docs = make_batch(cfg["vocab_size"])
    with torch.no_grad():
        out = model(tokens, pos, docs)
    stats = {}
    reference_forward(model.state_dict(), cfg, tokens, pos, docs, stats=stats)
    want = 1e-2 * sum(stats["z_sq"].values())
    assert float(out.aux_loss) == pytest.approx(want, rel=1e-5)


def test_canonical_padding_real_tokens_parity():
    """Loader-style padding (token 0, position 0, doc id -1): real tokens match, padding is finite."""
    model, cfg = build_model(3)
    tokens, pos, docs = make_batch(cfg["vocab_size"], canonical_padding=True)
    with torch.no_grad():
        out = model(tokens, pos, docs)
    want, _ = reference_forward(model.state_dict(), cfg, tokens, pos, docs)
    assert torch.isfinite(out.logits_BSV).all()
    real = docs >= 0
    torch.testing.assert_close(out.logits_BSV.double()[real], want[real], rtol=0, atol=ATOL)


def test_capacity_ties_keep_lower_flat_index():
    """Row 1 is a copy of row 0, so every routing weight is tied exactly between the two rows.

    With an odd capacity (C = 5) some expert's cutoff falls inside a tied pair; §4.6 item 7 keeps
    the lower flat index (row 0), so the two rows' outputs differ, the same way in both. (Relies on
    the model giving bitwise-equal states to equal rows before the first drop, true on CPU here.)
    """
    model, cfg = build_model(3, capacity_factor=0.45)
    tokens, pos, docs = make_batch(cfg["vocab_size"])
    tokens[1], pos[1], docs[1] = tokens[0], pos[0], docs[0]
    with torch.no_grad():
        out = model(tokens, pos, docs)
    want, _ = reference_forward(model.state_dict(), cfg, tokens, pos, docs)
    assert (want[0] - want[1]).abs().max() > 1e-3  # a tie was actually broken
    torch.testing.assert_close(out.logits_BSV.double(), want, rtol=0, atol=ATOL)
