"""One checkpoint value (components/checkpoint/found.py): a run folder, a checkpoint folder, a
step-N directory and an export all resolve to one FoundCheckpoint; a torn or corrupt one says why;
its model is built from what one read of its files gave (DCP's .metadata read once); a save's paths
are one value (tree.SaveTarget)."""

import json
import os
import shutil
import sys

import pytest
import torch
from test_checkpoint import make_trainer, run  # tests/unit is on sys.path

from torchtitan_loom.components.checkpoint import found, names, safe_read, tree
from torchtitan_loom.tools import export as export_tool


@pytest.fixture(scope="module")
def trained(tiny_pack, tmp_path_factory):
    """A 2-step run with checkpoints at steps 1 and 2, and its trainer."""
    dump = tmp_path_factory.mktemp("found")
    t = run(make_trainer(tiny_pack, dump, "--training.steps", "2", "--checkpoint.interval", "1"))
    return dump, t


def test_every_way_to_name_a_checkpoint_gives_the_same_value(trained, tmp_path):
    dump, _ = trained
    step2 = str(dump / "checkpoint" / "step-2")
    named = [str(dump), str(dump / "checkpoint"), step2]
    values = [found.find(p) for p in named]
    assert all(v == values[0] for v in values)
    ck = values[0]
    assert (ck.folder, ck.kind, ck.step, ck.problem) == (step2, "periodic", 2, None)
    assert ck.spec_name == "loom" and ck.model_args["flavor"] == "debug"
    assert ck.meta["step"] == 2 and ck.meta["world_size"] == 1
    assert ck.config_path == os.path.join(step2, names.CONFIG_TOML)
    assert found.find(str(dump), step=1).folder == str(dump / "checkpoint" / "step-1")

    out = tmp_path / "export"
    assert export_tool.main([str(dump), str(out)]) == 0
    exported = found.find(str(out))
    assert (exported.kind, exported.step, exported.spec_name) == ("export", 2, "loom")
    assert exported.model_args["source"] == os.path.abspath(step2)
    again = tmp_path / "bf16"  # an export is read as a checkpoint: re-exported and verified
    assert export_tool.main([str(out), str(again), "--dtype", "bf16", "--verify"]) == 0
    assert found.find(str(again)).tensors()["output.weight"].dtype == torch.bfloat16


def test_the_model_is_built_from_one_read_of_the_metadata(trained):
    dump, t = trained
    reads = []
    code = safe_read.read_metadata_file.__code__

    def count(frame, event, arg):
        if event == "call" and frame.f_code is code:
            reads.append(frame.f_code.co_name)

    sys.setprofile(count)
    try:
        model = found.find(str(dump)).build()
    finally:
        sys.setprofile(None)
    assert len(reads) == 1  # verified, then loaded from the same Metadata
    want = t.model.state_dict()
    got = model.state_dict()
    assert got.keys() == want.keys() and not model.training
    assert all(torch.equal(got[k], want[k]) for k in want)
    decoding = found.find(str(dump)).build(decoding=True)
    assert decoding.args.capacity_factor == 0 and decoding.args.attn_backend == "sdpa"


def test_a_run_folder_is_read_where_its_run_keeps_checkpoints(trained, tmp_path):
    dump, _ = trained
    moved = tmp_path / "run"
    shutil.copytree(dump, moved, ignore=shutil.ignore_patterns("RUN.lock"))
    os.rename(moved / "checkpoint", moved / "ckpts")
    with pytest.raises(found.NotACheckpoint, match="no complete step-N checkpoint"):
        found.find(str(moved))  # its run.json still says checkpoint/
    record = json.loads((moved / names.RUN_JSON).read_text())
    record["resolved"]["checkpoint.folder"] = "ckpts"
    (moved / names.RUN_JSON).write_text(json.dumps(record))
    assert found.find(str(moved)).folder == str(moved / "ckpts" / "step-2")


def test_a_torn_or_corrupt_checkpoint_says_why(trained, tmp_path):
    dump, _ = trained
    torn = tmp_path / "torn"
    shutil.copytree(dump / "checkpoint" / "step-2", torn)
    os.remove(torn / names.MARKER)
    with pytest.raises(found.NotACheckpoint, match="incomplete checkpoint"):
        found.find(str(torn))

    bad = tmp_path / "bad"
    shutil.copytree(dump / "checkpoint" / "step-2", bad)
    with open(bad / "__0_0.distcp", "r+b") as fh:
        fh.seek(100)
        byte = fh.read(1)
        fh.seek(100)
        fh.write(bytes([byte[0] ^ 0xFF]))
    ck = found.at(str(bad))
    assert "__0_0.distcp" in ck.problem and "CRC-32" in ck.problem
    assert found.at(str(bad), verify="none").problem is None  # links only
    with pytest.raises(found.NotACheckpoint, match=r"bad: checkpoint is corrupt: .*CRC-32"):
        found.find(str(bad))

    with pytest.raises(found.NotACheckpoint, match="no such file or directory"):
        found.find(str(tmp_path / "nothing"))
    with pytest.raises(found.NotACheckpoint, match="no complete step-N checkpoint"):
        found.find(str(tmp_path))


def test_a_save_computes_its_paths_once(tmp_path):
    periodic = tree.SaveTarget.of(str(tmp_path), 7, "periodic")
    snapshot = tree.SaveTarget.of(str(tmp_path), 7, "snapshot")
    assert periodic.final == str(tmp_path / "step-7")
    assert periodic.tmp == str(tmp_path / ".tmp-step-7")
    assert snapshot.final == str(tmp_path / tree.SNAPSHOT_DIR / "step-7")
    assert snapshot.tmp == str(tmp_path / tree.SNAPSHOT_DIR / ".tmp-step-7")
    assert tree.owner(snapshot.final) == tree.owner(periodic.final) == str(tmp_path)
