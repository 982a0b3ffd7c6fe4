"""The lm-eval adapter's rolling log-likelihood and generate_until against independent computations."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lm_eval")

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
