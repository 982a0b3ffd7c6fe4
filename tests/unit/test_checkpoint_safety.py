"""A checkpoint is data, never code: a planted pickle (in .metadata, in a non-tensor entry, in an
export's model.pt) runs nothing in any reader (resume, tools.generate, tools.export); the marker's
format version decides what loads unverified; file names read from a folder stay inside it."""

import json
import os
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.unit.test_checkpoint import make_trainer, run
from torchtitan_loom.components.checkpoint import (
    CheckpointError,
    found,
    integrity,
    load_full,
    tree,
)
from torchtitan_loom.tools import export as export_tool
from torchtitan_loom.tools import generate as generate_tool
from torchtitan_loom.tools.loading import LoadError, load_tokenizer

STEPS = ("--training.steps", "6", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0")


class Payload:
    """Unpickling this runs a shell command that creates ``mark``: what a planted pickle does."""

    def __init__(self, mark):
        self.mark = str(mark)

    def __reduce__(self):
        return os.system, (f"touch {self.mark}",)


@pytest.fixture(scope="module")
def pristine(tiny_pack, tmp_path_factory):
    """A run folder with complete step-2 and step-4 (stopped after step 4)."""
    dump = tmp_path_factory.mktemp("pristine")
    run(make_trainer(tiny_pack, dump, *STEPS, "--checkpoint.exit_after_step", "4"))
    return dump


def copy_run(pristine, tmp_path):
    dump = tmp_path / "run"
    shutil.copytree(pristine, dump)
    return dump


def plant_metadata_payload(step_dir, mark):
    """Rewrite .metadata as the real DCP metadata plus a code-running object, checksums matched
    (CRC-32 is no authentication): on torch's own reader the load goes on as if nothing happened."""
    md = dcp.FileSystemReader(str(step_dir)).read_metadata()  # the run's own, trusted file
    md.storage_meta.modules = [Payload(mark)]
    with open(step_dir / ".metadata", "wb") as fh:
        pickle.dump(md, fh)
    integrity.write_checksums(str(step_dir))
    assert integrity.verify(str(step_dir)) is None


def one_error_line(capsys, prefix):
    """The one error line; a tool's progress line before its slow part ("generate: loading … ...")
    may precede it, nothing else."""
    lines = capsys.readouterr().err.strip().splitlines()
    progress = [ln for ln in lines if ln.endswith(" ...") and not ln.startswith(prefix)]
    err = "\n".join(ln for ln in lines if ln not in progress)
    assert len(err.splitlines()) == 1 and err.startswith(prefix) and "Traceback" not in err, lines
    return err


def test_planted_metadata_runs_no_code_in_resume_generate_or_export(
    tiny_pack, pristine, tmp_path, capsys
):
    dump = copy_run(pristine, tmp_path)
    step4 = dump / "checkpoint" / "step-4"
    mark = tmp_path / "CODE_RAN"
    plant_metadata_payload(step4, mark)
    capsys.readouterr()

    resumed = make_trainer(tiny_pack, dump, *STEPS)  # resume: skipped like a corrupt checkpoint
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if "warning: skipping corrupt checkpoint" in line]
    assert resumed.state.step == 2 and len(warnings) == 1, out
    assert str(step4 / ".metadata") in warnings[0] and "posix.system" in warnings[0]
    assert not mark.exists()

    dump2 = copy_run(pristine, tmp_path / "again")  # the tools: one line, exit 2
    plant_metadata_payload(dump2 / "checkpoint" / "step-4", mark)
    capsys.readouterr()
    assert generate_tool.main([str(dump2), "--prompt", "the cat", "--max-new-tokens", "2"]) == 2
    assert "refused" in one_error_line(capsys, "generate error:")
    assert export_tool.main([str(dump2), str(tmp_path / "out")]) == 2
    assert "refused" in one_error_line(capsys, "export error:")
    assert not mark.exists() and not (tmp_path / "out" / "model.safetensors").exists()


def test_a_non_tensor_entry_that_asks_for_code_is_refused(tmp_path):
    mark = tmp_path / "CODE_RAN"
    ckpt = tmp_path / "ckpt"
    dcp.save(
        {"model": {"w": torch.ones(3)}, "train_state": {"step": Payload(mark)}},
        checkpoint_id=str(ckpt),
        no_dist=True,
    )
    with pytest.raises(CheckpointError, match=r"entry 'train_state.step' refused: not plain data"):
        load_full(str(ckpt))
    assert not mark.exists()
    assert load_full(str(ckpt), prefix="model.")["w"].tolist() == [
        1.0,
        1.0,
        1.0,
    ]  # tensors still load


def test_no_reader_calls_torch_load_without_weights_only(
    tiny_pack, pristine, tmp_path, monkeypatch, capsys
):
    dump = copy_run(pristine, tmp_path)
    calls = []
    real = torch.load

    def recording_load(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    assert (
        make_trainer(tiny_pack, dump, *STEPS).state.step == 4
    )  # resume: model, optimizer, every state
    assert generate_tool.main([str(dump), "--prompt", "the cat", "--max-new-tokens", "2"]) == 0
    assert export_tool.main([str(dump), str(tmp_path / "out")]) == 0
    assert calls and all(w is True for w in calls), calls


def test_a_marker_that_lost_its_checksums_is_refused_only_format_1_loads_unverified(
    tiny_pack, pristine, tmp_path, capsys
):
    dump = copy_run(pristine, tmp_path)
    step4 = dump / "checkpoint" / "step-4"
    marker = json.loads((step4 / tree.MARKER).read_text())
    del marker["checksums"]  # verification off on the old code, so a damaged file loaded silently
    (step4 / tree.MARKER).write_text(json.dumps(marker))
    with open(step4 / "__0_0.distcp", "r+b") as fh:
        fh.seek(os.path.getsize(step4 / "__0_0.distcp") // 2)
        fh.write(b"\xa5" * 8)
    capsys.readouterr()
    resumed = make_trainer(tiny_pack, dump, *STEPS)
    out = capsys.readouterr().out
    assert resumed.state.step == 2, out
    assert "names no checksum list; refused" in out and str(step4 / tree.MARKER) in out

    # The pre-checksum format (no "format", no "checksums", no CHECKSUMS.json) loads with a warning.
    dump = copy_run(pristine, tmp_path / "old")
    step4 = dump / "checkpoint" / "step-4"
    marker = json.loads((step4 / tree.MARKER).read_text())
    del marker["checksums"]
    marker.pop("format", None)
    (step4 / tree.MARKER).write_text(json.dumps(marker))
    os.remove(step4 / integrity.CHECKSUMS)
    capsys.readouterr()
    resumed = make_trainer(tiny_pack, dump, *STEPS)
    out = capsys.readouterr().out
    assert resumed.state.step == 4
    assert f"warning: checkpoint {step4} predates checksums (format 1): loaded unverified" in out


def test_export_file_name_stays_inside_the_export_and_model_pt_is_plain_tensors(
    pristine, tmp_path, capsys
):
    out = tmp_path / "out"
    assert export_tool.main([str(pristine), str(out)]) == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(str(out / "model.safetensors"), str(elsewhere / "model.safetensors"))
    info = json.loads((out / "model_args.json").read_text())
    (out / "model_args.json").write_text(
        json.dumps(dict(info, file="../elsewhere/model.safetensors"))
    )
    capsys.readouterr()
    assert generate_tool.main([str(out), "--prompt", "the cat", "--max-new-tokens", "2"]) == 2
    assert "must name a file inside" in one_error_line(capsys, "generate error:")
    with pytest.raises(found.NotACheckpoint, match="must name a file inside"):
        found.find(str(out)).build()

    mark = tmp_path / "CODE_RAN"  # a model.pt that asks for code: weights_only refuses it, one line
    torch.save({"w": Payload(mark)}, out / "model.pt")
    (out / "model_args.json").write_text(json.dumps(dict(info, file="model.pt")))
    assert generate_tool.main([str(out), "--prompt", "the cat", "--max-new-tokens", "2"]) == 2
    assert "not a plain state dict of tensors" in one_error_line(capsys, "generate error:")
    assert not mark.exists()


def test_export_refuses_to_overwrite_without_force(pristine, tmp_path, capsys):
    out = tmp_path / "out"
    assert export_tool.main([str(pristine / "checkpoint" / "step-2"), str(out)]) == 0
    before = (out / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert export_tool.main([str(pristine), str(out)]) == 2
    assert "pass --force" in one_error_line(capsys, "export error:")
    assert (out / "model.safetensors").read_bytes() == before
    assert export_tool.main([str(pristine), str(out), "--force"]) == 0
    assert json.loads((out / "model_args.json").read_text())["step"] == 4


def test_pack_tokenizer_path_is_resolved_against_the_pack(tmp_path, monkeypatch):
    import numpy as np

    from tests.unit.test_tokenizer import train_hf
    from torchtitan_loom.components.data.pack_writer import PackWriter
    from torchtitan_loom.components.data.tokenizer import build_tokenizer

    tok_dir = train_hf(tmp_path)
    tok = build_tokenizer(tok_dir)

    def write_pack(recorded):
        out = tmp_path / "pack"
        shutil.rmtree(out, ignore_errors=True)
        info = {"vocab_size": tok.vocab_size, "name_or_path": recorded, "eos_token_id": tok.eos_id}
        with PackWriter(out, info, max_seq_len=33) as w:
            for _ in range(40):
                w.add_document(
                    np.asarray(tok.encode("the cat sat on the mat") + [tok.eos_id], dtype=np.int64)
                )
            w.finish(epochs=1, holdout_tokens=0, seed=0)
        return out

    pack = write_pack(
        "mytok/tokenizer.json"
    )  # relative: to the pack, where the tokenizer is copied
    shutil.copytree(tok_dir, pack / "mytok")
    elsewhere = tmp_path / "cwd"
    (elsewhere / "mytok").mkdir(parents=True)  # the same name here holds nothing usable
    monkeypatch.chdir(elsewhere)
    assert load_tokenizer(pack, None, model_vocab=4096).name_or_path == str(
        pack / "mytok" / "tokenizer.json"
    )
    pack = write_pack("../mytok/tokenizer.json")  # exists, but outside the pack
    with pytest.raises(LoadError, match="resolves outside the pack"):
        load_tokenizer(pack, None, model_vocab=4096)
