"""How a run ends (issue #26): after a non-finite stop nothing is committed or pruned, an async save
in flight included; a saved finite explosion never prunes the last good checkpoint (a checkpoint
prunes older ones only after 2 healthy steps); the spike guard's streak survives a resume; and a
full disk while logging ends in one line, exit 1, with run.json saying failed."""

import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.unit.test_checkpoint import make_trainer
from torchtitan_loom import launch, train
from torchtitan_loom.components.checkpoint import tree
from torchtitan_loom.components.observability import metrics
from torchtitan_loom.components.runtime import safe_files
from torchtitan_loom.trainer import Trainer

KEEP_ONE = ("--training.steps", "12", "--checkpoint.keep_latest_k", "1")


@pytest.fixture(scope="module")
def good_at_8(tiny_pack, tmp_path_factory):
    """A healthy run stopped at step 8, checkpoints at 4 and 8."""
    dump = tmp_path_factory.mktemp("good_at_8")
    t = make_trainer(
        tiny_pack,
        dump,
        *KEEP_ONE,
        "--checkpoint.interval",
        "4",
        "--checkpoint.exit_after_step",
        "8",
    )
    assert t.train() == 0 and t.state.step == 8
    return dump


def exploding(tiny_pack, dump, good_at_8, *extra):
    """Resumed at step 8 with lr 1e12 and a save every step: step 9 is finite and saved (its update
    wrecked the weights, which stay finite), step 10's loss is NaN: the run stops there."""
    shutil.copytree(good_at_8, dump, dirs_exist_ok=True)
    t = make_trainer(
        tiny_pack, dump, *KEEP_ONE, "--checkpoint.interval", "1", "--optimizer.lr", "1e12", *extra
    )
    assert t.train() == 2 and t.state.step == 10
    return (dump / "SPIKE_ABORT.txt").read_text()


def steps_on_disk(dump):
    return [e.step for e in tree.scan(str(dump / "checkpoint")).complete]


def test_a_nan_stop_commits_and_prunes_nothing_not_even_an_async_save_in_flight(
    tiny_pack, tmp_path, good_at_8
):
    text = exploding(tiny_pack, tmp_path, good_at_8, "--checkpoint.async_mode", "async")
    # Before: step-9 was committed after the abort line and step-4 and step-8 were pruned.
    assert steps_on_disk(tmp_path) == [4, 8]
    assert not list((tmp_path / "checkpoint").glob(".tmp-*"))  # the discarded save is gone
    assert "non-finite loss in segment 1" in text and "at step 10" in text
    assert "the save of step 9 still in flight was discarded" in text
    assert f"newest checkpoint: {tmp_path / 'checkpoint' / 'step-8'}" in text


def test_a_saved_finite_explosion_inside_the_warm_up_keeps_the_last_good_checkpoint(
    tiny_pack, tmp_path, good_at_8
):
    # Inside the guard's warm-up nothing is skipped: step-9 (finite, wrecked) is saved.
    text = exploding(tiny_pack, tmp_path, good_at_8, "--spike_guard.warmup_steps", "100")
    # Before: saving step-9 pruned step-8 (keep_latest_k 1), the last good one.
    assert steps_on_disk(tmp_path) == [4, 8, 9]
    assert f"newest checkpoint: {tmp_path / 'checkpoint' / 'step-9'}" in text


def test_two_healthy_steps_prove_a_checkpoint_and_only_then_it_prunes(tiny_pack, tmp_path, capsys):
    args = (
        "--training.steps",
        "6",
        "--checkpoint.keep_latest_k",
        "1",
        "--checkpoint.interval",
        "2",
    )
    t = make_trainer(tiny_pack, tmp_path, *args)
    assert t.train() == 0
    out = capsys.readouterr().out
    # step-2 proven by 3 and 4 (nothing older), step-4 by 5 and 6: step-2 goes; 6 is not proven.
    assert "checkpoint step 4 proven by 2 healthy steps: pruned step-2" in out
    assert steps_on_disk(tmp_path) == [4, 6]


def test_the_skip_streak_survives_a_resume(tiny_pack, tmp_path):
    args = (
        "--training.steps",
        "12",
        "--checkpoint.interval",
        "1",
        "--checkpoint.keep_latest_k",
        "0",
    )
    args += ("--spike_guard.abort_on_spike", "false", "--spike_guard.max_consecutive_skips", "4")
    forced = lambda seg, loss, step: "forced" if step >= 3 else None  # noqa: E731
    first = make_trainer(tiny_pack, tmp_path, *args, "--checkpoint.exit_after_step", "4")
    first.spike_guard.check = forced
    assert first.train() == 0 and first.state.consecutive_skips == 2  # skips at 3 and 4, saved
    second = make_trainer(tiny_pack, tmp_path, *args)
    assert second.state.consecutive_skips == 2
    second.spike_guard.check = forced
    # Before: the streak restarted at 0 and the abort came at step 8 (5, 6, 7, 8).
    assert second.train() == 2 and second.state.step == 6
    text = (tmp_path / "SPIKE_ABORT.txt").read_text()
    assert "4 consecutive skipped steps" in text and "the last at step 6" in text


def _argv(pack, dump):
    return [
        "--data.path",
        str(pack),
        "--job.dump_folder",
        str(dump),
        "--training.seq_len",
        "32",
        "--training.global_batch_size",
        "4",
        "--training.micro_batch_size",
        "2",
        "--training.steps",
        "300",
        "--eval.interval",
        "0",
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
        "false",
    ]


class FillsTheDisk(Trainer):
    """After step 2 another writer fills the disk the run folder is on, leaving a few bytes."""

    def train_step(self, batch):
        out = super().train_step(batch)
        if self.state.step == 2:
            disk = Path(self.cfg.job.dump_folder).parent
            st = os.statvfs(disk)
            (disk / "filler").write_bytes(b"\0" * (st.f_bavail * st.f_frsize - 512))
        return out


def test_disk_full_while_logging_on_a_small_tmpfs(tiny_pack, tmp_path, capsys):
    """A real full disk, checkpoints off: one line, exit 1, run.json says failed."""
    disk = tmp_path / "small"
    disk.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)]
    if subprocess.run(mount, capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root); the test below covers the logic")
    try:
        dump = disk / "run"
        # Before: a traceback, exit 1, and run.json left at "running".
        assert launch.run(_argv(tiny_pack, dump), FillsTheDisk) == 1
        err = capsys.readouterr().err
        assert err.splitlines() == [
            f"disk full writing {dump / 'metrics.jsonl'}: No space left on device"
        ], err
        run = json.loads((dump / "run.json").read_text())
        assert run["status"] == "failed" and run["step"] >= 3
    finally:
        subprocess.run(["umount", "-l", str(disk)])


def test_disk_full_while_logging_reported_from_the_writer(tiny_pack, tmp_path, capsys, monkeypatch):
    """The metrics line and run.json's temporary copy both fail as on a full disk."""
    real_log, real_write = metrics.MetricsLogger.log, safe_files.atomic_write

    def log(self, step, *args, **kwargs):
        if step == 3:
            raise OSError(errno.ENOSPC, "No space left on device", self.jsonl_path)
        real_log(self, step, *args, **kwargs)

    def atomic_write(path, data, owner=None):  # no room for run.json's temporary copy any more
        if path.endswith("run.json") and '"failed"' in str(data):
            raise OSError(errno.ENOSPC, "No space left on device", path + ".partial")
        return real_write(path, data, owner)

    monkeypatch.setattr(metrics.MetricsLogger, "log", log)
    monkeypatch.setattr(safe_files, "atomic_write", atomic_write)
    dump = tmp_path / "run"
    assert train.main(_argv(tiny_pack, dump)) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"disk full writing {dump / 'metrics.jsonl'}: No space left on device"
    ]
    run = json.loads((dump / "run.json").read_text())
    assert run["status"] == "failed" and run["step"] == 3
