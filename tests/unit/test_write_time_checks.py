"""Every path a run writes, renames or removes is checked when it is written, not only before the
launch: a link planted mid-run (``checkpoint/snapshots``, ``index.json.partial``,
``SPIKE_ABORT.txt``, ``tb/``, ``metrics.jsonl``, the dump's ``config.toml``) is never written,
pruned or removed through, and a save that cannot complete says exactly what is on disk.

Each case runs the real launch (``launch.run``) with a trainer that plants the link at a given
step, as someone sharing the run folder would."""

import os

import pytest

from tests.unit.test_checkpoint_tree import fake_ckpt
from tests.unit.test_run_folder import argv
from torchtitan_loom import launch
from torchtitan_loom.components.checkpoint import tree
from torchtitan_loom.components.runtime import safe_files
from torchtitan_loom.trainer import Trainer


def planting(at_step, plant):
    """A Trainer class that calls ``plant(trainer)`` right after global step ``at_step``."""

    class Planting(Trainer):
        def train_step(self, batch):
            out = super().train_step(batch)
            if self.state.step == at_step:
                plant(self)
            return out

    return Planting


def launch_with(cls, pack, dump, *extra, steps):
    return launch.run(argv(pack, dump, *extra, steps=steps), cls)


def one_line(capsys, prefix):
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line]
    assert len(err) == 1 and err[0].startswith(prefix), err
    return err[0]


def victim(tmp_path):
    """A folder of someone else's data, holding a complete-looking checkpoint that pruning would
    delete if it ever saw it."""
    out = tmp_path / "someone_else"
    fake_ckpt(str(out), 1)
    (out / "keep.txt").write_text("precious\n")
    return out


def listing(folder):
    return sorted(
        (os.path.relpath(os.path.join(d, f), folder), open(os.path.join(d, f), "rb").read())
        for d, _, files in os.walk(folder)
        for f in files
    )


def test_a_snapshots_folder_linked_mid_run_is_neither_written_nor_pruned(
    tiny_pack, tmp_path, capsys
):
    dump, outside = tmp_path / "run", victim(tmp_path)
    before = listing(outside)

    def plant(t):  # after step 5: the run's snapshots/ (holding step-4) moved away, a link in place
        snaps = os.path.join(t.checkpointer.root, tree.SNAPSHOT_DIR)
        os.rename(snaps, tmp_path / "moved_snapshots")
        os.symlink(outside, snaps)

    policy = ("--checkpoint.interval", "4", "--checkpoint.snapshot_interval", "4")
    keep = ("--checkpoint.keep_latest_k", "1", "--checkpoint.snapshot_keep", "1")
    code = launch_with(planting(5, plant), tiny_pack, dump, *policy, *keep, steps=12)
    assert code == 2
    err = one_line(capsys, "checkpoint error: ")
    root = dump / "checkpoint"
    assert f"checkpoint step 8 saved to {root / 'step-8'} (complete" in err, err
    assert "its snapshot was not saved" in err and "symbolic link" in err, err
    assert "nothing pruned" in err and "index.json and LAYOUT.md rewritten" in err, err
    assert listing(outside) == before  # nothing written into it, nothing deleted from it
    assert tree.is_complete(str(root / "step-4")) and tree.is_complete(str(root / "step-8"))
    index = tree.read_json(str(root / tree.INDEX))
    assert index["latest"] == "step-8" and index["snapshots"] == []  # what is there, truly
    assert os.path.islink(root / tree.SNAPSHOT_DIR)


def test_a_snapshot_only_save_into_a_linked_snapshots_folder_is_refused(
    tiny_pack, tmp_path, capsys
):
    dump, outside = tmp_path / "run", victim(tmp_path)
    before = listing(outside)

    def plant(t):  # before any save: the checkpoint folder does not exist yet
        os.makedirs(t.checkpointer.root)
        os.symlink(outside, os.path.join(t.checkpointer.root, tree.SNAPSHOT_DIR))

    policy = ("--checkpoint.interval", "4", "--checkpoint.snapshot_interval", "3")
    assert launch_with(planting(2, plant), tiny_pack, dump, *policy, steps=8) == 2
    err = one_line(capsys, "checkpoint error: ")
    assert "checkpoint step 3 not saved" in err and "snapshots is a symbolic link" in err, err
    assert listing(outside) == before


def test_an_index_link_planted_mid_run_ends_consistent_and_says_what_is_on_disk(
    tiny_pack, tmp_path, capsys
):
    dump = tmp_path / "run"
    precious = tmp_path / "victim.txt"
    precious.write_text("precious\n")

    def plant(t):
        os.symlink(precious, os.path.join(t.checkpointer.root, tree.INDEX + ".partial"))

    policy = ("--checkpoint.interval", "4", "--checkpoint.keep_latest_k", "1")
    # After step 11: step-8, proven by steps 9 and 10, has pruned step-4; step 12's commit is next.
    assert launch_with(planting(11, plant), tiny_pack, dump, *policy, steps=12) == 2
    err = one_line(capsys, "checkpoint error: ")
    root = dump / "checkpoint"
    assert f"checkpoint step 12 saved to {root / 'step-12'} (complete" in err, err
    assert "index.json and LAYOUT.md not rewritten" in err and "do not list step 12" in err, err
    assert "nothing pruned" in err and "not saved" not in err, err
    assert precious.read_text() == "precious\n"
    # What the message says is what is on disk: step-8 kept (step-12 was not proven yet),
    # step-12 complete, the index still naming step-8 as the newest.
    assert [e.step for e in tree.scan(str(root)).complete] == [8, 12]
    assert tree.read_json(str(root / tree.INDEX))["latest"] == "step-8"
    os.remove(root / (tree.INDEX + ".partial"))  # the link removed: the relaunch resumes at 12
    capsys.readouterr()
    assert launch_with(Trainer, tiny_pack, dump, *policy, steps=13) == 0
    assert "resumed from" in capsys.readouterr().out
    # Pruning waits for 2 healthy steps after a checkpoint: step-13 (the run's end) proves nothing.
    assert [e.step for e in tree.scan(str(root)).complete] == [8, 12, 13]
    assert tree.read_json(str(root / tree.INDEX))["latest"] == "step-13"


def test_an_abort_file_linked_mid_run_is_not_written_through(tiny_pack, tmp_path, capsys):
    dump = tmp_path / "run"
    precious = tmp_path / "victim.txt"
    precious.write_text("precious\n")

    class Spiking(planting(1, lambda t: os.symlink(precious, dump / "SPIKE_ABORT.txt"))):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.spike_guard.check = lambda seg, loss, step: "forced" if step >= 2 else None

    extra = ("--spike_guard.abort_on_spike", "true")
    assert launch_with(Spiking, tiny_pack, dump, *extra, steps=4) == 2  # the stop goes on
    err = one_line(capsys, "warning: SPIKE_ABORT.txt not written: ")
    assert "symbolic link" in err
    assert precious.read_text() == "precious\n" and os.path.islink(dump / "SPIKE_ABORT.txt")
    assert tree.read_json(str(dump / "run.json"))["status"] == "diverged"


TB = ("--metrics.enable_tensorboard", "true")


def test_tensorboard_stops_at_a_link_planted_mid_run(tiny_pack, tmp_path, capsys):
    dump, outside, seen = tmp_path / "run", tmp_path / "outside", {}

    def plant(t):  # the launch folder moved away and replaced by a link to it, elsewhere
        tb_dir = t.parts.training.metrics.tb_dir
        os.rename(tb_dir, outside)
        os.symlink(outside, tb_dir)
        seen["at plant"] = listing(outside)

    assert launch_with(planting(2, plant), tiny_pack, dump, *TB, steps=4) == 0  # training goes on
    err = one_line(capsys, "warning: TensorBoard stopped for this launch: ")
    assert "symbolic link" in err
    events = [n for n, data in seen["at plant"] if n.startswith("events.") and data]
    assert events  # step 1 was written before the link appeared
    assert listing(outside) == seen["at plant"]  # nothing written through the link after it
    assert len((dump / "metrics.jsonl").read_text().splitlines()) == 4  # every step logged


def test_a_tb_folder_linked_before_the_launch_is_refused(tiny_pack, tmp_path, capsys):
    dump, outside = tmp_path / "run", tmp_path / "outside"
    dump.mkdir()
    outside.mkdir()
    os.symlink(outside, dump / "tb")
    assert launch_with(Trainer, tiny_pack, dump, *TB, steps=2) == 2
    err = one_line(capsys, "config error: ")
    assert str(dump / "tb") in err and "symbolic link" in err
    assert os.listdir(outside) == []


@pytest.mark.parametrize("name", ["metrics.jsonl", "config.toml"])
def test_a_run_file_linked_after_the_launch_check_is_one_line_and_untouched(
    tiny_pack, tmp_path, capsys, name
):
    """Planted between the launch's link check and the write (the trainer's construction)."""
    dump = tmp_path / "run"
    precious = tmp_path / "victim.txt"
    precious.write_text("precious\n")

    class Late(Trainer):
        def __init__(self, *a, **k):
            os.symlink(precious, dump / name)
            super().__init__(*a, **k)

    assert launch_with(Late, tiny_pack, dump, steps=2) == 2
    err = one_line(capsys, "run folder error: ")
    assert str(dump / name) in err and "symbolic link" in err, err
    assert precious.read_text() == "precious\n"


def test_make_dirs_and_real_dir_refuse_a_link_on_the_way(tmp_path):
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", tmp_path / "snapshots")
    with pytest.raises(safe_files.UnsafePathError, match="snapshots is a symbolic link"):
        safe_files.make_dirs(str(tmp_path / "snapshots" / ".tmp-step-4"), str(tmp_path))
    (tmp_path / "outside" / "step-8").mkdir()
    with pytest.raises(safe_files.UnsafePathError, match="snapshots is a symbolic link"):
        safe_files.remove_dir(str(tmp_path / "snapshots" / "step-8"), str(tmp_path))
    assert os.listdir(tmp_path / "outside") == ["step-8"]
    with pytest.raises(safe_files.UnsafePathError, match="outside"):
        safe_files.check_inside(str(tmp_path.parent / "x"), str(tmp_path))


def test_overwrite_never_moves_the_old_run_through_a_planted_link(tiny_pack, tmp_path, capsys):
    dump, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    assert launch_with(Trainer, tiny_pack, dump, steps=2) == 0
    run_id = tree.read_json(str(dump / "run.json"))["run_id"]
    os.symlink(outside, dump / f"replaced-{run_id}")  # where job.overwrite moves the old run
    capsys.readouterr()
    assert launch_with(Trainer, tiny_pack, dump, "--job.overwrite", "true", steps=2) == 2
    err = one_line(capsys, "run folder error: ")
    assert f"replaced-{run_id} is a symbolic link" in err, err
    assert os.listdir(outside) == [] and (dump / "run.json").is_file()
