"""End-to-end runs of ./run_train.sh (torchrun underneath), as a user would launch them."""

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_train(args, env_extra=None, timeout=600):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run(
        ["./run_train.sh", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_default_run_trains_and_logs(tmp_path, launch_cost_s):
    dump = tmp_path / "run"
    # One thread (two on two busy cores ran ~3x the CPU) and a limit that grows with the load: a
    # 2-rank launch costs launch_cost_s here now; 20 steps are ~10 such launches on a quiet machine.
    proc = run_train(
        ["--training.steps", "20", "--job.dump_folder", str(dump), "--metrics.log_freq", "5"],
        {"NGPU": "1", "OMP_NUM_THREADS": "1"},
        timeout=max(600, 60 * launch_cost_s),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = read_jsonl(dump / "metrics.jsonl")
    assert [r["step"] for r in rows] == [5, 10, 15, 20]
    for key in (
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "mfu",
        "skipped",
        "loss_segment_1",
        "loss_segment_3",
    ):
        assert key in rows[0], key
    assert "expert_load" not in rows[0]  # metrics.expert_load_every = 0: eval steps only
    assert rows[0]["mfu"] is None  # CPU: no peak FLOP/s, MFU left null
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.3, [r["loss"] for r in rows]
    last = rows[-1]
    assert {"eval_loss", "eval_loss_loop_1", "eval_loss_loop_3"} <= last.keys()
    assert last["eval_loss"] == last["eval_loss_loop_3"]
    load = last["expert_load"]  # [layer][loop][expert]
    assert len(load) == 2 and len(load[0]) == 3 and len(load[0][0]) == 8
    assert (dump / "config.toml").exists()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (launch,) = (dump / "tb").iterdir()  # one sub-folder per launch
    acc = EventAccumulator(str(launch))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    loss_tag = next(
        t for t in tags if t.endswith("loss") and "eval" not in t and "segment" not in t
    )
    assert [e.step for e in acc.Scalars(loss_tag)] == [5, 10, 15, 20]
    assert abs(acc.Scalars(loss_tag)[-1].value - rows[-1]["loss"]) < 1e-4
    assert any("eval" in t for t in tags)


def test_two_ranks_match_one_rank(tmp_path, tiny_pack):
    # Same global batches, token-mean gradients: the world size must not change the trajectory.
    common = [
        "--data.path",
        str(tiny_pack),
        "--training.seq_len",
        "32",
        "--training.steps",
        "3",
        "--training.global_batch_size",
        "4",
        "--training.micro_batch_size",
        "2",
        "--training.mixed_precision_param",
        "float32",
        "--metrics.log_freq",
        "1",
        "--eval.interval",
        "3",
        "--eval.tokens",
        "500",
    ]
    runs = {}
    for name, ngpu, extra in (
        ("single", "1", []),
        ("replicas", "2", ["--parallelism.dp_replicate", "2"]),
        ("fsdp", "2", []),
    ):
        dump = tmp_path / name
        # One thread per rank in every run: CPU matmul blocking (and so rounding) depends on threads.
        proc = run_train(
            common + extra + ["--job.dump_folder", str(dump)],
            {"NGPU": ngpu, "OMP_NUM_THREADS": "1"},
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        runs[name] = [(r["loss"], r.get("eval_loss")) for r in read_jsonl(dump / "metrics.jsonl")]
    assert runs["single"][-1][1] is not None
    # Plain replicas: same micro-batches, gradients summed by one all-reduce of two addends, which
    # commute exactly -> bitwise equal.
    assert runs["replicas"] == runs["single"]
    # FSDP2 reduce-scatters shards, which may sum in another order: step 1 (before any update) must
    # agree to fp32 rounding; later steps pass through AdamW, whose first updates are ~lr*sign(g)
    # and can amplify 1e-7 differences to ~1e-4. (Measured here: bitwise equal, 2026-11-29.)
    (l1, _), (f1, _) = runs["single"][0], runs["fsdp"][0]
    assert f1 == pytest.approx(l1, rel=1e-6)
    for (l, e), (f, g) in zip(runs["single"], runs["fsdp"]):
        assert f == pytest.approx(l, rel=1e-3)
        assert (e is None and g is None) or g == pytest.approx(e, rel=1e-3)


def test_spike_abort_exits_2_with_message(tmp_path, tiny_pack):
    dump = tmp_path / "spike"
    # lr 10 from step 1 (no warmup): step 2's loss rises by ~285, a finite hard spike. (A larger lr
    # overflows the gradients, and a non-finite gradient stops the run whatever abort_on_spike says.)
    proc = run_train(
        [
            "--data.path",
            str(tiny_pack),
            "--training.seq_len",
            "32",
            "--training.steps",
            "5",
            "--training.global_batch_size",
            "2",
            "--training.micro_batch_size",
            "2",
            "--eval.interval",
            "0",
            "--job.dump_folder",
            str(dump),
            "--optimizer.lr",
            "1e1",
            "--lr_scheduler.warmup_ratio",
            "0",
            "--spike_guard.warmup_steps",
            "0",
            "--spike_guard.abort_on_spike",
            "true",
        ],
        {"NGPU": "1"},
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "loss spike at step 2" in (dump / "SPIKE_ABORT.txt").read_text()
    assert "abort_on_spike" in proc.stdout + proc.stderr


def test_config_error_exits_2_before_launching_ranks(tmp_path):
    proc = run_train(["--training.global_batch_size", "3"], {"NGPU": "1"})
    assert proc.returncode != 0
    assert "training.global_batch_size = 3: must be divisible" in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "env, message",
    [
        ({"NGPU": "0"}, "NGPU=0: expected the number of processes per node, 1 to 9999"),
        ({"NGPU": "-2"}, "NGPU=-2: expected the number of processes per node"),
        ({"NGPU": "abc"}, "NGPU=abc: expected the number of processes per node"),
        ({"NNODES": "0"}, "NNODES=0: expected a node count ≥ 1 (or MIN:MAX for an elastic run)"),
        ({"NNODES": "two"}, "NNODES=two: expected a node count ≥ 1"),
    ],
)
def test_a_bad_process_or_node_count_is_one_line_before_python_starts(env, message, tmp_path):
    # PYTHON points at nothing: the launcher must answer before it would start any Python.
    proc = run_train(["--job.dump_folder", str(tmp_path)], {**env, "PYTHON": "/nonexistent"}, 30)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_gpus_are_counted_without_torch(tmp_path):
    """No NGPU: CUDA_VISIBLE_DEVICES (here empty: no GPU, one CPU rank) is read by the shell; with a
    PYTHON that only records its arguments, the first Python started is the trainer itself."""
    log = tmp_path / "calls"
    fake = tmp_path / "python"
    fake.write_text(f'#!/usr/bin/env bash\necho "$*" >> {log}\n')
    fake.chmod(0o755)
    env = {"PYTHON": str(fake), "CUDA_VISIBLE_DEVICES": ""}
    os_env = {k: v for k, v in os.environ.items() if k != "NGPU"}
    proc = subprocess.run(
        ["./run_train.sh", "--training.steps", "1"],
        cwd=ROOT, env={**os_env, **env}, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (call,) = log.read_text().splitlines()
    # The trainer itself (its default preset: no --job.config_file), not a Python probing for GPUs.
    assert call == "-m torchtitan_loom.train --training.steps 1", call
