"""The lm-eval adapter's rolling log-likelihood and generate_until against independent computations;
with an exit rule, scores read at each token's exit loop (the whole-sequence pass with the same
exits) and independent of the batch, threshold 0 the fixed-depth scores exactly."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lm_eval")

from torchtitan_loom.components.evaluation.adaptive_exit import ExitRule
from torchtitan_loom.components.evaluation.lm_eval_adapter import LoomLM
from torchtitan_loom.components.evaluation.sampling import SamplingConfig, generate
from torchtitan_loom.tools.loading import load


def request(*args):
    return SimpleNamespace(args=args)


def window_ll(model, inputs, targets):
    x = torch.tensor([inputs])
    with torch.no_grad():
        logits = model(x, torch.arange(x.shape[1])[None], torch.zeros_like(x)).logits_BSV[0]
    logp = F.log_softmax(logits[-len(targets) :], dim=-1)
    return logp.gather(1, torch.tensor(targets)[:, None]).sum().item()


def test_rolling_loglikelihood_over_several_windows(trained_run):
    loaded = load(str(trained_run))
    lm = LoomLM(loaded.model, loaded.tokenizer, torch.device("cpu"), loops=3, batch_size=2)
    text = "the cat sat on the mat " * 26  # 598 byte tokens: 3 windows of max_seq_len 256
    ids = loaded.tokenizer.encode(text)
    L, eos = loaded.model.args.max_seq_len, loaded.tokenizer.eos_id
    # By hand: window 1 predicts ids[0:L] from [eos] + ids[:L-1]; later windows predict the next L
    # (or fewer) tokens, each seeing the L tokens before its last target.
    expected = window_ll(loaded.model, [eos] + ids[: L - 1], ids[:L])
    start = L
    while start < len(ids):
        end = min(start + L, len(ids))
        expected += window_ll(loaded.model, ids[end - 1 - L : end - 1], ids[start:end])
        start = end
    got = lm.loglikelihood_rolling([request(text)])[0]
    assert got == pytest.approx(expected, rel=1e-5)


def test_generate_until_cuts_at_the_stop_string(trained_run):
    loaded = load(str(trained_run))
    lm = LoomLM(loaded.model, loaded.tokenizer, torch.device("cpu"), loops=3)
    ctx = "the cat sat on the"
    out = lm.generate_until(
        [
            request(ctx, {"until": ["zzz", "t "], "max_gen_toks": 12}),
            request(ctx, {"until": ["zzz"], "max_gen_toks": 2}),
        ]
    )
    ids = torch.tensor([loaded.tokenizer.encode(ctx)])
    full = loaded.tokenizer.decode(
        generate(
            loaded.model,
            ids,
            SamplingConfig(max_new_tokens=12, temperature=0),
            eos_id=loaded.tokenizer.eos_id,
        )[0].tolist()
    )
    assert full.startswith(" mat ")  # the learned sentence, then end of text
    assert out[0] == full[: full.index("t ")] == " ma"
    assert out[1] == " m"  # max_gen_toks = 2 byte tokens


def test_an_exit_rule_scores_each_token_at_its_exit_loop(trained_run):
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "unit"))
    from test_depth_model import hold_pass

    loaded = load(str(trained_run))
    enc, model = loaded.tokenizer.encode, loaded.model
    pairs = [(enc("the cat sat on the"), enc(" mat and")), (enc("a"), enc(" dog sat on it"))]
    cpu = torch.device("cpu")
    fixed = LoomLM(model, loaded.tokenizer, cpu, loops=3, batch_size=2).score_tokens(pairs)
    never = ExitRule("confidence", 0.0, 3)
    zero = LoomLM(model, loaded.tokenizer, cpu, loops=3, batch_size=2, exit_rule=never)
    assert zero.score_tokens(pairs) == fixed  # threshold 0: fixed depth, exactly
    rule = ExitRule("confidence", 0.5, 3)
    lm = LoomLM(model, loaded.tokenizer, cpu, loops=3, batch_size=2, exit_rule=rule)
    together = lm.score_tokens(pairs)
    alone = [
        LoomLM(model, loaded.tokenizer, cpu, loops=3, batch_size=1, exit_rule=rule).score_tokens(
            [p]
        )[0]
        for p in pairs
    ]
    assert [ll for ll, _ in together] == pytest.approx([ll for ll, _ in alone], rel=1e-5)
    assert 1.0 < lm.exit_loops_sum / lm.exit_tokens < 3.0  # exits at several loops
    for (ctx, cont), (ll, _) in zip(pairs, together):
        # Independently: find each position's exit loop from the confidence of its own loop
        # (running the held pass loop by loop), then read the logits at those loops.
        seq = torch.tensor([ctx + cont])[:, :-1]
        S = seq.shape[1]
        exits = torch.full((S,), 3)
        for t in (1, 2):
            probe = hold_pass(model, seq, torch.where(exits < t, exits, torch.full((S,), t)), t)
            top = probe.softmax(-1).max(-1).values
            exits = torch.where((exits == 3) & (1 - top < 0.5), torch.full((S,), t), exits)
        logp = hold_pass(model, seq, exits, 3).log_softmax(-1)
        want = logp[len(ctx) - 1 :].gather(1, torch.tensor(cont)[:, None]).sum().item()
        assert ll == pytest.approx(want, rel=1e-5, abs=1e-5)
