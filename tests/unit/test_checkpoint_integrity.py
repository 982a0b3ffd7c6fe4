"""Checksummed checkpoints (issue #11): every kind of file corrupted (bytes, truncation, deletion)
makes the resume fall back to the previous checkpoint, bit-identical to a run that never saw the
corrupt one; load_step of a corrupt one, non-finite weights, export --verify, disk full; a run
whose checkpoints are all damaged is refused, not restarted."""

import os
import shutil

import pytest
import torch

from tests.unit.test_checkpoint import assert_same_state, make_trainer, run
from torchtitan_loom import train
from torchtitan_loom.components.checkpoint import CheckpointError, integrity, tree
from torchtitan_loom.config import ConfigError
from torchtitan_loom.tools import export as export_tool

STEPS = ("--training.steps", "6", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0")
FILES = (
    ".metadata",
    "__0_0.distcp",
    "config.toml",
    "model_args.json",
    "meta.json",
    integrity.CHECKSUMS,
    tree.MARKER,
)


@pytest.fixture(scope="module")
def straight(tiny_pack, tmp_path_factory):
    """6 uninterrupted steps: what every fallback resume must reproduce bit for bit."""
    return run(make_trainer(tiny_pack, tmp_path_factory.mktemp("straight"), *STEPS))


@pytest.fixture(scope="module")
def pristine(tiny_pack, tmp_path_factory):
    """A run folder with complete step-2 and step-4 (stopped after step 4)."""
    dump = tmp_path_factory.mktemp("pristine")
    run(make_trainer(tiny_pack, dump, *STEPS, "--checkpoint.exit_after_step", "4"))
    assert [e.step for e in tree.scan(str(dump / "checkpoint")).complete] == [2, 4]
    return dump


def corrupt(path, how):
    if how == "delete":
        os.remove(path)
    elif how == "truncate":
        with open(path, "r+b") as fh:
            fh.truncate(os.path.getsize(path) // 2)
    else:  # same size, different bytes in the middle
        data = bytearray(open(path, "rb").read())
        mid = len(data) // 2
        data[mid : mid + 8] = bytes(b ^ 0xA5 for b in data[mid : mid + 8])
        open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("how", ["bytes", "truncate", "delete"])
@pytest.mark.parametrize("name", FILES)
def test_corrupt_file_falls_back_to_previous_checkpoint_bit_identically(
    tiny_pack, tmp_path, pristine, straight, name, how, capsys
):
    dump = tmp_path / "run"
    shutil.copytree(pristine, dump)
    bad = dump / "checkpoint" / "step-4" / name
    corrupt(bad, how)
    capsys.readouterr()
    resumed = make_trainer(tiny_pack, dump, *STEPS)
    out = capsys.readouterr().out
    assert resumed.state.step == 2, out
    if name in (tree.MARKER, ".metadata") and how == "delete":  # a torn save, skipped as before
        assert "skipping incomplete checkpoint" in out and str(bad.parent) in out
    else:
        warnings = [
            line
            for line in out.splitlines()
            if line.startswith("[torchtitan_loom] warning: skipping corrupt")
        ]
        assert len(warnings) == 1 and str(bad) in warnings[0], out
    assert (
        dump / "checkpoint" / tree.ABANDONED / "step-4" / "meta.json"
    ).exists() or name == "meta.json"
    run(resumed)
    assert_same_state(straight, resumed)


def test_load_step_of_a_corrupt_checkpoint_is_refused(tiny_pack, tmp_path, pristine):
    dump = tmp_path / "run"
    shutil.copytree(pristine, dump)
    distcp = dump / "checkpoint" / "step-4" / "__0_0.distcp"
    corrupt(distcp, "bytes")  # same size: found by the full CRC in the manager
    with pytest.raises(
        CheckpointError, match=r"load_step = 4: checkpoint is corrupt: .*__0_0.distcp: CRC-32"
    ):
        make_trainer(tiny_pack, dump, *STEPS, "--checkpoint.load_step", "4")
    corrupt(distcp, "truncate")  # another size: found already by the config check
    with pytest.raises(
        ConfigError, match=r"load_step = 4: checkpoint is corrupt: .*__0_0.distcp: size"
    ):
        make_trainer(tiny_pack, dump, *STEPS, "--checkpoint.load_step", "4")


def write_nonfinite_step(trainer, step):
    """A checkpoint of a NaN model with valid checksums (as an older version could have written)."""
    with torch.no_grad():
        next(trainer.model.parameters()).fill_(float("nan"))
    target = tree.SaveTarget.of(trainer.checkpointer.root, step, "periodic")
    trainer.checkpointer.writer._save(target, False)  # bypasses save()'s finiteness guard


def test_nonfinite_model_is_never_saved_and_never_loaded(tiny_pack, tmp_path, capsys, straight):
    t = run(make_trainer(tiny_pack, tmp_path, *STEPS, "--checkpoint.exit_after_step", "2"))
    with torch.no_grad():
        next(t.model.parameters()).fill_(float("nan"))
    t.checkpointer.save(4)
    assert "not saving step 4: non-finite weights" in capsys.readouterr().out
    assert [e.step for e in tree.scan(str(tmp_path / "checkpoint")).complete] == [2]
    write_nonfinite_step(t, 4)
    assert integrity.verify(str(tmp_path / "checkpoint" / "step-4")) is None
    with pytest.raises(CheckpointError, match="load_step: .*step-4 holds non-finite weights"):
        make_trainer(tiny_pack, tmp_path, *STEPS, "--checkpoint.load_step", "4")
    resumed = make_trainer(tiny_pack, tmp_path, *STEPS)
    out = capsys.readouterr().out
    assert resumed.state.step == 2 and "skipping corrupt checkpoint" in out and "non-finite" in out
    run(resumed)
    assert_same_state(straight, resumed)


def test_export_verify_checks_checksums_and_finiteness(tiny_pack, tmp_path, pristine, capsys):
    dump = tmp_path / "run"
    shutil.copytree(pristine, dump)
    ckpt = dump / "checkpoint" / "step-4"
    assert export_tool.main([str(ckpt), str(tmp_path / "out"), "--verify"]) == 0
    corrupt(ckpt / "__0_0.distcp", "bytes")
    capsys.readouterr()
    assert export_tool.main([str(ckpt), str(tmp_path / "out2"), "--verify"]) == 2
    assert "checkpoint is corrupt" in capsys.readouterr().err


def test_checksums_are_recorded_before_the_marker(pristine):
    step = pristine / "checkpoint" / "step-2"
    marker = tree.read_json(str(step / tree.MARKER))
    assert marker["checksums"] == integrity.CHECKSUMS
    sums = tree.read_json(str(step / integrity.CHECKSUMS))["files"]
    assert set(sums) == set(os.listdir(step)) - {tree.MARKER, integrity.CHECKSUMS}
    assert (
        sums["__0_0.distcp"]["crc32"] == f"{integrity.crc32_file(str(step / '__0_0.distcp')):08x}"
    )


def _tree(path):
    return {
        p.relative_to(path).as_posix(): p.read_bytes()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize(
    "how", ["truncate", "bytes"]
)  # found by the config check / by the full CRC at load
def test_a_run_whose_checkpoints_are_all_damaged_is_refused_never_restarted(
    tiny_pack, tmp_path, pristine, how, capsys
):
    dump = tmp_path / "run"
    shutil.copytree(pristine, dump)
    for step in (2, 4):
        corrupt(dump / "checkpoint" / f"step-{step}" / "__0_0.distcp", how)
    before = _tree(dump)
    args = [
        "--data.path",
        str(tiny_pack),
        "--job.dump_folder",
        str(dump),
        "--training.seq_len",
        "32",
        "--training.global_batch_size",
        "4",
        "--training.micro_batch_size",
        "2",
        "--training.mixed_precision_param",
        "float32",
        "--metrics.log_freq",
        "1",
        "--eval.interval",
        "0",
        "--metrics.enable_tensorboard",
        "false",
        "--checkpoint.enable",
        *STEPS,
    ]
    capsys.readouterr()
    assert train.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "every complete checkpoint" in err[0] and "step-2, step-4" in err[0], (
        err
    )
    assert "--job.overwrite" in err[0]
    # Nothing written, renamed or deleted: the damaged checkpoints and the history are as they were.
    assert _tree(dump) == before
    assert train.main(args + ["--job.overwrite", "true"]) == 0  # the explicit way to start over
    replaced = [p for p in dump.iterdir() if p.name.startswith("replaced-")]
    assert len(replaced) == 1 and (replaced[0] / "checkpoint" / "step-4" / "__0_0.distcp").exists()


@pytest.mark.parametrize("how", ["deleted", "truncated", "linked"])
def test_a_save_missing_a_data_file_its_metadata_names_is_never_committed(pristine, tmp_path, how):
    """What a rank writing onto a node-local disk leaves in rank 0's folder: the metadata names
    __1_0.distcp (here __0_0.distcp) but the file is not there (or shorter, or a link). The commit
    refuses it, naming the file and why the folder must be shared; the folder stays a .tmp-."""
    src = os.path.join(pristine, "checkpoint", "step-4")
    tmp = os.path.join(tmp_path, "checkpoint", ".tmp-step-4")
    shutil.copytree(src, tmp)
    for name in (tree.MARKER, integrity.CHECKSUMS):
        os.remove(os.path.join(tmp, name))
    data = os.path.join(tmp, "__0_0.distcp")
    assert integrity.missing_data_files(tmp) is None
    if how == "deleted":
        os.remove(data)
    elif how == "truncated":
        os.truncate(data, os.path.getsize(data) // 2)
    else:
        os.rename(data, os.path.join(tmp_path, "elsewhere"))
        os.symlink(os.path.join(tmp_path, "elsewhere"), data)
    final = os.path.join(tmp_path, "checkpoint", "step-4")
    with pytest.raises(tree.IncompleteSave) as exc:
        tree.commit(tmp, final, {"step": 4, "kind": "periodic", "world_size": 2})
    assert "__0_0.distcp" in str(exc.value)
    assert ("symbolic link" if how == "linked" else "shared") in str(exc.value), exc.value
    assert not os.path.exists(final) and not os.path.exists(os.path.join(tmp, tree.MARKER))
