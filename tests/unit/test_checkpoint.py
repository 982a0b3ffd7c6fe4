"""CheckpointManager through the real Trainer, in one process (no launches): exact resume of every
piece of state, parameters without optimizer state, torn checkpoints, pruning and snapshots,
async save, preemption."""

import json
import math
import os
import shutil
import signal

import pytest
import torch

from torchtitan_loom.components.checkpoint import CheckpointError, tree
from torchtitan_loom.components.checkpoint.state import read_metadata
from torchtitan_loom.components.runtime.preemption import PreemptionWatcher
from torchtitan_loom.config import load_config
from torchtitan_loom.config.validate import resolve
from torchtitan_loom.distributed.utils import DistInfo
from torchtitan_loom.trainer import Trainer

CPU = DistInfo(rank=0, world_size=1, device=torch.device("cpu"))


def make_trainer(pack, dump, *extra, cls=Trainer):
    argv = [
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
        "--training.mixed_precision_param",
        "float32",
        "--metrics.log_freq",
        "1",
        "--eval.interval",
        "0",
        "--metrics.enable_tensorboard",
        "false",
        "--checkpoint.enable",
        *extra,
    ]
    cfg = load_config(argv)
    trainer = cls(cfg, resolve(cfg, 1), CPU)
    trainer.resume()  # what train() does first; done here so tests can inspect the resumed state
    return trainer


def run(trainer):
    code = trainer.train()
    assert code == 0
    return trainer


def assert_same_tensors(a, b, what):
    assert a.keys() == b.keys(), f"{what}: keys differ: {sorted(a.keys() ^ b.keys())[:5]}"
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


def assert_same_state(t1, t2):
    """Every piece of restartable state is identical (tensors bit for bit)."""
    assert_same_tensors(t1.model.state_dict(), t2.model.state_dict(), "model")
    o1, o2 = t1.optimizer.state_dict(), t2.optimizer.state_dict()
    assert o1["param_groups"] == o2["param_groups"]
    assert o1["state"].keys() == o2["state"].keys()
    for i in o1["state"]:
        assert_same_tensors(o1["state"][i], o2["state"][i], f"optimizer state {i}")
    for name in ("lr_scheduler", "dataloader", "spike_guard", "state"):
        assert (
            getattr(t1.parts.training, name).state_dict()
            == getattr(t2.parts.training, name).state_dict()
        ), name


def test_resume_restores_every_state_exactly(tiny_pack, tmp_path):
    common = (
        "--training.steps",
        "6",
        "--checkpoint.interval",
        "3",
        "--checkpoint.keep_latest_k",
        "0",
    )
    straight = run(make_trainer(tiny_pack, tmp_path, *common))
    rng_after = torch.get_rng_state()
    assert straight.state.step == 6
    # A second run of the same folder from step 3 re-saves step 6 (replacing the first one).
    resumed = make_trainer(tiny_pack, tmp_path, *common, "--checkpoint.load_step", "3")
    assert resumed.state.step == 3 and resumed.dataloader.state_dict()["cursor"] == 3 * 4
    run(resumed)
    assert_same_state(straight, resumed)
    assert torch.equal(torch.get_rng_state(), rng_after)
    assert [e.step for e in tree.scan(str(tmp_path / "checkpoint")).complete] == [3, 6]


def test_resume_with_activation_checkpointing_switched_on(tiny_pack, tmp_path):
    # Module wrappers must not change the saved names; recomputation does not change the math.
    common = (
        "--training.steps",
        "4",
        "--checkpoint.interval",
        "2",
        "--checkpoint.keep_latest_k",
        "0",
    )
    straight = run(make_trainer(tiny_pack, tmp_path, *common))
    resumed = make_trainer(
        tiny_pack,
        tmp_path,
        *common,
        "--checkpoint.load_step",
        "2",
        "--activation_checkpoint.mode",
        "block",
    )
    assert resumed.state.step == 2
    run(resumed)
    assert_same_state(straight, resumed)


def test_parameters_without_adam_state_stay_without_state(tiny_pack, tmp_path):
    t1 = make_trainer(tiny_pack, tmp_path / "a", "--training.steps", "4")
    batch = next(iter(t1.dataloader))
    # One update of loop 1 only: the routers of loops 2 and 3 get no gradient, hence no AdamW state.
    t1.optimizer.zero_grad(set_to_none=True)
    out = t1.model(
        batch["input_ids"], batch["positions"], batch["doc_ids"], loop_start=1, loop_end=1
    )
    out.logits_BSV.float().square().mean().backward()
    t1.optimizer.step()
    t1.state.step = 1
    stateless = {n for n, p in t1.model.named_parameters() if p not in t1.optimizer.state}
    assert stateless == {f"layers.{l}.moe.routers.{r}" for l in (0, 1) for r in (1, 2)}
    t1.checkpointer.save(1)
    keys = set(read_metadata(str(tmp_path / "a" / "checkpoint" / "step-1")))
    assert not any(".moe.routers.1." in k and k.startswith("optimizer.state.") for k in keys)
    t2 = make_trainer(tiny_pack, tmp_path / "a", "--training.steps", "4")
    assert {n for n, p in t2.model.named_parameters() if p not in t2.optimizer.state} == stateless
    assert_same_state(t1, t2)
    # The next full step (all loops) is identical: the routers start their AdamW state fresh.
    t1.train_step(batch)
    t2.train_step(batch)
    assert_same_state(t1, t2)


def test_saving_an_empty_optimizer_invents_no_state(tiny_pack, tmp_path):
    t1 = make_trainer(tiny_pack, tmp_path, "--training.steps", "2")
    before = {k: v.clone() for k, v in t1.model.state_dict().items()}
    t1.checkpointer.save(1)
    assert not t1.optimizer.state
    assert_same_tensors(before, t1.model.state_dict(), "model after save")
    assert not any(
        k.startswith("optimizer.state.")
        for k in read_metadata(str(tmp_path / "checkpoint" / "step-1"))
    )
    t2 = make_trainer(tiny_pack, tmp_path, "--training.steps", "2")
    assert not t2.optimizer.state


def test_torn_checkpoint_is_skipped_with_a_warning(tiny_pack, tmp_path, capsys):
    run(
        make_trainer(
            tiny_pack,
            tmp_path,
            "--training.steps",
            "3",
            "--checkpoint.interval",
            "1",
            "--checkpoint.keep_latest_k",
            "0",
        )
    )
    root = tmp_path / "checkpoint"
    os.remove(root / "step-3" / tree.MARKER)  # rank 0 died before the marker
    shutil.copytree(root / "step-2", root / ".tmp-step-4")  # a save killed mid-write
    capsys.readouterr()
    # run.json says finished: a relaunch continues it with more steps.
    t = make_trainer(tiny_pack, tmp_path, "--training.steps", "4")
    assert t.state.step == 2
    out = capsys.readouterr().out
    assert "warning: skipping incomplete checkpoint" in out
    assert str(root / "step-3") in out and str(root / ".tmp-step-4") in out
    assert f"resumed from {root / 'step-2'}" in out
    # The load is announced before it runs (a large checkpoint takes a while).
    assert out.index(f"loading checkpoint {root / 'step-2'} ...") < out.index("resumed from")


def test_keep_latest_k_snapshots_and_loading_a_snapshot(tiny_pack, tmp_path):
    t = run(
        make_trainer(
            tiny_pack,
            tmp_path,
            "--training.steps",
            "7",
            "--checkpoint.interval",
            "1",
            "--checkpoint.keep_latest_k",
            "2",
            "--checkpoint.snapshot_interval",
            "2",
            "--checkpoint.snapshot_keep",
            "2",
        )
    )
    root = str(tmp_path / "checkpoint")
    found = tree.scan(root)
    # Step 5 is the newest checkpoint followed by 2 healthy steps: keep 2 up to it, and all after.
    assert [e.step for e in found.of_kind("periodic")] == [4, 5, 6, 7]
    assert [e.step for e in found.of_kind("snapshot")] == [2, 4, 6]
    # The snapshot of step 6 shares the periodic files (hard links), marked as a snapshot.
    a = os.stat(os.path.join(root, "step-6", "__0_0.distcp"))
    b = os.stat(os.path.join(root, "snapshots", "step-6", "__0_0.distcp"))
    assert (a.st_ino, a.st_dev) == (b.st_ino, b.st_dev)
    index = tree.read_json(os.path.join(root, tree.INDEX))
    assert index["latest"] == "step-7" and index["final"] == "step-7"
    assert [s["path"] for s in index["snapshots"]] == [
        "snapshots/step-2",
        "snapshots/step-4",
        "snapshots/step-6",
    ]
    # Step 2 survives only as a snapshot; load_step finds it there.
    t2 = make_trainer(tiny_pack, tmp_path, "--training.steps", "7", "--checkpoint.load_step", "2")
    assert t2.state.step == 2 and t2.dataloader.state_dict()["cursor"] == 8
    assert t.state.step == 7


def test_async_save_stages_before_returning_and_commits(tiny_pack, tmp_path):
    t1 = make_trainer(
        tiny_pack, tmp_path, "--training.steps", "2", "--checkpoint.async_mode", "async"
    )
    run(t1)  # the final save is async too and committed by close()
    assert tree.scan(str(tmp_path / "checkpoint")).newest().step == 2
    expected = {k: v.clone() for k, v in t1.model.state_dict().items()}
    t1.checkpointer.save(3)
    with torch.no_grad():  # an optimizer step right after save() returns must not leak into it
        for p in t1.model.parameters():
            p.add_(1.0)
    t1.checkpointer.close()
    assert tree.is_complete(str(tmp_path / "checkpoint" / "step-3"))
    t2 = make_trainer(tiny_pack, tmp_path, "--training.steps", "3")  # the run finished at 2
    assert_same_tensors(expected, t2.model.state_dict(), "async-saved model")


def test_preemption_watcher_records_and_restores_handlers():
    before = signal.getsignal(signal.SIGUSR1)
    w = PreemptionWatcher(enabled=True)
    assert w.requested() == 0
    signal.raise_signal(signal.SIGUSR1)
    assert w.requested() == signal.SIGUSR1
    w.close()
    assert signal.getsignal(signal.SIGUSR1) == before
    assert PreemptionWatcher(enabled=False).installed is False


class _SignalledTrainer(Trainer):
    """Receives SIGTERM in the middle of step 3 (as a scheduler would send it)."""

    def train_step(self, batch):
        out = super().train_step(batch)
        if self.state.step == 3:
            signal.raise_signal(signal.SIGTERM)
        return out


def test_sigterm_finishes_the_step_saves_and_resumes_at_the_next(tiny_pack, tmp_path, capsys):
    before = signal.getsignal(signal.SIGTERM)
    t = make_trainer(tiny_pack, tmp_path, "--training.steps", "6", cls=_SignalledTrainer)
    assert t.train() == 0
    assert signal.getsignal(signal.SIGTERM) == before
    assert t.state.step == 3
    out = capsys.readouterr().out
    assert "received SIGTERM: stopped after step 3" in out and "relaunch the same command" in out
    assert tree.scan(str(tmp_path / "checkpoint")).newest().step == 3
    t2 = run(make_trainer(tiny_pack, tmp_path, "--training.steps", "6"))
    assert t2.state.step == 6
    rows = [r for r in open(tmp_path / "metrics.jsonl").read().splitlines()]
    assert [int(r.split('"step": ')[1].split(",")[0]) for r in rows] == [1, 2, 3, 4, 5, 6]


def test_spike_abort_does_not_save_the_step_it_stopped_at(tiny_pack, tmp_path):
    # A spike at step 2: that step already applied the segments before the spike (issue #11), so
    # the newest checkpoint stays step 1.
    t = make_trainer(
        tiny_pack,
        tmp_path,
        "--training.steps",
        "5",
        "--checkpoint.interval",
        "1",
        "--spike_guard.abort_on_spike",
        "true",
    )
    t.spike_guard.check = lambda seg, loss, step: "forced" if step >= 2 else None
    assert t.train() == 2
    assert tree.scan(str(tmp_path / "checkpoint")).newest().step == 1
    assert "loss spike at step 2" in (tmp_path / "SPIKE_ABORT.txt").read_text()


def test_resume_with_another_global_batch_is_refused(tiny_pack, tmp_path):
    run(make_trainer(tiny_pack, tmp_path, "--training.steps", "1"))
    from torchtitan_loom.config import ConfigError

    # The run folder's identity refuses it up front; without run.json (a run from before it) the
    # data loader's own state check still does.
    with pytest.raises(
        ConfigError, match=r"holds a different run \(training.global_batch_size: 4 → 2\)"
    ):
        make_trainer(
            tiny_pack, tmp_path, "--training.steps", "2", "--training.global_batch_size", "2"
        )
    os.remove(tmp_path / "run.json")
    with pytest.raises(CheckpointError, match="cannot restore 'dataloader'.*global_batch_rows=4"):
        make_trainer(
            tiny_pack, tmp_path, "--training.steps", "2", "--training.global_batch_size", "2"
        )


def test_disabled_manager_does_nothing(tiny_pack, tmp_path):
    cfg = load_config(
        [
            "--data.path",
            str(tiny_pack),
            "--job.dump_folder",
            str(tmp_path),
            "--training.seq_len",
            "32",
            "--training.global_batch_size",
            "2",
            "--training.micro_batch_size",
            "2",
            "--training.steps",
            "1",
            "--eval.interval",
            "0",
            "--metrics.enable_tensorboard",
            "false",
        ]
    )
    t = Trainer(cfg, resolve(cfg, 1), CPU)
    assert t.train() == 0 and not (tmp_path / "checkpoint").exists()
    assert not t.stop_signals.installed


@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            ["--checkpoint.load_step", "3"],
            "checkpoint.load_step = 3 needs checkpoint.enable = true",
        ),
        (
            ["--checkpoint.enable", "--checkpoint.load_step", "0"],
            "checkpoint.load_step = 0: must be -1",
        ),
        (
            ["--checkpoint.enable", "--checkpoint.keep_latest_k", "-1"],
            "checkpoint.keep_latest_k = -1: must be ≥ 0",
        ),
        (
            ["--checkpoint.enable", "--checkpoint.folder", "/abs"],
            "checkpoint.folder = '/abs': must be a non-empty",
        ),
        (
            ["--checkpoint.exit_after_step", "5"],
            "checkpoint.exit_after_step = 5 needs checkpoint.enable = true",
        ),
    ],
)
def test_checkpoint_config_errors(argv, expected, tmp_path):
    from torchtitan_loom.config import ConfigError

    with pytest.raises(ConfigError) as exc:
        resolve(load_config(["--job.dump_folder", str(tmp_path), *argv]), 1)
    assert expected in str(exc.value)


def test_a_finite_explosion_inside_the_guard_warm_up_keeps_a_checkpoint_from_before_it(
    tiny_pack, tmp_path
):
    """Issue 34: a step-8 run resumed at lr 10, a checkpoint every step, keep 1. Inside the spike
    guard's warm-up the exploded losses feed its running average until the plateau's steps are
    "healthy" (from step ~30 here);
    the proof's loss bound (proof.py: PROOF_LOSS_RATIO against the launch's first loss) still
    keeps a checkpoint saved before the explosion."""
    keep = ("--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "1")
    guard = ("--spike_guard.warmup_steps", "50", "--spike_guard.abort_on_spike", "false")
    run(make_trainer(tiny_pack, tmp_path, "--training.steps", "8", *keep, *guard))
    before = [e.step for e in tree.scan(str(tmp_path / "checkpoint")).of_kind("periodic")]
    t = make_trainer(
        tiny_pack, tmp_path, "--training.steps", "40", "--optimizer.lr", "10", *keep, *guard
    )
    run(t)
    rows = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    loss = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert min(loss[s] for s in range(30, 41)) > 10 * loss[9], loss  # it exploded, finitely
    assert all(math.isfinite(v) for v in loss.values())
    kept = [e.step for e in tree.scan(str(tmp_path / "checkpoint")).of_kind("periodic")]
    assert min(kept) <= 8, (before, kept)  # a checkpoint from before the explosion survives
