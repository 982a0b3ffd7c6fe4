"""The README's tour excerpt is what its command prints: CI reruns the excerpt's exact command (the
default run with checkpoints, about 4 min of CPU) and fails when any figure of a run's progress in
the excerpt (a step line's loss, segment losses, lr, gradient norm and eval loss, an eval's loss
after every loop, the final line's, the parameter counts) differs from the run's. The tables and
figures of that run's analysis in docs/inside_the_loops.md (tools.analyze on its checkpoint) are
compared whole.

The run is deterministic (bit-identical from run to run) at a fixed intra-op thread count, and the
thread count changes the reduction order, so the rerun uses the count the excerpt's first line
shows. Timings, throughput and memory differ run to run and are not compared; fields a step line
gains (``step 10/180``, an ETA) do not matter, only the figures the excerpt shows.
"""

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from docs_context import Context  # noqa: E402
from docs_producers_runs import analysis_text  # noqa: E402
from docs_regions import all_regions, displayed_commands  # noqa: E402
from docs_runner import Runner  # noqa: E402

REGION = "default-run-console"
STEP_RE = re.compile(r"\] step +(\d+)(?:/\d+)?\b")
STEP_FIELDS = ("loss", "seg", "lr", "gnorm", "eval")
NUMBER = r"(-?\d[\d.,e+-]*(?:/-?\d[\d.e+-]*)*)"  # 1.3116, 3.00e-03, 2.768/2.717/2.797
LOOPS = r"loss after loop (\d[\d. /]*\d)"


def figures(console: str) -> dict[str, str]:
    """Every figure of a run's progress in a console text, by what it is ('step 60 loss')."""
    out: dict[str, str] = {}
    at = None  # the step of the eval in progress
    for line in console.splitlines():
        if m := STEP_RE.search(line):
            fields = line[m.end() :]
            for name in STEP_FIELDS:
                if f := re.search(rf"(?:^|[\s|]){name} {NUMBER}(?=[\s|]|$)", fields):
                    out[f"step {m[1]} {name}"] = f[1]
        elif m := re.search(r"\] eval at step (\d+): ([\d,]+) holdout tokens", line):
            at = m[1]
            out[f"eval {at} holdout tokens"] = m[2]
        elif "] eval done" in line and (m := re.search(LOOPS, line)):
            out[f"eval {at} loss after loop"] = m[1]
        elif m := re.search(r"\] done: (\d+) steps.*last eval \(step (\d+)\) " + LOOPS, line):
            out["done"] = f"{m[1]} steps, last eval at {m[2]}: {m[3]}"
        elif m := re.search(r"\] model \S+: ([\d,]+) parameters \(([\d,]+) active", line):
            out["parameters"] = f"{m[1]} ({m[2]} active)"
    return out


def differences(excerpt: str, console: str) -> list[str]:
    """One line per figure of the excerpt that the console does not show the same."""
    ran = figures(console)
    return [
        f"{key}: README {want}, run {ran.get(key, '(not printed)')}"
        for key, want in figures(excerpt).items()
        if ran.get(key) != want
    ]


EXCERPT = """\
[torchtitan_loom] model loom/debug: 1,251,584 parameters (657,664 active per token), H=3
[torchtitan_loom] step     10 | loss 2.7973 | seg 2.768/2.717/2.797 | lr 3.00e-03 | gnorm 0.972 | 2,201 tok/s
...
[torchtitan_loom] eval at step 60: 51,824 holdout tokens, 3 loops ...
[torchtitan_loom] eval done in 12.4 s (4,188 tokens/s): loss after loop 1.2810 / 1.2131 / 1.2213
[torchtitan_loom] step     60 | loss 1.3116 | seg 1.391/1.321/1.312 | lr 3.00e-03 | gnorm 0.326 | mem 0.55 GiB | eval 1.2213
[torchtitan_loom] done: 60 steps, exit code 0; outputs in /tmp/x; last eval (step 60) loss after loop 1.2810 / 1.2131 / 1.2213
"""


def test_figures_are_compared_whatever_else_the_lines_show():
    found = figures(EXCERPT)
    assert found == {
        "parameters": "1,251,584 (657,664 active)",
        "step 10 loss": "2.7973",
        "step 10 seg": "2.768/2.717/2.797",
        "step 10 lr": "3.00e-03",
        "step 10 gnorm": "0.972",
        "eval 60 holdout tokens": "51,824",
        "eval 60 loss after loop": "1.2810 / 1.2131 / 1.2213",
        "step 60 loss": "1.3116",
        "step 60 seg": "1.391/1.321/1.312",
        "step 60 lr": "3.00e-03",
        "step 60 gnorm": "0.326",
        "step 60 eval": "1.2213",
        "done": "60 steps, last eval at 60: 1.2810 / 1.2131 / 1.2213",
    }
    # Another run's timings, a total and an ETA on the step lines, more steps: the same figures.
    later = (
        EXCERPT.replace("step     10 |", "step  10/60 | eta 1m 10s |")
        .replace("12.4 s (4,188", "3.0 s (17,000")
        .replace("2,201 tok/s", "9,999 tok/s | eta 50s")
        .replace("step     60 |", "step  60/60 |")
    )
    later += "[torchtitan_loom] step     20 | loss 2.1 | seg 2.2/2.1/2.0\n"
    assert differences(EXCERPT, later) == []
    # A changed loss, segment loss or loop loss, and a step the run never printed, are each named.
    drifted = (
        EXCERPT.replace("loss 1.3116", "loss 1.3112")
        .replace("1.391/1.321", "1.391/1.320")
        .replace("after loop 1.2810 / 1.2131 / 1.2213\n[", "after loop 1.2810 / 1.2131 / 1.2214\n[")
        .replace("step     10 |", "step     11 |")
    )
    assert differences(EXCERPT, drifted) == [
        "step 10 loss: README 2.7973, run (not printed)",
        "step 10 seg: README 2.768/2.717/2.797, run (not printed)",
        "step 10 lr: README 3.00e-03, run (not printed)",
        "step 10 gnorm: README 0.972, run (not printed)",
        "eval 60 loss after loop: README 1.2810 / 1.2131 / 1.2213, run 1.2810 / 1.2131 / 1.2214",
        "step 60 loss: README 1.3116, run 1.3112",
        "step 60 seg: README 1.391/1.321/1.312, run 1.391/1.320/1.312",
    ]


@pytest.fixture(scope="module")
def tour(tmp_path_factory):
    """The README tour's command, run once as its excerpt shows it: (excerpt, command, result,
    threads, the context that ran it)."""
    region = next(r for r in all_regions() if r.name == REGION)
    (command,) = displayed_commands(region.body)
    threads = re.search(r"\((\d+) CPU threads", region.body)
    assert threads, "README.md: the tour excerpt's first line no longer names its thread count"
    ctx = Context(Runner(tmp_path_factory.mktemp("tour"), log=lambda msg: None))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", threads[1])
        result = ctx.runner.run(command, timeout_s=1500)
        ctx.cache[command] = result  # the analysis below reads this run
        yield region.body, command, result, threads[1], ctx


def test_the_readme_tour_excerpt_is_what_its_command_prints(tour):
    excerpt, command, result, threads, _ = tour
    shown = figures(excerpt)
    assert len(shown) >= 15 and "done" in shown, f"README.md: the tour excerpt shows {shown}"
    diff = differences(excerpt, result.console)
    assert diff == [], (
        f"README.md: the tour excerpt ({len(diff)} of {len(shown)} figures) differs from what "
        f"`{command}` prints with OMP_NUM_THREADS={threads}:\n  "
        + "\n  ".join(diff)
        + f"\nrefresh it: OMP_NUM_THREADS=1 python scripts/refresh_docs.py --only {REGION}"
    )


def _after_console(text: str) -> str:
    """A region's text after its console block: the figures and tables derived from the run, not
    the lines a tool prints while it works."""
    return text.strip("\n").split("\n```\n", 1)[1].strip("\n")


def test_the_analysis_of_the_tour_run_is_what_the_docs_show(tour):
    """docs/inside_the_loops.md analyses the tour's run (tools.analyze on its checkpoint, a few
    seconds): its tables and figures are deterministic given the run, so they are compared whole
    (the tool's progress lines are not)."""
    *_, ctx = tour
    assert ctx.cache  # the run is there: the producer reuses it instead of training again
    region = next(r for r in all_regions() if r.name == "analysis-tables")
    body, heatmap = analysis_text(ctx)
    assert heatmap.is_file()
    shown, now = (_after_console(t) for t in (region.body, body))
    assert "| layer |" in shown and "| loop |" in shown, f"{region.path}: {shown}"
    assert shown == now, (
        f"{region.path}: region 'analysis-tables' differs from the analysis of the tour's run; "
        "refresh it: OMP_NUM_THREADS=1 python scripts/refresh_docs.py --only analysis-tables"
    )
