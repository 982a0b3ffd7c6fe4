"""The run folder is held from the launch (issue 34): a dump folder swapped for a link to another
folder mid-run stops the run at its next checkpoint write with one line; nothing is written,
renamed or removed in the other folder (the campaign saw pruning delete an outside step-2 and
step-12, step-16, index.json and run.json written there, exit 0)."""

import os

import pytest

from tests.unit.test_run_folder import argv
from torchtitan_loom import launch
from torchtitan_loom.components.checkpoint import tree
from torchtitan_loom.components.runtime import exit_codes, safe_files
from torchtitan_loom.trainer import Trainer


def _tree(folder):
    """Every path under ``folder`` with its bytes (files) or None (folders)."""
    out = {}
    for here, dirs, files in os.walk(folder):
        for d in dirs:
            out[os.path.relpath(os.path.join(here, d), folder)] = None
        for f in files:
            with open(os.path.join(here, f), "rb") as fh:
                out[os.path.relpath(os.path.join(here, f), folder)] = fh.read()
    return out


def test_a_run_folder_swapped_for_a_link_mid_run_stops_the_run_and_touches_nothing_outside(
    tiny_pack, tmp_path, capsys
):
    dump, moved, outside = tmp_path / "run", tmp_path / "run.moved", tmp_path / "outside"
    # What the link will lead to: an older copy of a run folder, with a checkpoint to lose.
    (outside / "checkpoint" / "step-2").mkdir(parents=True)
    (outside / "checkpoint" / "step-2" / "data").write_bytes(b"someone else's checkpoint")
    (outside / "run.json").write_text('{"status": "finished"}\n')
    before = _tree(outside)

    class SwapAfterStep3(Trainer):
        def _after_step(self, step, out, report):
            if step == 3:  # after step 2's checkpoint: the folder moves, a link takes its name
                os.rename(dump, moved)
                os.symlink(outside, dump)
            return super()._after_step(step, out, report)

    keep = ("--checkpoint.keep_latest_k", "1")
    code = launch.run(argv(tiny_pack, dump, *keep, steps=8), SwapAfterStep3)
    err = capsys.readouterr().err
    assert code == exit_codes.BAD_INPUT, err
    assert "is no longer the folder this run started in" in err
    assert f"now a link to {str(outside)!r}" in err
    assert _tree(outside) == before  # nothing written, renamed or removed there
    # The run's own folder (moved) keeps its step-2 checkpoint.
    assert [e.step for e in tree.scan(str(moved / "checkpoint")).complete] == [2]


def test_held_folder_checks(tmp_path):
    run, other = tmp_path / "run", tmp_path / "other"
    run.mkdir()
    other.mkdir()
    held = safe_files.HeldFolder(str(run))
    held.check()  # unchanged
    safe_files.make_dirs(str(run / "a" / "b"), held)
    os.rename(run, tmp_path / "gone")
    with pytest.raises(safe_files.UnsafePathError, match="no longer the folder"):
        held.check()
    os.symlink(other, run)
    with pytest.raises(safe_files.UnsafePathError, match="now a link to"):
        safe_files.make_dirs(str(run / "c"), held)
    assert not (other / "c").exists()
    # A folder that did not exist when held is held from the first check that finds it.
    later = safe_files.HeldFolder(
        str(tmp_path / "later"), within=safe_files.HeldFolder(str(tmp_path))
    )
    (tmp_path / "later").mkdir()
    later.check()
    os.rename(tmp_path / "later", tmp_path / "later2")
    (tmp_path / "later").mkdir()
    with pytest.raises(safe_files.UnsafePathError):
        later.check()


def test_load_step_never_creates_anything_through_a_planted_abandoned_link(
    tiny_pack, tmp_path, capsys
):
    """The campaign: ``--checkpoint.load_step`` created an outside ``snapshots/`` through an
    ``abandoned/`` link before refusing it."""
    dump, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    keep = ("--checkpoint.snapshot_interval", "4")
    assert launch.run(argv(tiny_pack, dump, *keep, steps=6), Trainer) == 0
    os.symlink(outside, dump / "checkpoint" / "abandoned")
    capsys.readouterr()
    code = launch.run(argv(tiny_pack, dump, *keep, "--checkpoint.load_step", "2", steps=6), Trainer)
    err = capsys.readouterr().err
    assert code == exit_codes.BAD_INPUT, err
    assert "abandoned" in err and "symbolic link" in err, err
    assert list(outside.iterdir()) == []
    assert (dump / "checkpoint" / "step-6").is_dir()  # nothing moved


def test_a_run_whose_checkpoints_are_all_damaged_gets_no_new_tensorboard_file(
    tiny_pack, tmp_path, capsys
):
    """Issue 34: the refused relaunch of an all-damaged folder left a new TensorBoard event file:
    TensorBoard's folder is made at its first write, after the resume."""
    dump = tmp_path / "run"
    tb = ("--metrics.enable_tensorboard", "true")
    assert launch.run(argv(tiny_pack, dump, *tb, steps=4), Trainer) == 0
    launches = sorted(p.name for p in (dump / "tb").iterdir())
    assert len(launches) == 1
    for step in tree.scan(str(dump / "checkpoint")).complete:
        with open(os.path.join(step.path, "__0_0.distcp"), "r+b") as fh:
            fh.write(b"damaged")
    capsys.readouterr()
    assert launch.run(argv(tiny_pack, dump, *tb, steps=6), Trainer) == exit_codes.BAD_INPUT
    assert "every complete checkpoint" in capsys.readouterr().err
    assert sorted(p.name for p in (dump / "tb").iterdir()) == launches


def test_a_peer_lost_while_a_step_is_saved_is_said_to_be_after_that_step(tmp_path):
    """Issue 34: "lost a peer during step 7" when the peer died while step 6 was saved."""
    from torchtitan_loom.config import load_config

    cfg = load_config(["--job.dump_folder", str(tmp_path), "--checkpoint.enable"])
    during = launch._lost_peer(cfg, 6, "RuntimeError: gone", in_step=True)
    after = launch._lost_peer(cfg, 6, "RuntimeError: gone", in_step=False)
    assert during.message.startswith("lost a peer during step 7 (RuntimeError: gone)")
    assert after.message.startswith("lost a peer after step 6 (its eval or save) (RuntimeError")
