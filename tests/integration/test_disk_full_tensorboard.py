"""A disk that fills while the run writes TensorBoard (issue 34): the campaign saw TensorBoard's
writer thread die with a thread traceback and a last line naming no file. Now TensorBoard stops
with one warning naming its folder, and the run ends with one line naming the file it could not
write. The run's folder is a 2 MiB tmpfs mounted in a private mount namespace (root and unshare;
skipped elsewhere), filled by this test once the run has logged a few steps."""

import os
import shutil
import subprocess
import sys
import time

import pytest

from tests.unit.test_run_folder import argv

LIMIT_S = 240


def _can_mount_tmpfs(tmp_path) -> bool:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    probe = tmp_path / "probe"
    probe.mkdir()
    cmd = f"mount -t tmpfs -o size=64k tmpfs {probe} && touch {probe}/x"
    ok = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", cmd])
    return ok.returncode == 0 and not (probe / "x").exists()


def test_a_disk_filling_under_tensorboard_gives_one_warning_and_one_line(tiny_pack, tmp_path):
    if not _can_mount_tmpfs(tmp_path):
        pytest.skip("needs root and unshare to mount a private tmpfs")
    disk, log = tmp_path / "disk", tmp_path / "train.log"
    disk.mkdir()
    dump = disk / "run"
    args = argv(tiny_pack, dump, steps=400)
    args = [
        a if a != "false" or args[i - 1] != "--metrics.enable_tensorboard" else "true"
        for i, a in enumerate(args)
    ]
    args += ["--checkpoint.enable", "false"]
    train = " ".join(f"'{a}'" for a in [sys.executable, "-m", "torchtitan_loom.train", *args])
    # In the private namespace: mount, train in the background, fill the disk after 3 logged
    # steps, wait for the run.
    script = (
        f"mount -t tmpfs -o size=2m tmpfs '{disk}' || exit 99\n"
        f"{train} > '{log}' 2>&1 & pid=$!\n"
        f"for i in $(seq 600); do\n"
        f"  [ -f '{dump}/metrics.jsonl' ] && [ $(wc -l < '{dump}/metrics.jsonl') -ge 3 ] && break\n"
        f"  sleep 0.2\n"
        f"done\n"
        f"dd if=/dev/zero of='{disk}/filler' bs=4k 2>/dev/null\n"
        f"wait $pid; echo \"rc=$?\" >> '{log}'\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    started = time.monotonic()
    proc = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
        env=env,
        timeout=LIMIT_S,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    out = log.read_text()
    assert time.monotonic() - started < LIMIT_S
    assert "Traceback" not in out and "Exception in thread" not in out, out
    warning = [ln for ln in out.splitlines() if "TensorBoard stopped for this launch" in ln]
    assert len(warning) == 1 and str(dump / "tb") in warning[0], out
    last = [ln for ln in out.splitlines() if ln.startswith("disk full")]
    assert last and "metrics.jsonl" in last[0], out
    assert out.strip().endswith("rc=1"), out  # a full disk is a failure (exit 1), not bad input
