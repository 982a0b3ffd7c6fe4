"""A study end to end, as a user runs it: 2 variants × 2 seeds of the debug model (tiny settings,
through ./run_train.sh), a rerun that skips all four runs and touches none of their files, and
tools.compare on the study folder, whose per-run final losses are the runs' own metrics.jsonl."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from torchtitan_loom.tools import compare as compare_tool

ROOT = Path(__file__).resolve().parents[2]
ENV = {"NGPU": "1", "OMP_NUM_THREADS": "1"}  # one CPU rank, one thread (2 shared cores)
STUDY = """
[study]
config_file = "{preset}"
seeds = [0, 1]
folder = "study"

[study.overrides]  # tiny: 4 steps of 4 rows of 64 tokens, evals of 1000 tokens at steps 2 and 4
"training.steps" = 4
"training.global_batch_size" = 4
"training.micro_batch_size" = 4
"training.seq_len" = 64
"eval.interval" = 2
"eval.tokens" = 1000
"metrics.log_freq" = 2
"metrics.enable_tensorboard" = false

[variants.H3]
[variants.H1]
"model.num_loops" = 1
"""


def study(cwd, *args):
    return subprocess.run(
        [sys.executable, "-m", "torchtitan_loom.tools.study", "depth.toml", *args],
        cwd=cwd,
        env=dict(os.environ, **ENV),
        capture_output=True,
        text=True,
        timeout=600,
    )


def files(folder):
    """Every file under ``folder``: its bytes' digest and modification time."""
    return {
        str(p.relative_to(folder)): (
            hashlib.sha256(p.read_bytes()).hexdigest(),
            p.stat().st_mtime_ns,
        )
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_a_study_runs_resumes_nothing_finished_and_compares(tmp_path, capsys):
    (tmp_path / "depth.toml").write_text(
        STUDY.format(preset=ROOT / "train_configs" / "debug_model.toml")
    )
    first = study(tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    lines = first.stdout.splitlines()
    starts = [ln for ln in lines if ln.startswith("study: run ") and ln.endswith(": new ...")]
    assert starts == [
        f"study: run {i} of 4: {v} seed {s} -> study/{v}/seed-{s}: new ..."
        for i, (v, s) in enumerate([("H3", 0), ("H3", 1), ("H1", 0), ("H1", 1)], 1)
    ]
    assert sum(ln.startswith("study: run ") and " done in " in ln for ln in lines) == 4
    assert any(ln.startswith("[torchtitan_loom] step      4/4") for ln in lines)  # passed through
    runs = tmp_path / "study"
    before = {d: files(runs / d) for d in ("H3", "H1")}

    again = study(tmp_path)
    assert again.returncode == 0, again.stderr
    skipped = [ln for ln in again.stdout.splitlines() if ln.endswith("finished at step 4, skipped")]
    assert len(skipped) == 4 and "[torchtitan_loom]" not in again.stdout
    assert {d: files(runs / d) for d in ("H3", "H1")} == before

    assert compare_tool.main([str(runs)]) == 0
    table = capsys.readouterr().out
    doc = json.loads((runs / "compare" / "compare.json").read_text())
    assert [g["name"] for g in doc["groups"]] == ["H3", "H1"]
    md = (runs / "compare" / "compare.md").read_text()
    for run in doc["runs"]:
        rows = [
            json.loads(ln) for ln in Path(run["path"], "metrics.jsonl").read_text().splitlines()
        ]
        last = [r for r in rows if "eval_loss" in r][-1]
        loops = 3 if "H3" in run["path"] else 1
        logged = [last[f"eval_loss_loop_{t + 1}"] for t in range(loops)]
        assert run["final_loss_per_loop"] == logged and run["final_eval_step"] == 4
        assert " | ".join(f"{v:.4f}" for v in logged) in md
    assert (runs / "compare" / "loss_vs_tokens.png").stat().st_size > 10_000
    table = [ln for ln in table.splitlines() if ln.startswith("|")]
    assert table[0].startswith("| variant | runs (seeds) |") and table[3].startswith(
        "| H1 | 2 (0, 1) |"
    )
    print("\n".join(table))
