"""The learned exit (model.exit_head; models/loom/exit_head.py, components/exit_training.py, the "learned"
criterion of components/evaluation/adaptive_exit.py):

- decoding with learned exits equals the whole sequence run with the same exits, token for token;
- the head's loss trains only the head: the LM parameters after training with it equal, bit for
  bit, those of the same run without the head (with the clip acting: the head's gradient stays
  out of its norm), and the head moved from its zero init;
- a resume with the head restores every state bit for bit;
- a model without the head is refused by name.
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_checkpoint import assert_same_state, make_trainer, run
from test_depth_model import hold_pass, trained_like
from test_model_forward import batch

from torchtitan_loom.components.evaluation.adaptive_exit import adaptive_pass
from torchtitan_loom.components.evaluation.sampling import DepthUsed, SamplingConfig, generate

HEAD = ("--model.exit_head", "true", "--training.bp_segment_len", "1")


def with_head(H: int):
    """A trained-like debug model whose exit head scores vary around 1/2 (logits ~ N(0, 1))."""
    model = trained_like(H=H, exit_head=True)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        head = model.exit_head.proj
        head.weight.copy_(torch.randn(head.weight.shape, generator=g) / head.weight.shape[1] ** 0.5)
    return model


def test_learned_decoding_equals_the_whole_sequence_with_the_same_exits():
    model = with_head(H=4)
    prompt = torch.randint(0, 512, (1, 6), generator=torch.Generator().manual_seed(3))
    used = DepthUsed()
    cfg = SamplingConfig(
        max_new_tokens=14, temperature=0, exit_criterion="learned", exit_threshold=0.5
    )
    with torch.no_grad():
        new = generate(model, prompt, cfg, depth_used=used)[0]
        seq = torch.cat([prompt[0], new[:-1]])[None]
        exits = torch.tensor([4] * prompt.shape[1] + used.loops_per_token)
        logits = hold_pass(model, seq, exits, 4)
    assert len(set(used.loops_per_token)) > 1  # exits at several loops: not vacuous
    assert logits[prompt.shape[1] - 1 :].argmax(-1).tolist() == new.tolist()


def test_learned_threshold_zero_is_fixed_depth_and_one_exits_after_loop_one():
    model = with_head(H=3)
    tokens, positions, doc = batch()
    labels = torch.roll(tokens, -1, dims=1)
    labels[:, -1] = -100
    mb = {"input_ids": tokens, "positions": positions, "doc_ids": doc, "labels": labels}
    with torch.no_grad():
        never = adaptive_pass(model, mb, "learned", 0.0, 3)
        always = adaptive_pass(model, mb, "learned", 1.0, 3)
        some = adaptive_pass(model, mb, "learned", 0.5, 3)
    assert never.exits_T == [0, 0, never.tokens] and always.exits_T == [always.tokens, 0, 0]
    assert some.exits_T[0] > 0 and some.exits_T[0] < some.tokens


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
    assert set(got) - set(lm) == {"exit_head.proj.weight", "exit_head.proj.bias"}
    for name, value in lm.items():
        assert torch.equal(value, got[name]), name
    assert got["exit_head.proj.weight"].abs().sum() > 0  # the head learned from its own loss


def test_resume_with_the_head_restores_every_state_bit_for_bit(tiny_pack, tmp_path):
    common = ("--training.steps", "6", "--checkpoint.interval", "3")
    common += ("--checkpoint.keep_latest_k", "0", *HEAD)
    straight = run(make_trainer(tiny_pack, tmp_path, *common))
    resumed = make_trainer(tiny_pack, tmp_path, *common, "--checkpoint.load_step", "3")
    assert resumed.state.step == 3 and resumed.model.exit_head is not None
    run(resumed)
    assert_same_state(straight, resumed)
    assert straight.model.exit_head.proj.weight.abs().sum() > 0
