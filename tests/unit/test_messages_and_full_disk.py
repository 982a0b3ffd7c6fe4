"""Messages stay one readable line: a long echoed value is shortened (one helper), a dump folder on
a full disk is one line and exit 2 before anything is written, and the packer refuses an ``--out``
that ``--force`` could not replace before it tokenizes anything.

The disk cases mount a small tmpfs (needs root, as in this project's CI container; skipped
elsewhere)."""

import contextlib
import errno
import os
import subprocess
import sys

import pytest

from tests.unit.test_run_folder import argv
from torchtitan_loom import train
from torchtitan_loom.components.runtime.messages import shorten, shorten_line
from torchtitan_loom.components.runtime.run_folder import RunFolderError, RunLock
from torchtitan_loom.tools import pack as pack_cli


@contextlib.contextmanager
def tmpfs(path, size="1m"):
    path.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def fill(folder):
    """Write zeros into ``folder`` until its disk is full."""
    with open(folder / "filler", "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


def test_shorten_keeps_head_tail_and_length():
    assert shorten("short") == "short"
    long = "/data/" + "x" * 5_000_000 + "/end.bin"
    out = shorten(long)
    assert len(out) <= 220 and out.startswith("/data/xx") and out.endswith("/end.bin")
    assert f"({len(long)} chars)" in out
    line = shorten_line(f"data.path: no such directory '{long}' (see the packer)")
    assert len(line) < 300 and line.endswith("(see the packer)") and "/end.bin'" in line


def test_a_huge_data_path_is_echoed_shortened(tiny_pack, tmp_path, capsys):
    huge = "/nowhere/" + "p" * 5_000_000
    # On the command line (in process): a config file is capped at 1 MiB (config/toml_file.py).
    args = ["--data.path", huge, "--job.dump_folder", str(tmp_path / "r")]
    assert train.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("config error: data.path"), err[0][:300]
    assert len(err[0]) < 600 and f"({len(huge)} chars)" in err[0]


def test_a_dump_folder_on_a_full_disk_is_one_line_exit_2(tiny_pack, tmp_path, capsys):
    with tmpfs(tmp_path / "disk") as disk:
        fill(disk)
        assert train.main(argv(tiny_pack, disk / "run")) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("config error: job.dump_folder"), err
        assert "the disk is full" in err[0]
        assert sorted(os.listdir(disk)) == ["filler"]  # no run folder, no lock left behind


def test_a_run_lock_that_cannot_be_written_leaves_no_lock(tmp_path):
    with tmpfs(tmp_path / "disk") as disk:
        (disk / "run").mkdir()
        fill(disk)
        with pytest.raises(RunFolderError, match="could not write the run lock"):
            RunLock(str(disk / "run"), "id")
        assert os.listdir(disk / "run") == []  # an empty lock would refuse every later launch


def test_pack_refuses_a_mount_point_out_before_tokenizing(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("\n\n".join(f"document {i}: lorem ipsum" for i in range(300)))
    with tmpfs(tmp_path / "mnt") as mnt:
        (mnt / "old.txt").write_text("old pack\n")
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        code = pack_cli.main(
            ["--text", str(tmp_path / "a.txt"), "--tokenizer", "byte", "--out", str(mnt), "--force"]
        )
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1, err  # no progress line: nothing was tokenized
        assert err[0].startswith(f"error: --out {str(mnt)!r} --force: it is a mount point"), err
        assert "Errno" not in err[0] and (mnt / "old.txt").read_text() == "old pack\n"
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".") or "tmp" in n]


def test_pack_on_a_nearly_full_disk_is_one_line_and_leaves_nothing(tmp_path, outside):
    # ~600k byte tokens: the raw stream (1.2 MB) fits the 2 MiB disk, tokens.npy beside it does
    # not. Written through a memory map, the copy died of SIGBUS (exit 135) and left .pack.tmp-*.
    text = "\n\n".join(f"document {i}: " + "lorem ipsum dolor sit amet " * 20 for i in range(1100))
    source = outside.put("a.txt", text)  # the user's corpus, outside the disk: only read
    with tmpfs(tmp_path / "disk", size="2m") as disk:
        (disk / "mine.txt").write_text("the user's\n")
        proc = subprocess.run(
            [sys.executable, "-m", "torchtitan_loom.tools.pack", "--text", str(source)]
            + ["--tokenizer", "byte", "--out", str(disk / "pack")],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
        err = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
        assert len(err) == 1, proc.stderr[-2000:]
        assert err[0].startswith(f"error: {disk / 'pack'}: no space left on its disk writing "), err
        assert err[0].endswith("the partial pack removed: free space or choose another --out")
        assert "Traceback" not in proc.stderr and "Errno" not in proc.stderr
        assert sorted(os.listdir(disk)) == ["mine.txt"]  # no .pack.tmp-*, no pack
    outside.check()
