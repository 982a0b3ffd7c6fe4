"""Where the tools write and what they say while they work: a line per phase and, in long loops,
one after the first batch and then every ~10 s (tools/progress.py); the first line of generate and
analyze before torch is imported."""

import io
import os
import re
import subprocess
import sys

import pytest
from test_tool_bad_input import analyze_args, dump, pristine  # noqa: F401  (fixtures)

from torchtitan_loom.tools import analyze as analyze_tool
from torchtitan_loom.tools import export as export_tool
from torchtitan_loom.tools.progress import Progress

TASKS_DIR = os.path.join(os.path.dirname(__file__), "..", "inference", "tiny_tasks")


def test_progress_prints_each_phase_and_ticks_at_most_every_interval():
    now = [100.0]
    stream = io.StringIO()
    p = Progress("tool", stream=stream, every_s=10.0, clock=lambda: now[0])
    p.phase("loading")
    for t in (101.0, 105.0, 110.9, 111.0, 112.0):
        now[0] = t
        p.tick(lambda: f"at {now[0]:g}")
    p.phase("writing")
    p.tick("first of the next loop")
    assert stream.getvalue().splitlines() == [
        "tool: loading (0 s) ...",
        "tool: at 101 (1 s)",  # the first step: says how long one takes
        "tool: at 111 (11 s)",  # then not before 10 s have passed
        "tool: writing (12 s) ...",
        "tool: first of the next loop (12 s)",
    ]


def test_counts_take_the_plural_their_noun_needs():
    from torchtitan_loom.components.runtime.messages import count

    assert [count(1, "batch"), count(3, "batch"), count(2, "rank"), count(0, "pass")] == [
        "1 batch",
        "3 batches",
        "2 ranks",
        "0 passes",
    ]
    assert count(2, "micro-batch", "micro-batches") == "2 micro-batches"
    assert count(1_200, "run folder") == "1,200 run folders"


def test_analyze_says_where_it_is_between_loading_and_the_report(dump, tmp_path, capsys):
    assert analyze_tool.main([str(dump), "--out", str(tmp_path / "r"), *analyze_args()]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"analyze: loading {dump}, then routing 200 held-out tokens")
    # The count it routes is said once loaded: --tokens rounded up to whole batches, and the
    # progress and the report count the same tokens.
    m = re.match(r"analyze: step 2 loaded; routing ([\d,]+) held-out tokens of ", lines[1])
    assert m and "rows, --tokens 200 rounded up to whole batches" in lines[1], lines[1]
    reads = int(m[1].replace(",", ""))
    assert reads >= 200
    assert any(
        ln.startswith("analyze: ") and f" of {reads:,} held-out tokens routed (1 batch)" in ln
        for ln in lines[2:-2]
    ), lines
    assert f"{reads:,} tokens with a target" in (tmp_path / "r" / "report.md").read_text()
    assert lines[-2].startswith(f"analyze: writing the report and its figures to {tmp_path / 'r'}")
    assert lines[-1] == f"report written: {tmp_path / 'r' / 'report.md'}"


@pytest.mark.parametrize("tool", ["generate", "analyze", "depth", "study", "compare"])
def test_the_first_line_comes_before_torch_is_imported(tool):
    """The tool's module imports no torch, so its first line is printed before that wait (tens of
    seconds on a cold file system); the line itself is checked by the tools' own tests."""
    code = f"import sys; import torchtitan_loom.tools.{tool}; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_export_announces_the_read_before_verifying_checksums(dump, tmp_path, capsys):
    assert export_tool.main([str(dump), str(tmp_path / "e"), "--verify"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"export: reading the model of {dump} ..."
    assert lines[2].startswith("export: verifying ") and lines[3].startswith("verified: 28 ")


def test_lm_eval_says_where_it_is_in_each_phase(dump, tmp_path, capsys):
    pytest.importorskip("lm_eval")
    from torchtitan_loom.tools import lm_eval as eval_tool

    argv = [str(dump), "--tasks", "loom_tiny_mc", "--tasks-dir", TASKS_DIR, "--only-tasks-dir"]
    argv += ["--holdout-check", "record", "--out", str(tmp_path / "results")]
    assert eval_tool.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    phases = [ln.split(" (")[0] for ln in lines if ln.startswith("lm_eval: ")]
    assert phases[:3] == [
        f"lm_eval: loading lm-eval, then the checkpoint {dump} ...",
        "lm_eval: step 2 loaded; indexing the lm-eval tasks",
        "lm_eval: holdout check: recomputing the held-out loss of step 2",
    ], lines
    # After the first batch of each loop, with a count.
    assert re.fullmatch(r"lm_eval: holdout check: [\d,]+ held-out tokens read", phases[3]), lines
    scoring = phases.index("lm_eval: scoring loom_tiny_mc")
    assert phases[scoring + 1] == "lm_eval: scoring: 1 batch of up to 8 scored", lines


def test_the_gradient_figure_draws_nothing_outside_its_canvas():
    """Issue 35: the colour-bar label of diag_grad_norm.png was cut off (long submodule names, few
    diagnostic steps). Every artist's extent must lie inside the figure."""
    import numpy as np

    from torchtitan_loom.tools.analyze_diag import grad_figure

    names = [
        f"layers.{layer}.{m}"
        for layer in range(2)
        for m in ("attention.wq", "moe.shared_experts.w13", "moe.router.0", "attention_norm")
    ] + ["tok_embeddings", "output", "moe_out_norm.weight.something"]
    rng = np.random.default_rng(0)
    for steps in [(10,), (10, 20, 30), tuple(range(10, 300, 10))]:
        fig = grad_figure({s: {n: float(rng.random()) for n in names} for s in steps})
        fig.canvas.draw()
        drawn, canvas = fig.get_tightbbox(fig.canvas.get_renderer()), fig.bbox_inches
        assert drawn.x0 >= 0 and drawn.y0 >= 0, (steps, drawn)
        assert drawn.x1 <= canvas.x1 and drawn.y1 <= canvas.y1, (steps, drawn, canvas)
