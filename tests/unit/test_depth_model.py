"""Depth past the trained H and per-token exit in the model (models/loom/depth.py, kv_hold.py) and
the criteria (components/evaluation/adaptive_exit.py), against independent computations:

- a loop past H under "last" / "cycle" equals a model built with H + 1 loops whose extra router is
  a copy of router H / router 1 (residual scaling off, so gamma does not depend on H);
- an exited token's K/V in deeper loops are its exit loop's: whole-sequence exits (hold) against
  the same exits decoded one token at a time through the cache (hold.fill for loops not run);
- threshold 0 is fixed depth exactly; KL and confidence against torch's own formulas.
"""

import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from test_model_forward import batch, debug_model

from torchtitan_loom.components.evaluation.adaptive_exit import (
    adaptive_pass,
    settle_score,
    threshold_problem,
)
from torchtitan_loom.components.evaluation.sampling import DepthUsed, SamplingConfig, generate
from torchtitan_loom.components.loss import token_ce_sum
from torchtitan_loom.loop_request import LoopRequest
from torchtitan_loom.models.loom import LoomTransformer


def trained_like(H=2, **changes) -> LoomTransformer:
    """A debug model whose routers differ per loop (at init they are copies of router 0)."""
    model = debug_model(num_loops=H, capacity_factor=0.0, **changes).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.layers:
            for r in layer.moe.routers:
                r.add_(torch.randn(r.shape, generator=g) * 0.5)
    return model


@pytest.mark.parametrize("policy, extra_router", [("last", 1), ("cycle", 0)])
def test_a_loop_past_h_uses_the_policys_router(policy, extra_router):
    short = trained_like(H=2, cycle_residual_scale=False)
    deep = LoomTransformer(short.args.replace(num_loops=3))
    state = short.state_dict()
    for i, layer in enumerate(short.layers):  # router 3 of the deeper model: the policy's copy
        state[f"layers.{i}.moe.routers.2"] = layer.moe.routers[extra_router].detach().clone()
    deep.load_state_dict(state)
    deep.eval()
    tokens, positions, doc = batch()
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"loops past the trained H=2 need a policy"):
            short(tokens, positions, doc, loop_end=3)
        short.set_beyond_policy(policy)
        got = short(tokens, positions, doc, loop_end=3).logits_BSV
        want = deep(tokens, positions, doc, loop_end=3).logits_BSV
        other = "cycle" if policy == "last" else "last"
        short.set_beyond_policy(other)
        differs = short(tokens, positions, doc, loop_end=3).logits_BSV
    assert torch.equal(got, want)
    assert not torch.allclose(got, differs)  # the routers differ: the test can tell them apart
    with pytest.raises(ValueError, match="valid last, cycle"):
        short.set_beyond_policy("wrap")


def test_an_empty_hold_changes_nothing():
    model = trained_like(H=3)
    tokens, positions, doc = batch()
    with torch.no_grad():
        full = model(tokens, positions, doc).logits_BSV
        hold, carry = model.new_exit_hold(), None
        for t in range(1, 4):
            out = model(tokens, positions, doc, t, t, carry=carry, request=LoopRequest(hold=hold))
            carry = out.carry
    assert torch.equal(out.logits_BSV, full)


def hold_pass(model, tokens_1S, exit_loop_S, max_loops):
    """Whole-sequence pass where position s exits after loop exit_loop_S[s]: the logits [S, V] at
    each position's exit loop."""
    S = tokens_1S.shape[1]
    positions, doc = torch.arange(S)[None], torch.zeros_like(tokens_1S)
    hold, carry = model.new_exit_hold(), None
    logits_SV = torch.zeros(S, model.args.vocab_size)
    for t in range(1, max_loops + 1):
        out = model(tokens_1S, positions, doc, t, t, carry=carry, request=LoopRequest(hold=hold))
        carry = out.carry
        now_S = exit_loop_S == t
        logits_SV[now_S] = out.logits_BSV[0, now_S]
        hold.exit(now_S[None])
    return logits_SV


@pytest.mark.parametrize("criterion, threshold", [("kl", 0.006), ("confidence", 0.98)])
def test_adaptive_decoding_equals_the_whole_sequence_with_the_same_exits(criterion, threshold):
    model = trained_like(H=4)
    prompt = torch.randint(0, 512, (1, 6), generator=torch.Generator().manual_seed(3))
    used = DepthUsed()
    cfg = SamplingConfig(
        max_new_tokens=14, temperature=0, exit_criterion=criterion, exit_threshold=threshold
    )
    with torch.no_grad():
        new = generate(model, prompt, cfg, depth_used=used)[0]
        # The prompt ran every loop; each fed token (all new ones but the last) its own count.
        seq = torch.cat([prompt[0], new[:-1]])[None]
        exits = torch.tensor([4] * prompt.shape[1] + used.loops_per_token)
        logits = hold_pass(model, seq, exits, 4)
    assert len(set(used.loops_per_token)) > 1  # exits at several loops: not vacuous
    assert logits[prompt.shape[1] - 1 :].argmax(-1).tolist() == new.tolist()


@pytest.mark.parametrize("criterion", ["kl", "confidence"])
def test_threshold_zero_is_fixed_depth_exactly(criterion):
    model = trained_like(H=3)
    prompt = torch.randint(0, 512, (2, 5), generator=torch.Generator().manual_seed(4))
    for temperature in (0.0, 1.0):
        fixed = generate(model, prompt, SamplingConfig(max_new_tokens=10, temperature=temperature))
        used = DepthUsed()
        cfg = SamplingConfig(
            max_new_tokens=10, temperature=temperature, exit_criterion=criterion, exit_threshold=0.0
        )
        assert torch.equal(generate(model, prompt, cfg, depth_used=used), fixed)
        assert used.mean() == 3.0
    tokens, positions, doc = batch()
    labels = torch.roll(tokens, -1, dims=1)
    labels[:, -1] = -100
    mb = {"input_ids": tokens, "positions": positions, "doc_ids": doc, "labels": labels}
    with torch.no_grad():
        ce = float(token_ce_sum(model(tokens, positions, doc).logits_BSV, labels))
        got = adaptive_pass(model, mb, criterion, 0.0, 3)
    assert got.loops_sum == 3 * got.tokens and got.exits_T == [0, 0, got.tokens]
    assert got.ce_sum == pytest.approx(ce, rel=1e-6)  # log_softmax + gather vs cross_entropy


def test_settle_scores_against_torch():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 3, 7, generator=g), torch.randn(2, 3, 7, generator=g)
    la, lb = F.log_softmax(a, -1), F.log_softmax(b, -1)
    kl = F.kl_div(lb, la, log_target=True, reduction="none").sum(-1)  # KL(p_a || p_b)
    torch.testing.assert_close(settle_score("kl", la, lb), kl)
    assert torch.isinf(settle_score("kl", la, None)).all()
    torch.testing.assert_close(settle_score("confidence", la, None), 1 - a.softmax(-1).amax(-1))


def test_threshold_ranges():
    assert threshold_problem("kl", 0.0) is None and threshold_problem("confidence", 1.0) is None
    assert "must be a finite number ≥ 0" in threshold_problem("kl", -0.1)
    assert "must be a finite number ≥ 0" in threshold_problem("kl", float("nan"))
    assert "must be in [0, 1]" in threshold_problem("confidence", 1.5)
    assert "valid kl, confidence" in threshold_problem("entropy", 0.1)
    assert "--exit" in SamplingConfig(exit_criterion="kl", exit_threshold=-1).problems()[0]
