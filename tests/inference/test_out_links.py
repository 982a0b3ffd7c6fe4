"""One rule for every tool that writes (tools/out_files.py): a folder the user names may be a link;
nothing the tool creates below it may be. Each tool is given a copy of a trained run (or a study
over it) with a symbolic link planted at the folder its default output goes to, pointing into a
checksummed folder outside the run: one ``<tool> error:`` line, exit 2, and the outside untouched.
The same tools still write through a link the user names as ``--out`` (their folder to choose)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from torchtitan_loom.components.runtime import exit_codes
from torchtitan_loom.tools import analyze as analyze_tool
from torchtitan_loom.tools import compare as compare_tool
from torchtitan_loom.tools import depth as depth_tool

DEPTH = ["--tokens", "600", "--kl", "0", "--confidence", "0"]


@pytest.fixture
def run(trained_run, tmp_path):
    """A copy of the trained run in ``runs/run`` (the shared one stays as it is)."""
    others = shutil.ignore_patterns("depth", "analysis", "eval_results")  # other tests' reports
    return shutil.copytree(trained_run, tmp_path / "runs" / "run", symlinks=True, ignore=others)


def plant(link, outside):
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(outside.folder, link)
    return link


def one_error(capsys, tool):
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"{tool} error: ") and "symbolic link" in line, line
    return line


def test_depth_refuses_a_link_at_its_default_folder(run, capsys, outside):
    link = plant(run / "depth", outside)
    assert depth_tool.main([str(run), *DEPTH]) == exit_codes.BAD_INPUT
    assert str(link) in one_error(capsys, "depth")
    outside.check()


def test_analyze_refuses_a_link_at_its_default_folder(run, capsys, outside):
    plant(run / "analysis", outside)
    code = analyze_tool.main([str(run), "--tokens", "300", "--samples", "0"])
    assert code == exit_codes.BAD_INPUT
    one_error(capsys, "analyze")
    outside.check()


def test_compare_refuses_a_link_at_its_default_folder(run, capsys, outside):
    link = plant(run.parent / "compare", outside)
    assert compare_tool.main([str(run)]) == exit_codes.BAD_INPUT
    assert str(link) in one_error(capsys, "compare")
    outside.check()
    os.unlink(link)  # the user's own --out may be a link: written through, as they asked
    elsewhere = run.parent.parent / "elsewhere"  # another disk, say
    elsewhere.mkdir()
    os.symlink(elsewhere, run.parent / "mine")
    assert compare_tool.main([str(run), "--out", str(run.parent / "mine")]) == exit_codes.OK
    assert (elsewhere / "compare.md").is_file()


def test_lm_eval_refuses_a_link_at_its_default_folder(run, capsys, outside):
    pytest.importorskip("lm_eval")
    from tests.inference.test_lm_eval_tool import TASK
    from torchtitan_loom.tools import lm_eval as eval_tool

    # The loader already refuses any link in a checkpoint; the writer would too (one rule).
    plant(run / "checkpoint" / "step-40" / "eval_results", outside)
    assert eval_tool.main([str(run), *TASK]) == exit_codes.BAD_INPUT
    assert "eval_results" in one_error(capsys, "lm_eval")
    outside.check()


def test_lm_eval_writes_its_results_never_through_a_link_below_the_folder_named(tmp_path, outside):
    from torchtitan_loom.tools import lm_eval as eval_tool
    from torchtitan_loom.tools.loading import LoadError

    payload = {"checkpoint": "c", "step": 1, "results": {}}
    plant(tmp_path / "ckpt" / "eval_results", outside)  # planted after the loader looked
    with pytest.raises(LoadError, match="eval_results is a symbolic link"):
        eval_tool.write_results(
            str(tmp_path / "ckpt" / "eval_results"), str(tmp_path / "ckpt"), payload
        )
    outside.check()
    out = eval_tool.write_results(
        str(outside.folder), str(outside.folder), payload
    )  # --out: theirs
    assert json.loads((tmp_path / out / "results.json").read_text())["step"] == 1


def test_study_refuses_a_variant_folder_planted_as_a_link(tmp_path, outside):
    preset = os.path.join(
        os.path.dirname(__file__), "..", "..", "train_configs", "debug_model.toml"
    )
    (tmp_path / "s.toml").write_text(
        f'[study]\nconfig_file = "{os.path.abspath(preset)}"\nseeds = [0, 1]\nfolder = "study"\n'
        '[study.overrides]\n"training.steps" = 2\n[variants.A]\n"model.num_loops" = 1\n'
    )
    plant(tmp_path / "study" / "A", outside)
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan_loom.tools.study", "s.toml"],
        cwd=tmp_path,
        env=dict(os.environ, NGPU="1", OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == exit_codes.BAD_INPUT, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("study error: study/A is a symbolic link"), line
    assert "launched" not in proc.stdout and not (tmp_path / "study" / "study.json").exists()
    outside.check()
