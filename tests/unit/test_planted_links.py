"""No write, rename or delete through a planted symbolic link: a link where a launch writes is
one error line, exit 2, and nothing outside the run folder changes; links planted mid-run are
refused at the write; pruning reports only what it removed."""

import os

import pytest

from tests.unit.test_run_folder import argv
from torchtitan_loom import train
from torchtitan_loom.components.checkpoint import tree


@pytest.fixture(scope="module")
def finished_run(tiny_pack, tmp_path_factory):
    """A run folder after 4 steps with step-2 and step-4 (a relaunch with more steps resumes it)."""
    dump = tmp_path_factory.mktemp("links_run")
    assert train.main(argv(tiny_pack, dump)) == 0
    return dump


def copy_run(src, dst):
    import shutil

    shutil.copytree(src, dst, symlinks=True)
    return dst


@pytest.mark.parametrize(
    "name",
    [
        "run.json.partial",
        "checkpoint/index.json.partial",
        "checkpoint/.tmp-step-6",
        "checkpoint/step-6",
        "metrics.jsonl",
    ],
)
def test_a_planted_link_is_one_error_line_and_nothing_outside_changes(
    tiny_pack, finished_run, tmp_path, capsys, name
):
    dump = copy_run(finished_run, tmp_path / "run")
    victim_file = tmp_path / "victim.txt"
    victim_file.write_text("precious\n")
    victim_dir = tmp_path / "victim_dir"
    victim_dir.mkdir()
    (victim_dir / "keep.txt").write_text("precious\n")
    target = victim_dir if "step-" in name else victim_file
    if (dump / name).exists():
        os.remove(dump / name)  # the run's own file replaced by a link
    os.symlink(target, dump / name)
    before = {p: p.read_bytes() for p in (victim_file, victim_dir / "keep.txt")}
    capsys.readouterr()
    assert train.main(argv(tiny_pack, dump, steps=6)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "symbolic link" in err and str(dump / name) in err, err
    assert {p: p.read_bytes() for p in before} == before and sorted(os.listdir(victim_dir)) == [
        "keep.txt"
    ]
    assert os.path.islink(dump / name)


def test_atomic_write_refuses_a_link_planted_at_its_temporary(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    os.symlink(victim, tmp_path / "index.json.partial")
    with pytest.raises(OSError, match="symbolic link"):  # safe_files.UnsafePathError
        tree.write_json(str(tmp_path / "index.json"), {"a": 1})
    assert victim.read_text() == "precious\n" and not (tmp_path / "index.json").exists()
    os.remove(tmp_path / "index.json.partial")
    (tmp_path / "index.json.partial").write_text(
        "left by a write that died"
    )  # a stale regular file: replaced
    tree.write_json(str(tmp_path / "index.json"), {"a": 1})
    assert tree.read_json(str(tmp_path / "index.json")) == {"a": 1}


def test_a_save_into_a_planted_temporary_link_is_refused_mid_run(tiny_pack, tmp_path):
    from tests.unit.test_checkpoint import make_trainer, run
    from torchtitan_loom.components.checkpoint import CheckpointError

    t = run(
        make_trainer(
            tiny_pack, tmp_path / "run", "--training.steps", "2", "--checkpoint.interval", "2"
        )
    )
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("precious\n")
    os.symlink(
        outside, tree.SaveTarget.of(t.checkpointer.root, 2, "periodic").tmp
    )  # planted after the launch check
    with pytest.raises(
        CheckpointError, match=r"step 2 not saved: .*\.tmp-step-2 is a symbolic link"
    ):
        t.checkpointer.save(2)
    assert sorted(os.listdir(outside)) == ["keep.txt"]


def test_prune_reports_only_what_it_removed(tmp_path):
    from tests.unit.test_checkpoint_tree import fake_ckpt

    root = tmp_path / "checkpoint"
    outside = tmp_path / "outside"
    fake_ckpt(str(outside), 4)  # a complete checkpoint elsewhere, linked in as step-4
    root.mkdir()
    os.symlink(outside / "step-4", root / "step-4")
    for step in (6, 8):
        fake_ckpt(str(root), step)
    deleted = tree.prune(str(root), keep_latest_k=1, snapshot_keep=0)
    assert deleted == [str(root / "step-6")]  # the link is neither removed nor reported
    assert os.path.islink(root / "step-4") and os.path.isfile(outside / "step-4" / tree.MARKER)
    assert tree.scan(str(root)).links == [str(root / "step-4")]
