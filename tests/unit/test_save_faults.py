"""Faults in the middle of a checkpoint write, each at a chosen phase: DCP is about to create the
save's first data file in ``.tmp-step-N/`` (a test writer, ``At``, acts there, then writes as the
run's own writer does). A symbolic link planted at that name (sync and async saves) is one
``checkpoint error: ... not saved`` line, exit 2; a second Ctrl-C there stops as the first one
promised (exit 130, ``stopped``, nothing saved; sync and async). Never a traceback; the older checkpoint stays
and the checksummed folder outside the run is untouched."""

import json
import os
import signal

import pytest

from tests.unit.test_run_folder import argv
from torchtitan_loom import launch
from torchtitan_loom.components.checkpoint import saving, tree
from torchtitan_loom.components.checkpoint.safe_write import SafeWriter, _NewFilesOnly
from torchtitan_loom.components.runtime import exit_codes
from torchtitan_loom.trainer import Trainer


def writer_acting_at(step, act):
    """A SafeWriter class whose file system calls ``act(path)`` before it creates the first file
    of step ``step``'s save (from the thread that writes: the main one, or async's own)."""

    class ActingFiles(_NewFilesOnly):
        def create_stream(self, path, mode):
            if f".tmp-step-{step}" in str(path) and "w" in mode and not done:
                done.append(path)
                act(str(path))
            return super().create_stream(path, mode)

    class At(SafeWriter):
        def __init__(self, path, **kwargs):
            super().__init__(path, **kwargs)
            self.fs = ActingFiles()

    done: list[str] = []
    return At


def stderr_lines(capfd):
    return [ln for ln in capfd.readouterr().err.splitlines() if ln.strip()]


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_a_link_planted_in_the_temporary_folder_during_a_save_is_one_line_exit_2(
    tiny_pack, tmp_path, capfd, monkeypatch, outside, mode
):
    def plant(path):  # the name DCP is about to create, now a link to someone else's file
        os.symlink(outside.folder / "keep.txt", path)

    monkeypatch.setattr(saving, "SafeWriter", writer_acting_at(8, plant))
    dump = tmp_path / "run"
    extra = ("--checkpoint.interval", "4", "--checkpoint.async_mode", mode)
    assert launch.run(argv(tiny_pack, dump, *extra, steps=12), Trainer) == exit_codes.BAD_INPUT
    (line,) = stderr_lines(capfd)
    root = dump / "checkpoint"
    assert line.startswith(f"checkpoint error: checkpoint step 8 not saved: {root}/.tmp-step-8/")
    assert "a symbolic link was placed there during the save; refusing to write through it" in line
    assert line.endswith(f"nothing pruned, the previous checkpoints in {root} are untouched")
    assert tree.is_complete(str(root / "step-4")) and not (root / "step-8").exists()
    assert json.loads((dump / "run.json").read_text())["status"] == "failed"
    outside.check()


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_a_second_ctrl_c_during_the_checkpoint_write_stops_without_saving(
    tiny_pack, tmp_path, capfd, monkeypatch, outside, mode
):
    class CtrlCAtStep6(Trainer):  # the first Ctrl-C: stop after step 6 and save it
        def train_step(self, batch):
            out = super().train_step(batch)
            if self.state.step == 6:
                signal.raise_signal(signal.SIGINT)
            return out

    # The second Ctrl-C: while DCP writes step 6's first data file.
    monkeypatch.setattr(
        saving, "SafeWriter", writer_acting_at(6, lambda _: os.kill(os.getpid(), 2))
    )
    dump = tmp_path / "run"
    extra = ("--checkpoint.interval", "4", "--checkpoint.async_mode", mode)
    code = launch.run(argv(tiny_pack, dump, *extra, steps=12), CtrlCAtStep6)
    assert code == exit_codes.INTERRUPTED
    lines = stderr_lines(capfd)
    assert lines[-1] == "interrupted (SIGINT): stopped without saving", lines
    assert not any("Traceback" in ln or "Exception" in ln for ln in lines), lines
    root = dump / "checkpoint"
    assert tree.is_complete(str(root / "step-4")) and not (root / "step-6").exists()
    if mode == "disabled":  # async's writer thread may still hold it: a .tmp- name never loads
        assert not [
            n for n in os.listdir(root) if n.startswith(".tmp-")
        ]  # the partial save removed
    run_json = json.loads((dump / "run.json").read_text())
    assert run_json["status"] == "stopped" and run_json["step"] == 6
    outside.check()
