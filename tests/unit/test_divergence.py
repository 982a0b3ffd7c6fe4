"""Divergence stops (issue #11): N consecutive skipped steps or a non-finite weight exit 2 with
SPIKE_ABORT.txt, never save a non-finite model, and the last checkpoint before the streak survives
pruning (only a checkpoint followed by healthy steps prunes older ones). A non-finite loss or gradient always stops the run, with the guard on or off."""

import shutil

import pytest
import torch

from tests.unit.test_checkpoint import make_trainer
from torchtitan_loom.components.checkpoint import tree
from torchtitan_loom.components.checkpoint.integrity import model_finite

COMMON = (
    "--training.steps",
    "12",
    "--checkpoint.interval",
    "1",
    "--checkpoint.keep_latest_k",
    "1",
    "--spike_guard.abort_on_spike",
    "false",
)


def test_consecutive_skips_stop_the_run_and_keep_the_last_good_checkpoint(
    tiny_pack, tmp_path, capsys
):
    t = make_trainer(tiny_pack, tmp_path, *COMMON, "--spike_guard.max_consecutive_skips", "3")
    t.spike_guard.check = lambda seg, loss, step: "forced" if step >= 3 else None
    assert t.train() == 2
    assert t.state.step == 5  # skips at 3, 4, 5: the third stops the run
    text = (tmp_path / "SPIKE_ABORT.txt").read_text()
    assert "3 consecutive skipped steps" in text and "max_consecutive_skips" in text
    found = [e.step for e in tree.scan(str(tmp_path / "checkpoint")).complete]
    # keep_latest_k = 1, but no checkpoint was followed by 2 healthy steps (3 is the first skip),
    # so none prunes another: step-2, the last before the streak, is there; 5 is never saved.
    assert found == [1, 2, 3, 4]


def test_a_skip_streak_that_ends_does_not_stop(tiny_pack, tmp_path):
    t = make_trainer(
        tiny_pack,
        tmp_path,
        *COMMON,
        "--training.steps",
        "6",
        "--spike_guard.max_consecutive_skips",
        "2",
    )
    t.spike_guard.check = lambda seg, loss, step: "forced" if step in (2, 4) else None
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
    assert tree.scan(str(tmp_path / "checkpoint")).newest().step == 2


@pytest.fixture(scope="module")
def stopped_at_8(tiny_pack, tmp_path_factory):
    """A healthy run stopped at step 8 (checkpoints at 4 and 8: keep_latest_k = 1, but step-8 was
    not followed by healthy steps yet), as the relaunches below find it."""
    dump = tmp_path_factory.mktemp("stopped_at_8")
    t = make_trainer(
        tiny_pack, dump, *COMMON, "--checkpoint.interval", "4", "--checkpoint.exit_after_step", "8"
    )
    assert t.train() == 0 and t.state.step == 8
    return dump


@pytest.mark.parametrize("guard", ["true", "false"])
def test_a_nonfinite_loss_stops_the_run_whatever_the_guard(
    tiny_pack, tmp_path, stopped_at_8, guard
):
    # lr 1e12 on the resumed run: step 9 is finite, its update makes step 10's loss NaN while the
    # weights stay finite. Before, the guard skipped 10-12 and saved step-12 of that model (exit 0),
    # and with the guard off the NaN update was applied.
    shutil.copytree(stopped_at_8, tmp_path, dirs_exist_ok=True)
    t = make_trainer(
        tiny_pack,
        tmp_path,
        *COMMON,
        "--checkpoint.interval",
        "4",
        "--optimizer.lr",
        "1e12",
        "--spike_guard.enable",
        guard,
    )
    assert t.train() == 2 and t.state.step == 10
    text = (tmp_path / "SPIKE_ABORT.txt").read_text()
    assert "non-finite loss in segment 1" in text and "at step 10" in text
    # Nothing saved, nothing pruned (step-8 was never followed by 2 healthy steps: step-4 stays).
    assert [e.step for e in tree.scan(str(tmp_path / "checkpoint")).complete] == [4, 8]
    assert not model_finite(t.model)  # the NaN step's update was not applied


def test_a_nonfinite_gradient_stops_the_run(tiny_pack, tmp_path, stopped_at_8):
    # lr 1e6: step 10's loss is finite (huge) but its gradient is not: no longer skipped to the end.
    shutil.copytree(stopped_at_8, tmp_path, dirs_exist_ok=True)
    t = make_trainer(
        tiny_pack, tmp_path, *COMMON, "--checkpoint.interval", "4", "--optimizer.lr", "1e6"
    )
    assert t.train() == 2 and t.state.step == 10
    assert "non-finite gradient in segment 1" in (tmp_path / "SPIKE_ABORT.txt").read_text()
    assert [e.step for e in tree.scan(str(tmp_path / "checkpoint")).complete] == [4, 8]
