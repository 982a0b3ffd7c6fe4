"""The inference/export/analysis tools on bad input: one line and exit 2 (no traceback), never a
write or a removal through a planted symbolic link, an occupied OUT refused before the checkpoint
is read, --verify against the step that was exported, damaged tokenizer.json / metrics.jsonl;
tests/unit/test_tool_outputs.py checks the progress lines."""

import json
import os
import shutil

import pytest
from test_checkpoint import make_trainer, run  # tests/unit is on sys.path

from torchtitan_loom.components.checkpoint import tree
from torchtitan_loom.tools import analyze as analyze_tool
from torchtitan_loom.tools import export as export_tool
from torchtitan_loom.tools import generate as generate_tool
from torchtitan_loom.tools.holdout import logged_eval_loss

OUTSIDE = b"the user's own file\n"


@pytest.fixture(scope="module")
def pristine(tiny_pack, tmp_path_factory):
    """A 2-step run with checkpoints at steps 1 and 2 (different weights) and a metrics.jsonl."""
    dump = tmp_path_factory.mktemp("tools_bad_input") / "run"
    run(make_trainer(tiny_pack, dump, "--training.steps", "2", "--checkpoint.interval", "1"))
    return dump


@pytest.fixture
def dump(pristine, tmp_path):
    """A copy of the run that a test may change."""
    return shutil.copytree(pristine, tmp_path / "run", symlinks=True)


@pytest.fixture
def outside(tmp_path):
    path = tmp_path / "outside.txt"
    path.write_bytes(OUTSIDE)
    return path


def error_line(capsys, prefix):
    """The one error line on stderr (progress lines end with " ..." and are left out)."""
    lines = capsys.readouterr().err.strip().splitlines()
    errors = [ln for ln in lines if not (ln.endswith(" ...") and not ln.startswith(prefix))]
    assert len(errors) == 1 and errors[0].startswith(prefix), lines
    assert "Traceback" not in "\n".join(lines)
    return errors[0]


def analyze_args(*extra):
    return ["--tokens", "200", "--batch-rows", "4", "--samples", "1", *extra]


# -- 1. no write or removal through a link ---------------------------------------------------------


def test_export_hf_force_refuses_a_link_at_a_name_it_writes(dump, tmp_path, outside, capsys):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").symlink_to(outside)
    (out / "notes.txt").write_text("mine")
    assert export_tool.main([str(dump), str(out), "--format", "hf", "--force"]) == 2
    err = error_line(capsys, "export error:")
    assert f"{out / 'config.json'} is a symbolic link" in err
    assert outside.read_bytes() == OUTSIDE and (out / "config.json").is_symlink()
    assert sorted(os.listdir(out)) == ["config.json", "notes.txt"]  # nothing written or removed


def test_export_force_refuses_a_link_at_its_temporary_name(dump, tmp_path, outside, capsys):
    out = tmp_path / "st"
    out.mkdir()
    (out / "model.safetensors.partial").symlink_to(outside)
    assert export_tool.main([str(dump), str(out), "--force"]) == 2
    assert "model.safetensors.partial is a symbolic link" in error_line(capsys, "export error:")
    assert outside.read_bytes() == OUTSIDE


def test_export_force_will_not_clear_an_out_that_is_a_link(dump, tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "model_args.json").write_bytes(OUTSIDE)
    out = tmp_path / "out_link"
    out.symlink_to(elsewhere)
    assert export_tool.main([str(dump), str(out), "--force"]) == 2
    assert f"{out} is a symbolic link" in error_line(capsys, "export error:")
    assert os.listdir(elsewhere) == ["model_args.json"]
    assert (elsewhere / "model_args.json").read_bytes() == OUTSIDE


def test_export_force_replaces_only_export_files(dump, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")  # an earlier --format hf export's file
    (out / "notes.txt").write_text("mine")
    assert export_tool.main([str(dump), str(out), "--force"]) == 0
    assert sorted(os.listdir(out)) == [
        "config.toml",
        "model.safetensors",
        "model_args.json",
        "notes.txt",
    ]
    assert (out / "notes.txt").read_text() == "mine"


def test_analyze_refuses_a_link_at_a_report_name(dump, tmp_path, outside, capsys):
    for name in ("report.md", "loss_per_loop.png"):
        out = tmp_path / f"report_{name}"
        out.mkdir()
        (out / name).symlink_to(outside)
        assert analyze_tool.main([str(dump), "--out", str(out), *analyze_args()]) == 2
        assert f"{out / name} is a symbolic link" in error_line(capsys, "analyze error:")
        assert outside.read_bytes() == OUTSIDE and os.listdir(out) == [name]


def test_analyze_refuses_a_linked_analysis_folder_in_the_run(dump, tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (dump / "analysis").symlink_to(elsewhere)
    assert analyze_tool.main([str(dump), *analyze_args()]) == 2
    assert f"{dump / 'analysis'} is a symbolic link" in error_line(capsys, "analyze error:")
    assert os.listdir(elsewhere) == []


# -- 2. an occupied OUT is refused before the checkpoint is read -----------------------------------


@pytest.mark.parametrize("fmt", ["safetensors", "hf"])
def test_export_refuses_an_occupied_out_before_reading_the_checkpoint(dump, tmp_path, capsys, fmt):
    out = tmp_path / "occupied"
    out.mkdir()
    (out / "model_args.json").write_text("{}")
    # A checkpoint that cannot be read at all: its data files are gone.
    for step in ("step-1", "step-2"):
        for name in os.listdir(dump / "checkpoint" / step):
            if name.endswith(".distcp"):
                os.remove(dump / "checkpoint" / step / name)
    assert export_tool.main([str(dump), str(out), "--format", fmt]) == 2
    err = error_line(capsys, "export error:")
    assert "already holds model_args.json" in err and "pass --force" in err, err
    assert (out / "model_args.json").read_text() == "{}"


# -- 5. --verify checks the step that was exported -------------------------------------------------


def test_verify_checks_the_exported_step_when_a_newer_one_appears(dump, tmp_path, capsys):
    out = tmp_path / "export"
    export_tool.export(str(dump), str(out))
    assert json.loads((out / "model_args.json").read_text())["step"] == 2
    # The run saves step 3 meanwhile (here: step 1's weights under a newer step).
    shutil.copytree(dump / "checkpoint" / "step-1", dump / "checkpoint" / "step-3")
    assert tree.scan(str(dump / "checkpoint")).newest().step == 3
    assert export_tool.verify(str(dump), str(out)) == 28
    assert export_tool.verify(None, str(out)) == 28  # the source the export records
    with pytest.raises(export_tool.ExportError, match="values differ"):
        export_tool.verify(str(dump / "checkpoint" / "step-3"), str(out))  # named explicitly


# -- 4. damaged tokenizer.json and metrics.jsonl ---------------------------------------------------


@pytest.fixture
def export_with_tokenizer(dump, tmp_path):
    """An export whose tokenizer is its own tokenizer.json (no config.toml, so no pack)."""
    out = tmp_path / "export"
    export_tool.export(str(dump), str(out))
    os.remove(out / "config.toml")
    return out


@pytest.mark.parametrize(
    "text, expected",
    [
        ("this is not json", "not valid JSON, broken"),
        ('{"version": "1.0", "model": {"type": "BPE", "vocab": {"a', "not valid JSON, cut short"),
        ('["a", "list"]', "a JSON list, not a tokenizer"),
        ('{"version": "1.0"}', "not a tokenizer"),
    ],
)
def test_damaged_tokenizer_json_is_one_line_in_generate_and_export(
    export_with_tokenizer, tmp_path, capsys, text, expected
):
    tok = export_with_tokenizer / "tokenizer.json"
    tok.write_text(text)
    capsys.readouterr()
    argv = [str(export_with_tokenizer), "--prompt", "the cat", "--max-new-tokens", "2"]
    assert generate_tool.main(argv) == 2
    err = error_line(capsys, "generate error:")
    assert f"tokenizer file {tok}: " in err and expected in err, err
    hf = tmp_path / "hf"
    assert export_tool.main([str(export_with_tokenizer), str(hf), "--format", "hf"]) == 2
    err = error_line(capsys, "export error:")
    assert f"tokenizer file {tok}: " in err and expected in err, err


def damage_metrics(path):
    """A non-JSON line, a JSON list, a row with a text step, and a 9 MB line, between good rows."""
    lines = path.read_text().splitlines()
    bad = ["{not json", "[1, 2, 3]", '{"step": "two", "loss": 1.0}', '{"x": "' + "y" * 9_000_000]
    path.write_text("\n".join(lines[:1] + bad + lines[1:]) + "\n")
    return len(bad)


def test_damaged_metrics_lines_are_skipped_with_one_warning_in_analyze(dump, tmp_path, capsys):
    damage_metrics(dump / "metrics.jsonl")
    out = tmp_path / "report"
    assert analyze_tool.main([str(dump), "--out", str(out), *analyze_args()]) == 0
    err = capsys.readouterr().err
    warnings = [ln for ln in err.splitlines() if ln.startswith("warning: ")]
    assert warnings == [
        f"warning: {dump / 'metrics.jsonl'} line 2: not JSON (Expecting property name enclosed "
        "in double quotes); skipped (and 3 more bad lines)"
    ], err
    assert (out / "report.md").is_file()


def test_damaged_metrics_lines_in_the_holdout_check(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "loss": 3.0}, {"step": 2, "eval_loss": 2.5}, {"step": 2, "eval_loss": 2.25}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert damage_metrics(path) == 4
    assert logged_eval_loss(str(path), 2) == 2.25  # the good rows still count, the last one wins
    (warning,) = capsys.readouterr().err.strip().splitlines()
    assert warning.startswith(f"warning: {path} line 2: not JSON") and "3 more bad lines" in warning
    with open(path, "a") as fh:
        fh.write('{"step": 2, "eval_loss": "low"}\n')  # wrong type: not taken as a loss
    assert logged_eval_loss(str(path), 2) == 2.25


# -- 3. analyze writes into the run, never into the current directory ------------------------------


def test_analyze_without_out_writes_under_the_run_folder(dump, tmp_path, monkeypatch, capsys):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert analyze_tool.main([str(dump / "checkpoint" / "step-1"), *analyze_args()]) == 0
    report = dump / "analysis" / "step-1" / "report.md"
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == f"report written: {report}"
    assert report.is_file() and (report.parent / "loss_per_loop.png").is_file()
    assert os.listdir(cwd) == []


def test_a_checkpoint_file_linked_to_an_identical_copy_outside_is_refused(dump, tmp_path, capsys):
    """Issue 34: a .distcp replaced by a link to an identical copy outside the folder loaded
    without a word. Nothing is damaged, but loading never reads outside the checkpoint: the tools
    refuse it with one line, and a resume skips that checkpoint (its found.at(...).problem)."""
    from torchtitan_loom.components.checkpoint import found

    step = dump / "checkpoint" / "step-2"
    copy = tmp_path / "copy.distcp"
    shutil.copyfile(step / "__0_0.distcp", copy)
    os.remove(step / "__0_0.distcp")
    os.symlink(copy, step / "__0_0.distcp")
    capsys.readouterr()
    assert generate_tool.main([str(step), "--prompt", "the", "--max-new-tokens", "1"]) == 2
    err = error_line(capsys, "generate error:")
    assert "__0_0.distcp" in err and "a checkpoint holds only its own files" in err, err
    assert "symbolic link" in found.at(str(step)).problem
