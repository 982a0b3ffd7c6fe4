"""The checkpoint folder (components/checkpoint/tree.py): completeness, atomic commit, pruning,
index — on hand-made directories, no tensors."""

import json
import os
import pickle
import shutil

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
)

from torchtitan_loom.components.checkpoint import tree


def fake_ckpt(root, step, kind="periodic", complete=True, tmp=False):
    """A directory that looks like a DCP checkpoint (``.metadata`` + a data file)."""
    target = tree.SaveTarget.of(str(root), step, kind)
    path = target.tmp if tmp else target.final
    os.makedirs(path)
    content = f"{kind} {step}"
    with open(os.path.join(path, "__0_0.distcp"), "w") as fh:
        fh.write(content)
    # Real DCP metadata naming the data file (a commit checks every file its metadata names).
    md = Metadata(
        state_dict_metadata={"tag": BytesStorageMetadata()},
        storage_data={MetadataIndex("tag"): _StorageInfo("__0_0.distcp", 0, len(content))},
    )
    with open(os.path.join(path, tree.DCP_METADATA), "wb") as fh:
        pickle.dump(md, fh)
    if complete and not tmp:
        tree.write_json(os.path.join(path, tree.MARKER), {"step": step})
    return path


def test_scan_separates_complete_from_torn(tmp_path):
    fake_ckpt(tmp_path, 2)
    fake_ckpt(tmp_path, 10)
    torn = fake_ckpt(tmp_path, 12, complete=False)  # a step dir without the marker
    tmp = fake_ckpt(tmp_path, 14, tmp=True)  # a save that died before its commit
    fake_ckpt(tmp_path, 8, kind="snapshot")
    (tmp_path / "step-x").mkdir()  # unrelated names are ignored
    found = tree.scan(str(tmp_path))
    assert [(e.step, e.kind) for e in found.complete] == [
        (2, "periodic"),
        (8, "snapshot"),
        (10, "periodic"),
    ]
    assert {e.path for e in found.incomplete} == {torn, tmp}
    assert found.newest().step == 10
    assert found.find(8).kind == "snapshot" and found.find(12) is None
    warning = tree.incomplete_warning(found.incomplete)
    assert torn in warning and tmp in warning and "COMPLETE" in warning


def test_periodic_preferred_over_snapshot_of_the_same_step(tmp_path):
    fake_ckpt(tmp_path, 6, kind="snapshot")
    fake_ckpt(tmp_path, 6)
    found = tree.scan(str(tmp_path))
    assert found.newest().kind == "periodic" and found.find(6).kind == "periodic"


def test_commit_marks_and_renames_replacing_an_older_save_of_the_step(tmp_path):
    root = str(tmp_path)
    old = fake_ckpt(tmp_path, 4)
    tmp = fake_ckpt(tmp_path, 4, tmp=True)
    with open(os.path.join(tmp, "new.txt"), "w") as fh:
        fh.write("new")
    assert not tree.is_complete(tmp)
    tree.commit(tmp, tree.SaveTarget.of(root, 4, "periodic").final, {"step": 4})
    assert not os.path.exists(tmp)
    assert tree.is_complete(old) and os.path.exists(os.path.join(old, "new.txt"))
    assert sorted(os.listdir(root)) == ["step-4"]  # the replaced copy was removed


def test_clone_links_files_and_survives_pruning_of_its_source(tmp_path):
    root = str(tmp_path)
    src = fake_ckpt(tmp_path, 6)
    os.makedirs(os.path.join(root, tree.SNAPSHOT_DIR))
    snap = tree.SaveTarget.of(root, 6, "snapshot").final
    tree.clone(
        src, tree.SaveTarget.of(root, 6, "snapshot").tmp, snap, {"step": 6, "kind": "snapshot"}
    )
    assert tree.is_complete(snap)
    assert json.load(open(os.path.join(snap, tree.MARKER)))["kind"] == "snapshot"
    tree.prune(root, keep_latest_k=1, snapshot_keep=1, keep_paths=set())
    shutil.rmtree(src)
    assert open(os.path.join(snap, "__0_0.distcp")).read() == "periodic 6"


def test_prune_keeps_latest_k_and_snapshots_and_never_the_newest_complete(tmp_path):
    root = str(tmp_path)
    for s in (1, 2, 3, 4):
        fake_ckpt(tmp_path, s)
    for s in (2, 4):
        fake_ckpt(tmp_path, s, kind="snapshot")
    torn_new = fake_ckpt(tmp_path, 5, complete=False)  # newer but torn: does not count
    stale_tmp = fake_ckpt(tmp_path, 3, tmp=True)  # older than the newest complete: garbage
    live_tmp = fake_ckpt(tmp_path, 6, tmp=True)  # maybe an async save in flight: kept
    deleted = tree.prune(root, keep_latest_k=2, snapshot_keep=1)
    found = tree.scan(root)
    assert [e.step for e in found.of_kind("periodic")] == [3, 4]
    assert [e.step for e in found.of_kind("snapshot")] == [4]
    assert stale_tmp in deleted and os.path.exists(live_tmp) and os.path.exists(torn_new)
    # keep 0 = keep all
    assert tree.prune(root, keep_latest_k=0, snapshot_keep=0) == []
    # Each kind is pruned on its own count: a newer snapshot does not push out the periodic one.
    fake_ckpt(tmp_path, 9, kind="snapshot")
    tree.prune(root, keep_latest_k=1, snapshot_keep=1)
    assert [(e.step, e.kind) for e in tree.scan(root).complete] == [
        (4, "periodic"),
        (9, "snapshot"),
    ]


def test_prune_protects_the_newest_complete_checkpoint_via_keep_paths(tmp_path):
    root = str(tmp_path)
    a, b = fake_ckpt(tmp_path, 1), fake_ckpt(tmp_path, 2)
    tree.prune(root, keep_latest_k=1, snapshot_keep=1, keep_paths={a})
    assert os.path.exists(a) and os.path.exists(b)


def test_index_and_layout_md_describe_what_is_on_disk(tmp_path):
    root = str(tmp_path)
    fake_ckpt(tmp_path, 5)
    fake_ckpt(tmp_path, 10)
    fake_ckpt(tmp_path, 5, kind="snapshot")
    fake_ckpt(tmp_path, 11, tmp=True)
    tree.write_index(
        root,
        {"interval": 5, "keep_latest_k": 2, "snapshot_interval": 5, "snapshot_keep": 0},
        final_step=10,
    )
    index = json.load(open(os.path.join(root, tree.INDEX)))
    assert index["latest"] == "step-10" and index["final"] == "step-10"
    assert [p["step"] for p in index["periodic"]] == [5, 10]
    assert index["snapshots"] == [{"step": 5, "path": "snapshots/step-5"}]
    assert index["incomplete"] == [".tmp-step-11"]
    md = open(os.path.join(root, tree.LAYOUT_MD)).read()
    assert (
        "| 10 | periodic | `step-10` |" in md and "snapshots/step-5" in md and ".tmp-step-11" in md
    )
    assert "immutable snapshots every 5 steps; the newest all kept" in md


def test_layout_md_says_snapshots_are_off_without_a_placeholder(tmp_path):
    fake_ckpt(tmp_path, 5)
    tree.write_index(str(tmp_path), {"interval": 5, "snapshot_interval": 0}, final_step=None)
    md = open(os.path.join(str(tmp_path), tree.LAYOUT_MD)).read()
    assert "none are taken by this run (checkpoint.snapshot_interval = 0)" in md
    assert "every - steps" not in md and "every 0 steps" not in md
