"""The learned exit (model.exit_head; models/loom/exit_head.py, components/exit_training.py, the "learned"
criterion of components/evaluation/adaptive_exit.py):

- decoding with learned exits equals the whole sequence run with the same exits, token for token;
- threshold 0 is fixed depth, a large one exits every token at the first decision loop, and a
  token exits only after a loop the head was trained to decide at (the run's segment ends: with
  bp_segment_len 3, loop 3 of 6 and nowhere else);
- the head's training loss is the Huber loss of its predicted drop against the drop of the CE,
  computed here independently;
- the head's loss trains only the head: the LM parameters after training with it equal, bit for
  bit, those of the same run without the head (with the clip acting: the head's gradient stays
  out of its norm), and the head moved from its zero init;
- a resume with the head restores every state bit for bit;
- a model without the head is refused by name.
"""

import os
import sys
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_checkpoint import assert_same_state, make_trainer, run
from test_depth_model import hold_pass, trained_like
from test_model_forward import batch

from torchtitan_loom.components.evaluation.adaptive_exit import adaptive_pass, decision_loops
from torchtitan_loom.components.evaluation.sampling import DepthUsed, SamplingConfig, generate
from torchtitan_loom.components.exit_training import ExitTraining

HEAD = ("--model.exit_head", "true", "--training.bp_segment_len", "1")
HEAD_PARAMS = {
    "exit_head.w_in.weight",
    "exit_head.w_in.bias",
    "exit_head.w_out.weight",
    "exit_head.w_out.bias",
}


def with_head(H: int):
    """A trained-like debug model whose exit head predicts drops that vary around 0 (~N(0, 1))."""
    model = trained_like(H=H, exit_head=True)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        out = model.exit_head.w_out
        out.weight.copy_(torch.randn(out.weight.shape, generator=g) / out.weight.shape[1] ** 0.5)
    return model


def test_learned_decoding_equals_the_whole_sequence_with_the_same_exits():
    model = with_head(H=4)
    prompt = torch.randint(0, 512, (1, 6), generator=torch.Generator().manual_seed(3))
    used = DepthUsed()
    cfg = SamplingConfig(
        max_new_tokens=14,
        temperature=0,
        exit_criterion="learned",
        exit_threshold=0.3,
        exit_loops=frozenset({2, 3}),
    )
    with torch.no_grad():
        new = generate(model, prompt, cfg, depth_used=used)[0]
        seq = torch.cat([prompt[0], new[:-1]])[None]
        exits = torch.tensor([4] * prompt.shape[1] + used.loops_per_token)
        logits = hold_pass(model, seq, exits, 4)
    assert len(set(used.loops_per_token)) > 1  # exits at several loops: not vacuous
    assert logits[prompt.shape[1] - 1 :].argmax(-1).tolist() == new.tolist()


def _mb():
    tokens, positions, doc = batch()
    labels = torch.roll(tokens, -1, dims=1)
    labels[:, -1] = -100
    return {"input_ids": tokens, "positions": positions, "doc_ids": doc, "labels": labels}


def test_learned_threshold_zero_is_fixed_depth_and_a_large_one_exits_at_the_first_decision():
    model, mb = with_head(H=4), _mb()
    every = decision_loops("learned", 4, SimpleNamespace(bp_segment_len=1, sample_depth_max=0))
    assert every == {2, 3}  # not after loop 1: a token stopped there would hold its loop-1 K/V
    with torch.no_grad():
        never = adaptive_pass(model, mb, "learned", 0.0, 4, every)
        always = adaptive_pass(model, mb, "learned", 1e9, 4, every)
        some = adaptive_pass(model, mb, "learned", 0.3, 4, every)
    assert never.exits_T == [0, 0, 0, never.tokens] and always.exits_T == [0, always.tokens, 0, 0]
    assert 0 < some.exits_T[1] < some.tokens and some.exits_T[0] == 0


def test_with_three_loops_per_segment_a_token_exits_only_at_a_segment_end():
    # The head is trained at the segment ends only (it predicts the drop of the next K loops), so
    # it is asked there only: after loop 3 of 6, not after loops 1, 2, 4 or 5.
    model, mb = with_head(H=6), _mb()
    ends = decision_loops("learned", 6, SimpleNamespace(bp_segment_len=3, sample_depth_max=0))
    assert ends == {3}
    past = decision_loops("learned", 6, SimpleNamespace(bp_segment_len=3, sample_depth_max=12))
    assert past == {3, 6, 9}
    assert decision_loops("kl", 6, SimpleNamespace(bp_segment_len=3, sample_depth_max=0)) is None
    with pytest.raises(ValueError, match="no config.toml"):
        decision_loops("learned", 6, None)
    with torch.no_grad():
        anywhere = adaptive_pass(model, mb, "learned", 0.3, 6)
        at_ends = adaptive_pass(model, mb, "learned", 0.3, 6, ends)
    assert sum(anywhere.exits_T[i] for i in (0, 1, 3, 4)) > 0  # the check is not vacuous
    assert [i + 1 for i, n in enumerate(at_ends.exits_T) if n] == [3, 6]


def test_the_head_loss_is_the_huber_loss_of_its_predicted_drop():
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 11, (2, 5), generator=g)
    labels[0, 4] = -100
    before, after = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g)
    gain = torch.randn(2, 5, generator=g, requires_grad=True) * 2
    train = ExitTraining(1, torch.device("cpu"))
    denom = torch.tensor(9.0)
    assert train.loss(0, before, labels, gain, denom) is None  # segment 1: no decision
    loss = train.loss(0, after, labels, gain, denom)

    # independently: the drop of each valid token's CE, and the Huber loss written out
    def ce(lg):
        return -lg.log_softmax(-1).gather(-1, labels.clamp_min(0)[..., None])[..., 0]

    drop, valid = ce(before) - ce(after), labels != -100
    err = (gain - drop).abs()
    huber = torch.where(err < 1.0, 0.5 * err**2, err - 0.5)
    assert torch.allclose(loss, (huber * valid).sum() / 9.0, rtol=1e-6, atol=0)
    scores = train.scalars(lambda t: t)
    assert float(scores["exit_head_accuracy"]) == pytest.approx(
        float((((gain > 0) == (drop > 0)) & valid).sum() / valid.sum())
    )


def test_a_model_without_the_head_is_refused():
    model = trained_like(H=2)
    tokens, positions, doc = batch()
    mb = {"input_ids": tokens, "positions": positions, "doc_ids": doc, "labels": tokens}
    with pytest.raises(ValueError, match="no exit head"):
        adaptive_pass(model, mb, "learned", 0.5, 2)
    cfg = SamplingConfig(max_new_tokens=2, exit_criterion="learned", exit_threshold=0.5)
    with pytest.raises(ValueError, match="no exit head"):
        generate(model, tokens[:1, :4], cfg)


def test_the_head_loss_trains_only_the_head(tiny_pack, tmp_path):
    # The clip on (max_norm 1 acts here): the head's gradient stays out of the clip's norm.
    common = ("--training.steps", "4", "--checkpoint.interval", "100")
    common += ("--training.bp_segment_len", "1")
    plain = run(make_trainer(tiny_pack, tmp_path / "plain", *common))
    headed = make_trainer(tiny_pack, tmp_path / "head", *common, "--model.exit_head", "true")
    data = iter(headed.dataloader)
    out = headed.train_step(next(data))
    assert out.exit_scores is not None and 0 <= float(out.exit_scores["exit_head_accuracy"]) <= 1
    assert 0 < float(out.exit_scores["exit_head_loss"]) < 10
    for _ in range(3):
        headed.train_step(next(data))
    lm = plain.model.state_dict()
    got = headed.model.state_dict()
    assert set(got) - set(lm) == HEAD_PARAMS
    for name, value in lm.items():
        assert torch.equal(value, got[name]), name
    assert got["exit_head.w_out.weight"].abs().sum() > 0  # the head learned from its own loss


def test_resume_with_the_head_restores_every_state_bit_for_bit(tiny_pack, tmp_path):
    common = ("--training.steps", "6", "--checkpoint.interval", "3")
    common += ("--checkpoint.keep_latest_k", "0", *HEAD)
    straight = run(make_trainer(tiny_pack, tmp_path, *common))
    resumed = make_trainer(tiny_pack, tmp_path, *common, "--checkpoint.load_step", "3")
    assert resumed.state.step == 3 and resumed.model.exit_head is not None
    run(resumed)
    assert_same_state(straight, resumed)
    assert straight.model.exit_head.w_out.weight.abs().sum() > 0
