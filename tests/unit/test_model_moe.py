"""MoE layer: capacity, the keep/drop rule, bias vs gate weights, grouped == loop, z-loss (spec §4.6)."""

import math

import pytest
import torch
import torch.nn.functional as F

from torchtitan_loom.models.loom import loom_flavors
from torchtitan_loom.models.loom.moe import LoomMoE, capacity_plan, expert_capacity, route


def small_moe(**changes) -> LoomMoE:
    args = loom_flavors["debug"].replace(dim=64, n_heads=1, expert_intermediate_size=32, **changes)
    moe = LoomMoE(args)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return moe


# ---------------------------------------------------------------- capacity


def test_capacity_values_of_the_presets():
    a = loom_flavors["loom_329m"]
    assert (
        expert_capacity(16 * 1023, a.routed_top_k, a.num_routed_experts, a.capacity_factor) == 4910
    )
    assert (
        expert_capacity(8 * 1023, a.routed_top_k, a.num_routed_experts, a.capacity_factor) == 2455
    )
    assert expert_capacity(1, 1, 30, 1.5) == 1  # floor(0.05) -> at least 1
    assert expert_capacity(100, 6, 30, 0.0) is None  # 0 disables dropping


def test_keep_rule_on_a_hand_built_case():
    # E=3, K=2, N=4 tokens, capacity 2.
    expert_NK = torch.tensor([[0, 1], [1, 0], [0, 2], [0, 1]])
    gate_NK = torch.tensor([[0.7, 0.3], [0.55, 0.45], [0.7, 0.3], [0.9, 0.1]])
    order_A, counts_E, kept_E, new_gate_NK = capacity_plan(expert_NK, gate_NK, 3, capacity=2)
    # expert 0 gets t0 .7 (flat 0), t1 .45 (flat 3), t2 .7 (flat 4), t3 .9 (flat 6): keeps t3, then
    #   the .7 tie goes to the lower flat index t0; t1 and t2 are dropped there.
    # expert 1 gets t0 .3, t1 .55, t3 .1: keeps t1, t0; drops t3.   expert 2 keeps t2.
    expected = torch.tensor([[0.7, 0.3], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    torch.testing.assert_close(new_gate_NK, expected, rtol=0, atol=1e-7)
    assert counts_E.tolist() == [4, 3, 1] and kept_E.tolist() == [2, 2, 1]
    assert counts_E.dtype == kept_E.dtype == torch.int64
    # grouped by expert; inside an expert by weight desc, ties to the lower flat index
    assert order_A.tolist() == [6, 0, 4, 3, 2, 1, 7, 5]


def test_token_that_loses_every_slot_gets_zero_weights_and_undropped_tokens_keep_theirs():
    expert_NK = torch.tensor([[0, 1], [0, 1], [1, 2]])
    gate_NK = torch.tensor([[0.6, 0.4], [0.5, 0.5], [0.8, 0.2]])
    _, _, kept_E, new_gate_NK = capacity_plan(expert_NK, gate_NK, 3, capacity=1)
    # expert 0: t0 .6 > t1 .5 -> keep t0; expert 1: t2 .8 > t1 .5 > t0 .4 -> keep t2.
    torch.testing.assert_close(
        new_gate_NK, torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.8, 0.2]]), rtol=0, atol=0
    )
    assert kept_E.tolist() == [1, 1, 1]


def naive_moe(moe: LoomMoE, x_ND: torch.Tensor, router_w: torch.Tensor, capacity) -> torch.Tensor:
    """Token-by-token Python reference of spec §4.6, with the keep rule written as a sort per expert."""
    E, K = moe.num_experts, moe.top_k
    scores = torch.sigmoid(x_ND @ router_w.t())
    picks = []
    for n in range(x_ND.shape[0]):
        chosen = sorted(range(E), key=lambda e: -(scores[n, e] + moe.expert_bias[e]).item())[:K]
        total = sum(scores[n, e].item() for e in chosen)
        picks.append([[e, scores[n, e].item() / total] for e in chosen])
    if capacity is not None:
        for e in range(E):
            slots = [
                (-p[j][1], n * K + j) for n, p in enumerate(picks) for j in range(K) if p[j][0] == e
            ]
            for _, flat in sorted(slots)[capacity:]:
                picks[flat // K][flat % K][1] = 0.0
        for p in picks:
            kept = sum(w for _, w in p)
            if any(w == 0.0 for _, w in p):
                for slot in p:
                    slot[1] = slot[1] / kept if kept > 0 else 0.0
    y = torch.zeros_like(x_ND)
    for n, p in enumerate(picks):
        for e, w in p:
            g, u = (x_ND[n] @ moe.experts.w13[e].t()).chunk(2)
            y[n] += w * ((F.silu(g) * u) @ moe.experts.w2[e].t())
        for shared in moe.shared_experts:
            g, u = (x_ND[n] @ shared.w13.weight.t()).chunk(2)
            y[n] += (F.silu(g) * u) @ shared.w2.weight.t()
    return y


@pytest.mark.parametrize("capacity_factor", [0.5, 0.0])
def test_module_matches_token_by_token_reference(capacity_factor):
    moe = small_moe(capacity_factor=capacity_factor)
    with torch.no_grad():
        moe.expert_bias.copy_(torch.linspace(-0.2, 0.2, 8))
    x_BSD = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y_BSD, kept_E, z_sq = moe(x_BSD, moe.routers[0])
        capacity = expert_capacity(24, 2, 8, capacity_factor)
        expected = naive_moe(moe, x_BSD.view(24, 64), moe.routers[0], capacity)
    # fp32, different summation orders only: 1e-5 absolute on O(1) outputs
    torch.testing.assert_close(y_BSD.view(24, 64), expected, rtol=0, atol=1e-5)
    if capacity is None:
        assert kept_E.sum() == 24 * 2
    else:
        assert capacity == 3 and kept_E.max() <= 3 and kept_E.sum() < 48  # something was dropped
    assert z_sq.item() == 0.0


def test_bias_changes_selection_not_gate_weights():
    g = torch.Generator().manual_seed(2)
    x_ND, router_ED = torch.randn(16, 32, generator=g), torch.randn(6, 32, generator=g)
    bias_E = torch.zeros(6)
    _, experts0, gates0 = route(x_ND, router_ED, bias_E, top_k=2)
    bias_E[5] = 10.0  # forces expert 5 into every token's selection
    logits, experts1, gates1 = route(x_ND, router_ED, bias_E, top_k=2)
    assert (experts1 == 5).any(dim=1).all() and not torch.equal(experts0, experts1)
    scores = torch.sigmoid(logits)
    chosen = scores.gather(1, experts1)
    torch.testing.assert_close(gates1, chosen / chosen.sum(1, keepdim=True), rtol=0, atol=1e-7)
    # a bias shift common to all experts changes nothing at all
    _, experts2, gates2 = route(x_ND, router_ED, torch.full((6,), 3.0), top_k=2)
    assert torch.equal(experts2, experts0) and torch.equal(gates2, gates0)


def test_grouped_gemm_equals_loop_fallback_forward_and_backward():
    grouped, loop = small_moe(moe_impl="grouped"), small_moe(moe_impl="loop")
    with torch.no_grad():  # leave one expert without tokens
        for m in (grouped, loop):
            m.expert_bias[3] = -5.0
    x1 = torch.randn(3, 20, 64, generator=torch.Generator().manual_seed(3), requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    y1, kept1, _ = grouped(x1, grouped.routers[0])
    y2, kept2, _ = loop(x2, loop.routers[0])
    assert kept1[3] == 0 and torch.equal(kept1, kept2)
    torch.testing.assert_close(y1, y2, rtol=0, atol=1e-6)
    grad_y = torch.randn_like(y1)
    y1.backward(grad_y)
    y2.backward(grad_y)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=0, atol=1e-6)
    for (name, p1), p2 in zip(grouped.named_parameters(), loop.parameters()):
        torch.testing.assert_close(p1.grad, p2.grad, rtol=0, atol=1e-6, msg=name)


def test_z_loss_term_is_mean_squared_logsumexp_when_enabled():
    moe = small_moe(router_z_loss_coef=1e-3)
    x_BSD = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(4))
    _, _, z_sq = moe(x_BSD, moe.routers[0])
    logits = x_BSD.view(10, 64) @ moe.routers[0].t()
    torch.testing.assert_close(z_sq, torch.logsumexp(logits, -1).pow(2).mean(), rtol=1e-6, atol=0)


def test_router_logits_stay_fp32_under_bf16_autocast():
    # Trainer runs bf16 compute via autocast on a single process; the router must stay fp32 (§4.6).
    torch.manual_seed(0)
    x_ND = torch.randn(64, 32)
    router_ED = torch.randn(8, 32)
    bias_E = torch.zeros(8)
    want = x_ND.double() @ router_ED.double().t()
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        logits_NE, _, _ = route(x_ND, router_ED, bias_E, 2)
    assert logits_NE.dtype == torch.float32
    torch.testing.assert_close(logits_NE.double(), want, rtol=1e-5, atol=1e-5)
