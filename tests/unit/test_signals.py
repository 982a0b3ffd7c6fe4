"""Signals (issue #11): SIGTERM / SIGUSR1 / SIGINT are acknowledged at once, eval and the step stop
at micro-batch granularity, the run saves and exits 0 (130 for SIGINT), and a step abandoned by a
signal leaves no trace: the resumed run is bit-identical to one never interrupted."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.unit.test_checkpoint import assert_same_state, make_trainer, run
from torchtitan_loom import launch
from torchtitan_loom.components.checkpoint import tree
from torchtitan_loom.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
STEPS = ("--training.steps", "5", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0")


def signal_on_forward(trainer, sig, *, step, call, training):
    """Raise ``sig`` at the ``call``-th model forward (1-based) of global step ``step`` + 1, in
    training (``training``) or eval mode: i.e. in the middle of that step's micro-batches."""
    seen = {"n": 0}

    def hook(module, args):
        if module.training == training and trainer.state.step == step:
            seen["n"] += 1
            if seen["n"] == call:
                signal.raise_signal(sig)

    return trainer.model.register_forward_pre_hook(hook)


@pytest.fixture(scope="module")
def straight(tiny_pack, tmp_path_factory):
    return run(make_trainer(tiny_pack, tmp_path_factory.mktemp("straight"), *STEPS))


@pytest.mark.parametrize(
    "sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 0), (signal.SIGUSR1, 0)]
)
def test_signal_mid_step_abandons_it_saves_and_resumes_bit_identically(
    tiny_pack, tmp_path, capfd, straight, sig, code
):
    before = signal.getsignal(sig)
    t = make_trainer(tiny_pack, tmp_path / "run", *STEPS)
    signal_on_forward(
        t, sig, step=2, call=1, training=True
    )  # during step 3's first micro-batch (of 2)
    assert t.train() == code
    assert signal.getsignal(sig) == before
    out = capfd.readouterr().out
    assert f"received {signal.Signals(sig).name}: stopping after the step in progress" in out
    assert t.state.step == 2 and t.dataloader.state_dict()["cursor"] == 2 * 4
    assert tree.scan(str(tmp_path / "run" / "checkpoint")).newest().step == 2
    resumed = run(make_trainer(tiny_pack, tmp_path / "run", *STEPS))
    assert_same_state(straight, resumed)


def test_sigterm_during_eval_stops_the_eval_saves_and_exits_0(tiny_pack, tmp_path, capfd):
    t = make_trainer(tiny_pack, tmp_path, *STEPS, "--eval.interval", "2", "--eval.tokens", "1000")
    signal_on_forward(
        t, signal.SIGTERM, step=2, call=1, training=False
    )  # the first eval micro-batch
    assert t.train() == 0 and t.state.step == 2
    out = capfd.readouterr().out
    assert (
        "received SIGTERM: stopping after the step in progress" in out
        and "stopped after step 2" in out
    )
    rows = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert (
        rows[-1]["step"] == 2 and "eval_loss" not in rows[-1]
    )  # the interrupted eval is not reported
    assert tree.scan(str(tmp_path / "checkpoint")).newest().step == 2


def _reader(proc, lines):
    for line in proc.stdout:
        lines.append((time.monotonic(), line))


@pytest.mark.parametrize(
    "sig, code, checkpoints",
    [(signal.SIGTERM, 0, True), (signal.SIGINT, 130, True), (signal.SIGINT, 130, False)],
)
def test_signal_is_acknowledged_within_a_second_from_the_command_line(
    tiny_pack, tmp_path, sig, code, checkpoints
):
    dump = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torchtitan_loom.train",
        "--data.path",
        str(tiny_pack),
        "--job.dump_folder",
        str(dump),
        "--training.seq_len",
        "32",
        "--training.global_batch_size",
        "4",
        "--training.micro_batch_size",
        "2",
        "--training.steps",
        "100000",
        "--eval.interval",
        "0",
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
        "false",
        "--checkpoint.enable",
        str(checkpoints).lower(),
        "--checkpoint.interval",
        "1000000",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    lines = []
    threading.Thread(target=_reader, args=(proc, lines), daemon=True).start()
    try:
        deadline, metrics = time.monotonic() + 120, dump / "metrics.jsonl"
        while time.monotonic() < deadline and not (
            metrics.exists() and len(metrics.read_text().splitlines()) >= 3
        ):
            time.sleep(0.05)  # training is under way (3 steps logged)
        sent = time.monotonic()
        proc.send_signal(sig)
        assert proc.wait(timeout=120) == code, "".join(l for _, l in lines)[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(0.2)
    text = "".join(l for _, l in lines)
    assert "Traceback" not in text
    if not checkpoints:  # nothing to save: Ctrl-C is one line and 130
        assert "interrupted (SIGINT): stopped without saving" in text
        return
    acks = [t for t, l in lines if f"received {signal.Signals(sig).name}: stopping" in l]
    assert acks and acks[0] - sent < 1.0, (acks, sent)
    assert tree.scan(str(dump / "checkpoint")).newest() is not None


def test_an_unreachable_launcher_store_counts_as_the_launcher_gone():
    from torchtitan_loom.components.runtime.preemption import LauncherWatch

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        "TORCHELASTIC_RUN_ID": "x",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    assert LauncherWatch.applies(env) and not LauncherWatch.applies({})
    gone = threading.Event()
    reasons = []
    watch = LauncherWatch.start(
        env, poll_s=0.01, on_gone=lambda why: (reasons.append(why), gone.set())
    )
    try:
        assert gone.wait(60), "an unreachable store was never noticed"
    finally:
        watch.close()
    assert reasons == [f"the launcher's store 127.0.0.1:{port} is unreachable"]


def test_ctrl_c_twice_exits_130_and_run_json_says_stopped(tiny_pack, tmp_path, capfd):
    class TwiceInterrupted(Trainer):  # Ctrl-C pressed twice during step 3
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)

            def hook(module, args):
                if module.training and self.state.step == 2:
                    signal.raise_signal(signal.SIGINT)
                    signal.raise_signal(signal.SIGINT)

            self.model.register_forward_pre_hook(hook)

    argv = [
        "--data.path",
        str(tiny_pack),
        "--job.dump_folder",
        str(tmp_path),
        "--training.seq_len",
        "32",
        "--training.global_batch_size",
        "4",
        "--training.micro_batch_size",
        "2",
        "--training.mixed_precision_param",
        "float32",
        "--eval.interval",
        "0",
        "--metrics.enable_tensorboard",
        "false",
        "--checkpoint.enable",
        *STEPS,
    ]
    assert launch.run(argv, TwiceInterrupted) == 130
    assert "interrupted (SIGINT): stopped without saving" in capfd.readouterr().err
    run_json = json.loads((tmp_path / "run.json").read_text())
    assert run_json["status"] == "stopped" and run_json["step"] == 2  # was left at "running"


def test_the_sigint_stop_line_names_the_exit_code_it_exits_with(tiny_pack, tmp_path, capfd):
    t = make_trainer(tiny_pack, tmp_path, *STEPS)
    calls = {"n": 0}

    def hook(module, args):  # after step 2's save: the stop is taken between steps, not in a step
        if module.training and t.state.step == 2 and calls["n"] == 0:
            calls["n"] += 1
            signal.raise_signal(signal.SIGINT)

    t.model.register_forward_pre_hook(hook)
    assert t.train() == 130
    out = capfd.readouterr().out
    assert "exiting 130" in out and "exiting 0" not in out, out


def test_a_signal_during_a_save_does_not_save_that_step_twice(tiny_pack, tmp_path, capfd):
    t = make_trainer(tiny_pack, tmp_path, *STEPS)
    real, saved = t.checkpointer.writer._save, []

    def save_then_signal(target, *args):  # the writer's _save(SaveTarget, ...)
        saved.append(target.step)
        real(target, *args)
        if target.step == 2:
            signal.raise_signal(signal.SIGTERM)  # arrives while step 2's save is being written

    t.checkpointer.writer._save = save_then_signal
    assert t.train() == 0 and t.state.step == 2
    assert saved == [1, 2]  # step 2 was saved once; the stop that followed it found it saved
    out = capfd.readouterr().out
    assert (
        out.count("checkpoint step 2 saved") == 1
        and "saved " + str(tmp_path / "checkpoint" / "step-2") in out
    )
