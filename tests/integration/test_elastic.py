"""Elastic training through ./run_train.sh NNODES=1:2, as on two nodes: two torchrun agents on this
machine (one gloo rank each, c10d rendezvous on localhost, node 1 hosting the store). Node 2 killed
whole (agent and worker, SIGKILL) mid-run: node 1 restarts alone at world size 1 from the newest
checkpoint and finishes, with the losses of a run resumed by hand from that checkpoint on one rank.
A node that joins a running one-node job: the job restarts at world size 2 from the step it saved.
A node whose agent alone dies: every rank saves, and node 1 restarts alone from that step. Killing
torchrun with checkpoints off: every rank stops after the same step, no traceback.

Time limits are multiples of the measured launch cost (tests/launch_cost.py)."""

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.integration.test_resume import (
    ENV,
    LAUNCHES,
    ROOT,
    common,
    losses,
    resume_copy,
    run_train,
)

STEPS = 20  # checkpoint.interval 6 (test_resume.common): saves at 6, 12, 18, 20


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node(args, port, log, host_store):
    """One "node": run_train.sh in elastic mode. Node 1 hosts the rendezvous store (is_host), so
    killing node 2 leaves the rendezvous alive (docs/parallelism.md#elastic-training)."""
    env = dict(
        os.environ,
        NNODES="1:2",
        NGPU="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        MAX_RESTARTS="3",
        # A short last call: a rendezvous that has one node waits 2 s for the other.
        RDZV_CONF=f"is_host={'true' if host_store else 'false'},last_call_timeout=2",
        **ENV,
    )
    return subprocess.Popen(
        ["./run_train.sh", *args],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _children(pid):
    """The trainer processes among ``pid``'s children (torchrun's also include the grep that
    run_train.sh pipes its stderr through)."""
    try:
        kids = [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    return [kid for kid in kids if b"torchtitan_loom" in _cmdline(kid)]


def _cmdline(pid):
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _sigterm_pending(pid):
    """Whether a SIGTERM waits for the (stopped) process ``pid`` (its shared pending set)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("ShdPnd:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    return False


def _kill_node(proc):
    """SIGKILL the agent, its process group and its workers (torchrun starts each worker in a
    session of its own), all at once, as when a node dies."""
    workers = _children(proc.pid)
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return workers


def _wait_trained(dump, step, procs, deadline):
    metrics = dump / "metrics.jsonl"
    while not (metrics.exists() and max(losses(dump), default=0) >= step):
        assert all(p.poll() is None for p in procs), "a node exited before training"
        assert time.monotonic() < deadline, f"step {step} was never reached"
        time.sleep(0.2)


def _finish(proc, log, deadline):
    try:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(
            "the elastic job did not finish:\n" + Path(log.name).read_text()[-3000:]
        ) from None
    return Path(log.name).read_text()


def _stop(procs):
    for p in procs:
        if p.poll() is None:
            _kill_node(p)


def test_a_lost_node_restarts_the_job_at_world_size_1(tiny_pack, tmp_path, launch_cost_s):
    dump, port = tmp_path / "elastic", _free_port()
    args = common(tiny_pack, steps=STEPS) + ["--job.dump_folder", str(dump)]
    deadline = time.monotonic() + LAUNCHES * launch_cost_s
    with open(tmp_path / "node1.log", "w") as log1, open(tmp_path / "node2.log", "w") as log2:
        node1 = _node(args, port, log1, host_store=True)
        node2 = _node(args, port, log2, host_store=False)
        try:
            _wait_trained(dump, 8, [node1, node2], deadline)  # past the step-6 save
            _kill_node(node2)
            killed = time.monotonic()
            while "world size was 2, now 1" not in Path(log1.name).read_text():
                assert node1.poll() is None and time.monotonic() < deadline, "no restart"
                time.sleep(0.2)
            # Seen with -s: from the kill to the restarted worker's resume line.
            print(f"elastic restart: resumed {time.monotonic() - killed:.1f} s after the kill")
            out = _finish(node1, log1, deadline)
        finally:
            _stop([node1, node2])
    assert node1.returncode == 0, out[-3000:]
    lost = re.search(
        r"lost a peer (?:during|after) step (\d+) \(.*\): exiting 3; .* resumes from step (\d+)",
        out,
    )
    assert lost, out[-3000:]
    resumed = int(lost.group(2))
    assert resumed == 6 or resumed == 12  # the newest complete checkpoint when node 2 died
    assert f"world size was 2, now 1, resumed from step {resumed}" in out
    assert "Traceback" not in out
    assert "failed (exitcode: 3)" not in out  # torchrun's echo of the restart the worker explained
    assert json.loads((dump / "run.json").read_text())["status"] == "finished"

    # By hand: the same checkpoint, resumed on one rank in a fresh folder.
    by_hand = tmp_path / "by_hand"
    resume_copy(dump, resumed, by_hand)
    run_train(
        common(tiny_pack, steps=STEPS) + ["--job.dump_folder", str(by_hand)], 1, launch_cost_s
    )
    want, got = losses(by_hand), losses(dump)
    assert sorted(want) == list(range(resumed + 1, STEPS + 1))
    # Both continue on ONE process without a process group from the same tensors and data
    # cursor: the same float operations in the same order, so the losses are bit-identical.
    assert {s: got[s] for s in want} == want


def test_a_node_that_joins_restarts_the_job_at_world_size_2(tiny_pack, tmp_path, launch_cost_s):
    dump, port = tmp_path / "grown", _free_port()
    args = common(tiny_pack, steps=STEPS) + [
        "--job.dump_folder",
        str(dump),
        "--checkpoint.interval",
        "1000",
    ]
    deadline = time.monotonic() + LAUNCHES * launch_cost_s
    with open(tmp_path / "node1.log", "w") as log1, open(tmp_path / "node2.log", "w") as log2:
        node1 = _node(args, port, log1, host_store=True)
        node2 = None
        try:
            _wait_trained(dump, 3, [node1], deadline)  # alone, at world size 1
            # Hold node 1's worker until its agent asks it to stop for the newcomer, so the join
            # comes at a known step however long node 2 takes to start.
            (worker,) = _children(node1.pid)  # run_train.sh exec'd torchrun: the agent's worker
            os.kill(worker, signal.SIGSTOP)
            node2 = _node(args, port, log2, host_store=False)
            while not _sigterm_pending(worker):
                assert node2.poll() is None and time.monotonic() < deadline, "node 2 never joined"
                time.sleep(0.2)
            os.kill(worker, signal.SIGCONT)
            out = _finish(node1, log1, deadline) + _finish(node2, log2, deadline)
        finally:
            _stop([p for p in (node1, node2) if p is not None])
    assert node1.returncode == 0 and node2.returncode == 0, out[-3000:]
    # The agent stops its worker for the newcomer (SIGTERM): it saves the step it reached, so the
    # restart at world size 2 trains no step twice.
    stopped = re.search(r"received SIGTERM: stopped after step (\d+), saved", out)
    assert stopped, out[-3000:]
    step = int(stopped.group(1))
    assert 3 <= step < STEPS
    assert f"world size was 1, now 2, resumed from step {step}" in out
    rows = [json.loads(r)["step"] for r in (dump / "metrics.jsonl").read_text().splitlines()]
    assert rows == list(range(1, STEPS + 1))
    assert json.loads((dump / "run.json").read_text())["status"] == "finished"


def _alive(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_killing_torchrun_with_checkpoints_off_stops_every_rank_cleanly(
    tiny_pack, tmp_path, launch_cost_s
):
    # Without stop handlers (checkpoints off) each rank used to SIGTERM itself: one died at once,
    # the other on a gloo "Connection reset by peer" traceback inside its next collective.
    dump = tmp_path / "unsaved"
    args = common(tiny_pack, steps=100000) + ["--job.dump_folder", str(dump)]
    args[args.index("--checkpoint.enable")] = "--checkpoint.enable=false"  # the preset saves
    # torchrun keeps each rank's output in a folder under TMPDIR (--tee): read it after its death.
    env = dict(os.environ, NGPU="2", TMPDIR=str(tmp_path), **ENV)
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
        deadline = time.monotonic() + LAUNCHES * launch_cost_s
        _wait_trained(dump, 2, [proc], deadline)
        ranks = _children(proc.pid)  # run_train.sh exec'd torchrun, whose children are the ranks
        assert len(ranks) == 2, ranks
        proc.kill()
        proc.wait()
        while any(_alive(p) for p in ranks):
            assert time.monotonic() < deadline, "the ranks kept training after their launcher died"
            time.sleep(0.2)
    finally:
        for p in ranks:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
    logs = {
        f"{p.parent.name}/{p.name}": p.read_text()
        for p in tmp_path.glob("torchelastic_*/**/attempt_0/*/std*.log")
    }
    assert sorted(logs) == ["0/stderr.log", "0/stdout.log", "1/stderr.log", "1/stdout.log"]
    stopped = max(losses(dump))
    assert f"stopped after step {stopped}, nothing saved (checkpoints off)" in logs["0/stdout.log"]
    # Each rank notices within a second; one noticing is enough (the stop flag is agreed).
    assert any(
        "is gone: stopping after this step as on SIGTERM" in logs[f"{r}/stdout.log"] for r in "01"
    )
    for rank in "01":
        assert "Traceback" not in logs[f"{rank}/stderr.log"], logs[f"{rank}/stderr.log"][-2000:]
    assert json.loads((dump / "run.json").read_text())["status"] == "stopped"


def test_a_node_whose_agent_dies_saves_and_the_rest_restart_without_it(
    tiny_pack, tmp_path, launch_cost_s
):
    # Node 2's agent killed, its worker alive: the worker stops (its launcher is gone) and every
    # rank saves that step. Node 1's worker used to exit 0 as on a preemption, so its agent waited
    # at its exit barrier for the dead node and the job ended there; it now exits 3 (RESTART).
    dump, port = tmp_path / "orphan", _free_port()
    args = common(tiny_pack, steps=STEPS) + ["--job.dump_folder", str(dump)]
    deadline = time.monotonic() + LAUNCHES * launch_cost_s
    with open(tmp_path / "node1.log", "w") as log1, open(tmp_path / "node2.log", "w") as log2:
        node1 = _node(args, port, log1, host_store=True)
        node2 = _node(args, port, log2, host_store=False)
        worker2 = []
        try:
            _wait_trained(dump, 3, [node1, node2], deadline)
            worker2 = _children(node2.pid)
            os.killpg(node2.pid, signal.SIGKILL)  # the agent only: its worker has its own session
            node2.wait()
            out = _finish(node1, log1, deadline)
            while any(_alive(p) for p in worker2):
                assert time.monotonic() < deadline, "node 2's worker outlived its launcher"
                time.sleep(0.2)
        finally:
            _stop([node1, node2])
            for p in worker2:
                if _alive(p):
                    os.kill(p, signal.SIGKILL)
    out += Path(log2.name).read_text()
    assert node1.returncode == 0, out[-3000:]
    stop = re.search(
        r"stopped after step (\d+), saved \S+; exiting 3: torchrun's elastic agent", out
    )
    assert stop, out[-3000:]
    step = int(stop.group(1))
    assert f"world size was 2, now 1, resumed from step {step}" in out  # nothing trained twice
    rows = [json.loads(r)["step"] for r in (dump / "metrics.jsonl").read_text().splitlines()]
    assert rows == list(range(1, STEPS + 1))
    assert json.loads((dump / "run.json").read_text())["status"] == "finished"
