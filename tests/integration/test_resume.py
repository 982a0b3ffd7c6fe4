"""Restarts through ./run_train.sh, as a user runs them: bit-exact resume at the same world size,
resume on fewer ranks (4 → 2 → 1, with the default data-parallel layout and with dp_shard × ep),
SIGTERM → save → exit 0 → resume, export of 4-rank checkpoints. Launches are shared through
module fixtures; every run uses OMP_NUM_THREADS=1 (CPU matmul rounding depends on the thread
count)."""

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from torchtitan_loom.components.checkpoint import load_full, tree
from torchtitan_loom.config import ConfigError, load_config
from torchtitan_loom.config.validate import resolve
from torchtitan_loom.tools import export as export_tool

ROOT = Path(__file__).resolve().parents[2]
ENV = {"OMP_NUM_THREADS": "1"}
# Runs on different world sizes add the ranks' gradients in a different order (1-ulp changes).
# Two discrete parts of MoE training can turn that into a jump: the expert-bias update (the sign
# of integer loads moves the bias by ±bias_lr) and capacity dropping (which tokens an expert
# keeps). With them on, even UNINTERRUPTED 4-rank and 1-rank runs differ by up to 9e-4 within 12
# steps (measured), so the 1e-5 bound of a resharded resume is checked with both off (uninterrupted
# 4 vs 1 ranks then stay within 1.3e-6, resumed runs within 1.0e-6 of the 4-rank run, measured).
# Same-world-size restarts keep them on and are bit-exact.
SMOOTH = ["--model.load_balance_bias_lr", "0", "--model.capacity_factor", "0"]


def common(pack, steps=12):
    return [
        "--data.path",
        str(pack),
        "--training.seq_len",
        "32",
        "--training.steps",
        str(steps),
        "--training.global_batch_size",
        "4",
        "--training.micro_batch_size",
        "1",
        "--training.mixed_precision_param",
        "float32",
        "--metrics.log_freq",
        "1",
        "--eval.interval",
        "0",
        "--metrics.enable_tensorboard",
        "false",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "6",
        "--checkpoint.keep_latest_k",
        "0",
    ]


LAUNCHES = (
    60  # one run's limit, in bare-launch costs (tests/launch_cost.py): 300 s at its 5 s floor
)


def run_train(args, ngpu, cost_s):
    """./run_train.sh on ``ngpu`` ranks; ``cost_s``: the measured launch cost (launch_cost_s)."""
    env = dict(os.environ, NGPU=str(ngpu), **ENV)
    proc = subprocess.run(
        ["./run_train.sh", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=LAUNCHES * cost_s,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def losses(dump):
    return {
        r["step"]: r["loss"]
        for r in map(json.loads, Path(dump, "metrics.jsonl").read_text().splitlines())
    }


def checkpoint(dump, step):
    return str(Path(dump, "checkpoint", f"step-{step}"))


def assert_same_checkpoint(a, b):
    """Model and optimizer tensors bit for bit (read without a process group, full shapes)."""
    sa, sb = load_full(a), load_full(b)
    tensors = [
        k
        for k in sa
        if k.startswith(("model.", "optimizer.state.")) and isinstance(sa[k], torch.Tensor)
    ]
    assert len(tensors) > 50 and set(tensors) == {
        k for k in sb if k.startswith(("model.", "optimizer.state."))
    }
    for k in tensors:
        assert torch.equal(sa[k], sb[k]), k
    for k in (
        "train_state.step",
        "dataloader.cursor",
        "lr_scheduler.last_epoch",
        "spike_guard.ema",
    ):
        assert sa[k] == sb[k], k


def resume_copy(src_dump, step, dst_dump):
    """A new run folder holding only ``step`` of ``src_dump`` (as if moved to another cluster)."""
    os.makedirs(Path(dst_dump, "checkpoint"))
    shutil.copytree(checkpoint(src_dump, step), checkpoint(dst_dump, step))


@pytest.fixture(scope="module")
def one_rank_straight(tiny_pack, tmp_path_factory, launch_cost_s):
    dump = tmp_path_factory.mktemp("straight1")
    run_train(common(tiny_pack) + ["--job.dump_folder", str(dump)], 1, launch_cost_s)
    return dump


@pytest.fixture(scope="module")
def four_rank_straight(tiny_pack, tmp_path_factory, launch_cost_s):
    dump = tmp_path_factory.mktemp("straight4")
    run_train(common(tiny_pack) + SMOOTH + ["--job.dump_folder", str(dump)], 4, launch_cost_s)
    return dump


def test_bit_exact_restart_same_world_size(one_rank_straight, tiny_pack, tmp_path, launch_cost_s):
    dump = tmp_path / "restarted"
    out = run_train(
        common(tiny_pack) + ["--job.dump_folder", str(dump), "--checkpoint.exit_after_step", "6"],
        1,
        launch_cost_s,
    )
    assert "checkpoint.exit_after_step = 6 reached" in out
    assert max(losses(dump)) == 6  # the process really stopped at step 6
    out = run_train(common(tiny_pack) + ["--job.dump_folder", str(dump)], 1, launch_cost_s)
    assert f"resumed from {checkpoint(dump, 6)} (step 6)" in out
    assert losses(dump) == losses(one_rank_straight)  # identical floats, steps 1..12
    assert_same_checkpoint(checkpoint(dump, 6), checkpoint(one_rank_straight, 6))
    assert_same_checkpoint(checkpoint(dump, 12), checkpoint(one_rank_straight, 12))


@pytest.mark.parametrize("ngpu", [2, 1])
def test_resharded_restart_from_four_ranks(
    four_rank_straight, tiny_pack, tmp_path, ngpu, launch_cost_s
):
    dump = tmp_path / f"on{ngpu}"
    resume_copy(four_rank_straight, 6, dump)
    out = run_train(
        common(tiny_pack) + SMOOTH + ["--job.dump_folder", str(dump)], ngpu, launch_cost_s
    )
    assert f"(step 6, saved at 4 ranks, now {ngpu})" in out
    want, got = losses(four_rank_straight), losses(dump)
    assert sorted(got) == list(range(7, 13))
    for s in got:  # same global batches; only the order of floating-point sums differs
        assert abs(got[s] - want[s]) <= 1e-5 * abs(want[s]), (s, got[s], want[s])
    final = load_full(checkpoint(dump, 12), "model.")
    ref = load_full(checkpoint(four_rank_straight, 12), "model.")
    for k in ref:
        assert torch.allclose(final[k], ref[k], rtol=1e-5, atol=1e-7), k


def test_export_of_a_four_rank_checkpoint(four_rank_straight, tmp_path):
    out = tmp_path / "export"
    assert export_tool.main([str(four_rank_straight), str(out), "--verify"]) == 0
    assert tree.read_json(str(out / "model_args.json"))["step"] == 12


def _ep_layout(world, base):
    """The first dp_shard × ep spelling that validation accepts at ``world`` ranks, else None."""
    for extra in (
        ["--parallelism.dp_shard", "2", "--parallelism.ep", "2"],
        ["--parallelism.dp_shard", "4", "--parallelism.ep", "2"],
    ):
        try:
            resolve(load_config(base + extra), world)
            return extra
        except ConfigError:
            continue
    return None


def test_resharded_restart_from_fsdp_x_ep(tiny_pack, tmp_path, launch_cost_s):
    """Save at 4 ranks with FSDP × expert parallelism, resume at 2 ranks (FSDP only) and at 1:
    the losses after the restart follow the uninterrupted 4-rank run within 1e-5 relative
    (measured ≤ 5.5e-7; uninterrupted 4-rank EP and 2-rank runs differ by ≤ 5.6e-7 themselves)."""
    ep = _ep_layout(4, common(tiny_pack) + SMOOTH + ["--job.dump_folder", str(tmp_path / "probe")])
    if ep is None:
        pytest.skip(
            "config validation still rejects parallelism.dp_shard × parallelism.ep at 4 ranks "
            "(FSDP/EP not landed); the resharding path is covered by the default layout above"
        )
    straight = tmp_path / "ep4"
    run_train(
        common(tiny_pack) + SMOOTH + ["--job.dump_folder", str(straight)] + ep, 4, launch_cost_s
    )
    want = losses(straight)
    for ngpu, extra in ((2, ["--parallelism.dp_shard", "2"]), (1, [])):
        dump = tmp_path / f"ep_on{ngpu}"
        resume_copy(straight, 6, dump)
        out = run_train(
            common(tiny_pack) + SMOOTH + ["--job.dump_folder", str(dump)] + extra,
            ngpu,
            launch_cost_s,
        )
        assert f"(step 6, saved at 4 ranks, now {ngpu})" in out
        got = losses(dump)
        assert sorted(got) == list(range(7, 13))
        for s in got:
            assert abs(got[s] - want[s]) <= 1e-5 * abs(want[s]), (ngpu, s, got[s], want[s])
    # Expert weights sharded over ep and FSDP come out consolidated, bit for bit.
    assert export_tool.main([str(straight), str(tmp_path / "export"), "--verify"]) == 0


def test_sigterm_saves_exits_0_and_the_next_launch_continues(tiny_pack, tmp_path, launch_cost_s):
    dump = tmp_path / "preempted"
    args = common(tiny_pack, steps=400) + [
        "--job.dump_folder",
        str(dump),
        "--checkpoint.interval",
        "1000",
    ]
    env = dict(os.environ, NGPU="1", **ENV)
    proc = subprocess.Popen(
        ["./run_train.sh", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = dump / "metrics.jsonl"
    deadline = time.monotonic() + LAUNCHES * launch_cost_s
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):  # wait until it trains
        assert proc.poll() is None and time.monotonic() < deadline, "the run never started training"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=LAUNCHES * launch_cost_s)
    assert proc.returncode == 0, out[-3000:]
    stopped = max(losses(dump))
    assert stopped < 400 and f"received SIGTERM: stopped after step {stopped}" in out
    assert tree.scan(str(dump / "checkpoint")).newest().step == stopped
    out = run_train(args + ["--checkpoint.exit_after_step", str(stopped + 2)], 1, launch_cost_s)
    assert f"(step {stopped})" in out
    rows = [json.loads(r)["step"] for r in metrics.read_text().splitlines()]
    assert rows == list(range(1, stopped + 3))  # continued at the next step, none repeated


def _children(pid):
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _alive(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_killing_the_launcher_stops_the_ranks_and_they_save(tiny_pack, tmp_path, launch_cost_s):
    # kill -9 of torchrun alone used to leave both ranks training to the end, unattended.
    dump = tmp_path / "orphaned"
    args = common(tiny_pack, steps=100000) + [
        "--job.dump_folder",
        str(dump),
        "--checkpoint.interval",
        "100000",
    ]
    env = dict(os.environ, NGPU="2", **ENV)
    proc = subprocess.Popen(
        ["./run_train.sh", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    ranks = []
    try:
        metrics, deadline = dump / "metrics.jsonl", time.monotonic() + LAUNCHES * launch_cost_s
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):  # both ranks train
            assert proc.poll() is None and time.monotonic() < deadline, (
                "the run never started training"
            )
            time.sleep(0.2)
        ranks = _children(proc.pid)  # run_train.sh exec'd torchrun, whose children are the ranks
        assert len(ranks) == 2, ranks
        proc.kill()
        proc.wait()
        deadline = (
            time.monotonic() + LAUNCHES * launch_cost_s
        )  # a bound against hanging, not a timing claim
        while any(_alive(p) for p in ranks):
            assert time.monotonic() < deadline, "the ranks kept training after their launcher died"
            time.sleep(0.2)
    finally:
        for p in ranks:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
    stopped = max(losses(dump))
    assert tree.scan(str(dump / "checkpoint")).newest().step == stopped  # saved on the way out
    assert json.loads((dump / "run.json").read_text())["status"] == "stopped"
