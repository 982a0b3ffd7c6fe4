"""Files the run reads back that are not what they should be (issue 34): a FIFO, or a link to
/dev/zero, planted at run.json, RUN.lock, metrics.jsonl or a checkpoint's CHECKSUMS.json. A
relaunch never blocks on one and never reads one without end: it answers within seconds, with one
line naming the file (exit 2), or skips the checkpoint with a warning and loads the one before.

Each relaunch runs in this process under an alarm: a blocking open() is interrupted by it, so a
hang fails the test instead of stopping the suite."""

import os
import shutil
import signal

import pytest

from tests.unit.test_run_folder import argv
from torchtitan_loom import train

LIMIT_S = 60  # a relaunch here takes ~5 s; a hang never ends


@pytest.fixture(scope="module")
def finished(tiny_pack, tmp_path_factory):
    """A run folder after 4 steps, checkpoints at steps 2 and 4."""
    dump = tmp_path_factory.mktemp("planted")
    assert train.main(argv(tiny_pack, dump)) == 0
    return dump


def _relaunch(pack, dump, capsys):
    def hung(signum, frame):
        raise TimeoutError(f"the relaunch did not answer within {LIMIT_S} s")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(LIMIT_S)
    try:
        capsys.readouterr()
        code = train.main(argv(pack, dump, steps=6))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    out = capsys.readouterr()
    return code, out.out, out.err


def _plant(path, how):
    if os.path.lexists(path):
        os.remove(path)
    if how == "fifo":
        os.mkfifo(path)
    else:
        os.symlink("/dev/zero", path)


@pytest.mark.parametrize(
    "name, how",
    [
        ("run.json", "fifo"),
        ("run.json", "zero"),
        ("RUN.lock", "fifo"),
        ("RUN.lock", "zero"),
        ("metrics.jsonl", "fifo"),
    ],
)
def test_a_planted_run_file_is_one_line_and_exit_2(
    finished, tiny_pack, tmp_path, capsys, name, how
):
    dump = tmp_path / "run"
    shutil.copytree(finished, dump, symlinks=True)
    _plant(dump / name, how)
    code, out, err = _relaunch(tiny_pack, dump, capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and name in err, (code, out[-1500:], err[-1500:])
    assert len(lines) == 1 and "Traceback" not in err, err
    assert ("FIFO" in err or "regular file" in err) if how == "fifo" else "link" in err, err


@pytest.mark.parametrize("how", ["fifo", "zero"])
def test_a_planted_checksum_list_skips_that_checkpoint_without_blocking(
    finished, tiny_pack, tmp_path, capsys, how
):
    dump = tmp_path / "run"
    shutil.copytree(finished, dump, symlinks=True)
    _plant(dump / "checkpoint" / "step-4" / "CHECKSUMS.json", how)
    code, out, err = _relaunch(tiny_pack, dump, capsys)
    assert code == 0, (out[-1500:], err[-1500:])
    said = out + err
    assert "step-4" in said and "CHECKSUMS.json" in said, said[-2000:]
    assert "resum" in said and "step 2" in said, said[-2000:]  # the one before loads


def test_a_link_planted_in_the_save_folder_is_never_written_through(tmp_path):
    """What a link planted in .tmp-step-N while DCP writes would get: SafeWriter creates every file
    new (O_EXCL | O_NOFOLLOW), so the save fails naming the link and the outside file keeps its
    bytes; a folder with a link is never committed (test_checkpoint_integrity.py)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from torchtitan_loom.components.checkpoint.safe_write import SafeWriter

    tmp, outside = tmp_path / ".tmp-step-8", tmp_path / "outside.txt"
    tmp.mkdir()
    outside.write_text("precious")
    (tmp / "__0_0.distcp").symlink_to(outside)
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    with pytest.raises((OSError, CheckpointException)) as exc:
        dcp.save({"w": torch.ones(1000)}, storage_writer=SafeWriter(tmp), no_dist=True)
    assert "refusing to write through it" in str(exc.value), exc.value
    assert outside.read_text() == "precious"
    # Without the link the same save works, and a load reads it back.
    (tmp / "__0_0.distcp").unlink()
    for leftover in tmp.iterdir():
        leftover.unlink()
    dcp.save({"w": torch.ones(1000)}, storage_writer=SafeWriter(tmp), no_dist=True)
    back = {"w": torch.zeros(1000)}
    dcp.load(back, checkpoint_id=str(tmp), no_dist=True)
    assert torch.equal(back["w"], torch.ones(1000))
