"""tools.compare on hand-written run folders (config.toml, run.json, metrics.jsonl as the trainer
writes them): mean ± sample standard deviation against statistics.stdev, grouping of plain run
folders and of a study's, what is read from the metrics, the out folder's rules, the figures."""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan_loom.components.runtime import exit_codes
from torchtitan_loom.config import load_config, to_toml
from torchtitan_loom.tools import compare as compare_tool

ROOT = Path(__file__).resolve().parents[2]
PRESET = ROOT / "train_configs" / "debug_model.toml"
FPT = 11.5e6  # FLOPs per token the fake runs' tflops and tokens/s imply
RATE = 1000.0  # tokens/s
TOKENS_PER_STEP = 16 * 256  # the preset's global_batch_size × seq_len


def eval_row(step, losses, **extra):
    row = {"step": step, "loss": 3.0, "tokens_per_s": RATE, "tflops": RATE * FPT / 1e12}
    row |= {"tokens_seen": 100 * step, "eval_loss": losses[-1], **extra}
    return row | {f"eval_loss_loop_{t + 1}": v for t, v in enumerate(losses)}


def make_run(folder, seed, final, loops=3, status="finished", rows=None, **cfg_keys):
    """A run folder of 4 steps with evals at steps 2 and 4 (``final``: the losses after each loop
    at step 4), unless ``rows`` are given."""
    args = ["--job.config_file", str(PRESET), "--job.dump_folder", str(folder)]
    args += ["--training.seed", str(seed), "--model.num_loops", str(loops), "--training.steps", "4"]
    for key, value in cfg_keys.items():
        args += [f"--{key.replace('__', '.')}", str(value)]
    folder.mkdir(parents=True)
    (folder / "config.toml").write_text(to_toml(load_config(args)))
    (folder / "run.json").write_text(json.dumps({"status": status, "step": 4, "launches": []}))
    rows = rows or [eval_row(2, [v + 1 for v in final]), eval_row(4, final)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def run_compare(*args):
    return compare_tool.main([str(a) for a in args])


def read_json(out):
    return json.loads((Path(out) / "compare.json").read_text())


def test_mean_and_sample_std_over_seeds(tmp_path, capsys):
    finals = [[4.1, 3.9, 3.8], [4.3, 4.0, 3.7], [4.0, 3.95, 3.85]]
    runs = [make_run(tmp_path / f"s{i}", i, f) for i, f in enumerate(finals)]
    assert run_compare(*runs, "--out", tmp_path / "out") == exit_codes.OK
    (group,) = read_json(tmp_path / "out")["groups"]
    for t in range(3):
        values = [f[t] for f in finals]
        got = group["final_loss_per_loop"][t]
        assert got["mean"] == pytest.approx(statistics.fmean(values), rel=1e-12)
        assert got["std"] == pytest.approx(statistics.stdev(values), rel=1e-12)  # n - 1
        assert got["n"] == 3
    assert group["seeds"] == [0, 1, 2]
    assert group["flops_per_token"]["mean"] == pytest.approx(FPT)
    assert group["tokens"] == {"mean": 400.0, "std": 0.0, "n": 3}
    # Two logged intervals of 2 steps each at RATE tokens/s.
    assert group["train_s"]["mean"] == pytest.approx(4 * TOKENS_PER_STEP / RATE)
    assert group["params"] > group["active_params"] > 0  # the debug model, built on meta
    out = capsys.readouterr().out
    mean, std = statistics.fmean([3.8, 3.7, 3.85]), statistics.stdev([3.8, 3.7, 3.85])
    assert f"| {mean:.4f} ± {std:.4f} |" in out  # the console table, last loop


def test_plain_runs_group_by_the_keys_their_configs_differ_in(tmp_path, capsys):
    make_run(tmp_path / "h3_a", 0, [4.0, 3.9, 3.8])
    make_run(tmp_path / "h3_b", 1, [4.2, 4.1, 4.0])
    make_run(tmp_path / "h1_a", 0, [4.5], loops=1)
    assert run_compare(*sorted((tmp_path).iterdir())) == exit_codes.OK
    doc = read_json(tmp_path / "compare")  # default: <parent of the first run>/compare
    names = {g["name"]: g for g in doc["groups"]}
    assert set(names) == {"model.num_loops=3", "model.num_loops=1"}
    assert len(names["model.num_loops=3"]["used"]) == 2
    assert names["model.num_loops=1"]["final_loss_per_loop"] == [{"mean": 4.5, "std": None, "n": 1}]
    out = capsys.readouterr().out
    one = next(ln for ln in out.splitlines() if ln.startswith("| model.num_loops=1 |"))
    assert "±" not in one.split("|", 9)[-1] and "| 4.5000 | — | — |" in one


def test_a_study_folder_groups_by_variant(tmp_path, capsys):
    study = tmp_path / "study"
    make_run(study / "A" / "seed-0", 0, [4.0, 3.9, 3.8])
    make_run(study / "A" / "seed-1", 1, [4.0, 3.9, 3.6])
    make_run(study / "B" / "seed-0", 0, [4.0, 3.9, 3.7], optimizer__lr=0.001)
    make_run(study / "B" / "seed-1", 1, [4.0, 3.9, 3.7], optimizer__lr=0.001, status="stopped")
    runs = [
        {"variant": v, "seed": s, "folder": f"{v}/seed-{s}", "wall_s": 10.0 + s}
        for v in ("A", "B")
        for s in (0, 1, 2)  # seed 2 was never run
    ]
    (study / "study.json").write_text(json.dumps({"name": "x", "runs": runs}))
    assert run_compare(study) == exit_codes.OK
    doc = read_json(study / "compare")  # default: <study>/compare
    a, b = doc["groups"]
    assert (a["name"], b["name"]) == ("A", "B")
    assert a["wall_s"]["mean"] == pytest.approx(10.5)
    assert b["seeds"] == [0] and len(b["runs"]) == 2  # the stopped run: listed, not averaged
    notes = "\n".join(doc["notes"])
    assert "A/seed-2: not run yet" in notes and "B/seed-1: stopped at step 4" in notes
    md = (study / "compare" / "compare.md").read_text()
    assert "| A/seed-1 | A | 1 | finished (step 4) | 4 |" in md
    assert "sample standard deviation" in md and "![loss vs tokens](loss_vs_tokens.png)" in md


def test_the_history_after_a_relaunch_and_a_damaged_line(tmp_path, capsys):
    rows = [
        eval_row(2, [5.0, 4.0]),
        eval_row(4, [9.0, 9.0]),  # replaced: the relaunch resumed from step 2
        eval_row(4, [3.0, 2.5], launch={"resumed_from_step": 2}),
    ]
    run = make_run(tmp_path / "r", 0, None, loops=2, rows=rows)
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 5, "eval_loss_loop_1"\n')  # cut by a crash
    assert run_compare(run, "--out", tmp_path / "out") == exit_codes.OK
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning:")]
    (warning,) = warnings  # one line naming the file and the line
    assert warning.startswith(f"warning: {run / 'metrics.jsonl'} line 4: not JSON")
    (r,) = read_json(tmp_path / "out")["runs"]
    assert [e["step"] for e in r["evals"]] == [2, 4] and r["final_loss_per_loop"] == [3.0, 2.5]
    assert r["train_s"] == pytest.approx(2 * 2 * TOKENS_PER_STEP / RATE)  # steps 1-2, then 3-4


def test_not_a_run_folder_is_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "run.json").write_text("{}")  # no metrics.jsonl
    assert run_compare(tmp_path / "empty") == exit_codes.BAD_INPUT
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err == (
        f"compare error: {tmp_path / 'empty'} is not a run folder (no run.json/metrics.jsonl) "
        "nor a study folder (no study.json)"
    )


def test_a_finished_run_whose_files_are_a_fifo_or_a_device_link_is_named_as_left_out(
    tmp_path, capsys, outside
):
    study = tmp_path / "study"
    for v in ("A", "B", "C"):
        make_run(study / v / "seed-0", 0, [4.0, 3.9, 3.8])
    (study / "B" / "seed-0" / "run.json").unlink()
    os.mkfifo(study / "B" / "seed-0" / "run.json")  # a reader that opened it would wait forever
    (study / "C" / "seed-0" / "metrics.jsonl").unlink()
    os.symlink("/dev/zero", study / "C" / "seed-0" / "metrics.jsonl")  # endless, never a file
    runs = [{"variant": v, "seed": 0, "folder": f"{v}/seed-0"} for v in ("A", "B", "C")]
    (study / "study.json").write_text(json.dumps({"name": "x", "runs": runs}))
    assert run_compare(study, "--out", tmp_path / "out") == exit_codes.OK
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"warning: {study / 'B' / 'seed-0'}: its run.json is a FIFO, not a regular file, left out",
        f"warning: {study / 'C' / 'seed-0'}: its metrics.jsonl is a symbolic link to '/dev/zero' "
        "(a device), not a regular file, left out",
    ]
    notes = read_json(tmp_path / "out")["notes"]
    assert [n.removeprefix("warning: ") for n in err] == notes  # compare.md says the same
    assert [g["name"] for g in read_json(tmp_path / "out")["groups"]] == ["A"]
    outside.check()


def test_the_out_folder_is_never_overwritten_unasked_nor_written_through_a_link(tmp_path, capsys):
    run = make_run(tmp_path / "runs" / "r0", 0, [4.0, 3.9, 3.8])
    out = tmp_path / "runs" / "compare"
    assert run_compare(run) == exit_codes.OK
    for name in ("loss_vs_tokens.png", "loss_vs_flops.png"):
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
    (out / "mine.txt").write_text("keep")
    before = (out / "compare.json").read_bytes()
    assert run_compare(run) == exit_codes.BAD_INPUT
    assert (
        "already holds" in capsys.readouterr().err and (out / "compare.json").read_bytes() == before
    )
    assert run_compare(run, "--force") == exit_codes.OK
    assert (out / "mine.txt").read_text() == "keep"
    target = tmp_path / "outside.md"
    target.write_text("the user's")
    os.unlink(out / "compare.md")
    os.symlink(target, out / "compare.md")
    capsys.readouterr()
    assert run_compare(run, "--force") == exit_codes.BAD_INPUT
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err.startswith(f"compare error: {out / 'compare.md'} is a symbolic link")
    assert target.read_text() == "the user's"


@pytest.mark.parametrize(
    "tool", ["compare", "compare_runs", "compare_report", "study", "study_file"]
)
def test_the_tools_import_no_torch_before_their_first_line(tool):
    code = f"import sys; import torchtitan_loom.tools.{tool}; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
