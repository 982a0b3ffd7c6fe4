"""Divergence stops (issue #11): N consecutive skipped steps or a non-finite weight exit 2 with
SPIKE_ABORT.txt, never save a non-finite model, and the last checkpoint before the streak survives
pruning."""

import pytest
import torch

from torchtitan_loom.components.checkpoint import layout
from tests.unit.test_checkpoint import make_trainer

COMMON = ("--training.steps", "12", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "1",
          "--spike_guard.abort_on_spike", "false")


def test_consecutive_skips_stop_the_run_and_keep_the_last_good_checkpoint(tiny_pack, tmp_path, capsys):
    t = make_trainer(tiny_pack, tmp_path, *COMMON, "--spike_guard.max_consecutive_skips", "3")
    t.spike_guard.check = lambda seg, loss, finite, step: "forced" if step >= 3 else None
    assert t.train() == 2
    assert t.state.step == 5  # skips at 3, 4, 5: the third stops the run
    text = (tmp_path / "SPIKE_ABORT.txt").read_text()
    assert "3 consecutive skipped steps" in text and "max_consecutive_skips" in text
    found = [e.step for e in layout.scan(str(tmp_path / "checkpoint")).complete]
    # keep_latest_k = 1 would keep only step-4; step-2 (before the first skip) is KEEP-marked; 5 is never saved.
    assert found == [2, 4]
    assert (tmp_path / "checkpoint" / "step-2" / layout.KEEP).exists()


def test_a_skip_streak_that_ends_does_not_stop(tiny_pack, tmp_path):
    t = make_trainer(tiny_pack, tmp_path, *COMMON, "--training.steps", "6", "--spike_guard.max_consecutive_skips", "2")
    t.spike_guard.check = lambda seg, loss, finite, step: "forced" if step in (2, 4) else None
    assert t.train() == 0 and t.state.step == 6
    assert not (tmp_path / "SPIKE_ABORT.txt").exists()


class _NaNAfterStep3:
    """A step that leaves a NaN weight (as lr 1e9 with the guard off would)."""

    def __init__(self, trainer):
        self.trainer, self.inner = trainer, trainer.train_step

    def __call__(self, batch):
        out = self.inner(batch)
        if self.trainer.state.step == 3:
            with torch.no_grad():
                next(self.trainer.model.parameters()).view(-1)[0] = float("nan")
        return out


@pytest.mark.parametrize("guard", ["true", "false"])
def test_nonfinite_weight_after_a_step_stops_without_saving(tiny_pack, tmp_path, guard):
    t = make_trainer(tiny_pack, tmp_path, *COMMON, "--spike_guard.enable", guard)
    t.train_step = _NaNAfterStep3(t)
    assert t.train() == 2 and t.state.step == 3
    assert "non-finite weights after step 3" in (tmp_path / "SPIKE_ABORT.txt").read_text()
    assert layout.scan(str(tmp_path / "checkpoint")).newest().step == 2
