"""Two "nodes" on one machine through ./run_train.sh NNODES=2 (one gloo rank each), as a cluster
gives them (issue 34):

- node-local dump folders: node 2 runs in a mount namespace of its own where the dump path is a
  private folder (what a node-local disk mounted at the same path gives). The launch stops at the
  start with one line on both nodes, exit 2, and no checkpoint is ever committed;
- two jobs sharing one rendezvous (same MASTER_PORT, different dump folders) merge into one process
  group: both stop at the start with one line, exit 2, nothing written into either folder but the
  released lock.

The commit's own check (a checkpoint whose metadata names a file that is not there is never
committed) is tests/unit/test_checkpoint_integrity.py's. Limits are multiples of the measured
launch cost (tests/launch_cost.py)."""

import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from tests.integration.test_resume import ENV, LAUNCHES, ROOT, common

# The ranks exit 2; torchrun, which a multi-node launch runs under, reports any failed worker as 1.
STOPPED = (1, 2)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _can_mount_privately(tmp_path) -> bool:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    a, b = tmp_path / "probe_a", tmp_path / "probe_b"
    a.mkdir(), b.mkdir()
    cmd = f"mount --bind {b} {a} && touch {a}/x"
    ok = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", cmd]).returncode
    return ok == 0 and (b / "x").exists() and not (a / "x").exists()


def _node(rank, args, port, private=None):
    """run_train.sh as node ``rank`` of 2; ``private``: (folder, path) mounted over path for it."""
    env = dict(
        os.environ, NNODES="2", NODE_RANK=str(rank), NGPU="1", MASTER_ADDR="127.0.0.1", **ENV
    )
    env["MASTER_PORT"] = str(port)
    cmd = ["./run_train.sh", *args]
    if private is not None:
        folder, path = private
        script = f'mount --bind "{folder}" "{path}" && exec "$@"'
        cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *cmd]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _finish(procs, limit_s):
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=limit_s)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        outs.append((p.returncode, out))
    return outs


def _args(pack, dump):
    return [*common(pack, steps=4), "--job.dump_folder", str(dump), "--checkpoint.interval", "1"]


def test_node_local_dump_folders_stop_at_the_start_and_commit_nothing(
    tiny_pack, tmp_path, launch_cost_s
):
    if not _can_mount_privately(tmp_path):
        pytest.skip("needs root and unshare to give one node a private mount")
    dump, private = tmp_path / "run", tmp_path / "node2_disk"
    dump.mkdir(), private.mkdir()
    port = _free_port()
    procs = [
        _node(0, _args(tiny_pack, dump), port),
        _node(1, _args(tiny_pack, dump), port, private=(private, dump)),
    ]
    for code, out in _finish(procs, LAUNCHES * launch_cost_s):
        assert code in STOPPED, out[-3000:]
        line = next(ln for ln in out.splitlines() if "run folder error" in ln)
        assert "rank 1" in line and "does not see the file rank 0" in line, out[-3000:]
        assert "one folder shared by every node" in line
    for folder in (dump, private):
        assert not (folder / "checkpoint").exists() or not any(
            p.name.startswith("step-") for p in (folder / "checkpoint").iterdir()
        )
        assert not [p for p in folder.iterdir() if p.name.startswith(".shared-probe-")]


def test_two_jobs_on_one_rendezvous_stop_at_the_start(tiny_pack, tmp_path, launch_cost_s):
    a, b = tmp_path / "job_a", tmp_path / "job_b"
    port = _free_port()
    procs = [_node(0, _args(tiny_pack, a), port), _node(1, _args(tiny_pack, b), port)]
    outs = _finish(procs, LAUNCHES * launch_cost_s)
    # The second node's console (its local rank 0 is not rank 0) says it joined (issue 35).
    assert "[torchtitan_loom] joined the run as rank 1 of 2" in outs[1][1], outs[1][1][-3000:]
    for code, out in outs:
        assert code in STOPPED, out[-3000:]
        line = next(ln for ln in out.splitlines() if "run folder error" in ln)
        assert "rank 1" in line and "another config than rank 0" in line, line
    for folder in (a, b):
        written = sorted(p.name for p in folder.iterdir()) if folder.exists() else []
        assert "metrics.jsonl" not in written and "checkpoint" not in written, written
        assert (
            not Path(folder / "run.json").exists()
            or "running" not in (folder / "run.json").read_text()
        )
