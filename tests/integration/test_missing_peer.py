"""A peer that never joins (issue 34): the campaign saw a traceback after the whole 300 s init
timeout. Now rank 0, alone in a 2-rank world, waits comm.init_timeout_seconds and ends with one
line naming the wait, the address and what to check (exit 2), leaving the run folder unlocked."""

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_rank_alone_in_its_world_ends_with_one_line_after_the_init_timeout(tmp_path):
    port = _free_port()
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        WORLD_SIZE="2",
        RANK="0",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    argv = [
        "--job.config_file",
        str(ROOT / "train_configs" / "debug_model.toml"),
        "--job.dump_folder",
        str(tmp_path / "run"),
        "--comm.init_timeout_seconds",
        "3",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan_loom.train", *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("launch error: the 2 ranks did not all join within 3 s"), last
    assert f"rank 0 waited at 127.0.0.1:{port}" in last and "MASTER_PORT" in last
    assert not (tmp_path / "run" / "RUN.lock").exists()  # released: a relaunch may start at once
