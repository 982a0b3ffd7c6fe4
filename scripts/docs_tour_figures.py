"""The README tour's figures on every CPU kind they were recorded on, and how a run is compared
with them (tests/unit/test_docs_tour.py; scripts/docs_producers_runs.py records them).

The tour is bit-identical from run to run on one machine, but another x86-64 CPU kind rounds some
kernels differently (MKL and oneDNN pick their code paths by CPU, ATen by instruction set). The
two kinds measured so far agree at step 10 to 1e-4 relative in the loss and exactly in the
segment losses and gradient norm; the gap then grows through flipped routing choices to ~0.3% at
step 60 and ~0.8% at step 180 — as large as a real change of the math (the SwiGLU change of wave
27 moved step 60 by 0.8%). So:

- on a CPU kind recorded in docs/tour_figures.json, the run must reproduce that kind's figures
  exactly (every figure of the run, not only the excerpt's);
- on any other kind, the early horizon (step <= EARLY_STEP) must agree within EARLY_RTOL (or 1.5
  units of the last printed digit), the counts and the lr exactly, and later figures within
  LATE_RTOL (losses; measured 0.8%) or LATE_GNORM_RTOL (gradient norms, which follow the routing
  choices: measured 7.6% at step 60), bounds that only catch gross breakage. A 1% change of the
  init moves the tour's step-10 gradient norm from 0.972 to 0.964, past its early bound, where two
  CPU kinds print the same value (test_docs_tour.py checks that on a perturbed run).

A kind is named by scripts/docs_machine.py (cpu_kind): vendor, family, model, vector extension
and torch version (which changes kernels too).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from docs_machine import cpu_kind, without_made_line

ROOT = Path(__file__).resolve().parent.parent
KINDS_FILE = ROOT / "docs" / "tour_figures.json"
EARLY_STEP = 10
EARLY_RTOL = 3e-4
LATE_RTOL = 0.02
LATE_GNORM_RTOL = 0.2
ANALYSIS_RTOL = 0.25

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


def differences(want: dict[str, str], ran: dict[str, str]) -> list[str]:
    """Exact: one line per figure of `want` that `ran` does not show the same."""
    return [
        f"{key}: docs {value}, run {ran.get(key, '(not printed)')}"
        for key, value in want.items()
        if ran.get(key) != value
    ]


def _numbers(text: str) -> list[tuple[float, float]]:
    """(value, unit of its last printed digit) of every decimal number in a figure's text."""
    out = []
    for tok in re.findall(r"-?\d[\d,]*(?:\.\d+)?(?:e[+-]?\d+)?", text):
        mantissa, _, exp = tok.replace(",", "").partition("e")
        decimals = len(mantissa.partition(".")[2])
        out.append((float(tok.replace(",", "")), 10.0 ** (-decimals + int(exp or 0))))
    return out


def _step(key: str) -> int | None:
    m = re.match(r"(?:step|eval) (\d+) ", key)
    return int(m[1]) if m else None


def cross_kind_differences(want: dict[str, str], ran: dict[str, str]) -> list[str]:
    """The comparison for a CPU kind without recorded figures (see the module): one line per
    figure of `want` outside its bound."""
    out = []
    for key, value in want.items():
        got = ran.get(key)
        if got is None:
            out.append(f"{key}: docs {value}, run (not printed)")
            continue
        step = _step(key)
        exact = key.endswith((" lr", "holdout tokens")) or key == "parameters"
        a, b = _numbers(value), _numbers(got)
        if key == "done":  # its step counts exactly, its losses like any late figure
            exact = value.split(":")[0] != got.split(":")[0]
            a, b = _numbers(value.split(":")[1]), _numbers(got.split(":")[1])
            step = None
        if exact or len(a) != len(b):
            ok = value == got
        elif step is not None and step <= EARLY_STEP:
            ok = all(
                abs(x - y) <= max(EARLY_RTOL * abs(x), 1.5 * u) for (x, u), (y, _) in zip(a, b)
            )
        else:
            rtol = LATE_GNORM_RTOL if key.endswith(" gnorm") else LATE_RTOL
            ok = all(abs(x - y) <= rtol * abs(x) for (x, _), (y, _) in zip(a, b))
        if not ok:
            bound = "exactly" if exact else "early" if step and step <= EARLY_STEP else "late"
            out.append(f"{key}: docs {value}, run {got} ({bound} bound)")
    return out


def analysis_differences(want: str, got: str) -> list[str]:
    """The analysis tables on a CPU kind without recorded ones: the same lines with the same words,
    every number within ANALYSIS_RTOL. Routing statistics follow discrete choices, and the two kinds
    measured differ by up to 10% in a max/mean load after 180 steps: this catches a changed table,
    not a changed model (the tour's figures do that)."""
    out = []
    a_lines, b_lines = want.splitlines(), got.splitlines()
    if len(a_lines) != len(b_lines):
        return [f"{len(a_lines)} lines in the docs, {len(b_lines)} in the run"]
    number = r"-?\d[\d,]*(?:\.\d+)?%?"
    for a, b in zip(a_lines, b_lines):
        same_words = re.sub(number, "#", a) == re.sub(number, "#", b)
        pairs = zip(_numbers(a), _numbers(b))
        if not same_words or any(
            abs(x - y) > ANALYSIS_RTOL * max(abs(x), 0.05) for (x, _), (y, _) in pairs
        ):
            out.append(f"docs: {a}\n    run:  {b}")
    return out


def recorded(path: Path = KINDS_FILE) -> list[dict]:
    """The recorded kinds: [{kind, figures, analysis}], kind None for figures whose machine was not
    recorded (kept for the cross-kind comparison only)."""
    return json.loads(path.read_text())["kinds"] if path.is_file() else []


def record(
    kind: str,
    *,
    figures: dict | None = None,
    analysis: str | None = None,
    keep_others: bool = False,
    path: Path = KINDS_FILE,
) -> None:
    """Store this kind's figures (or analysis text). New figures that differ from what this kind
    had mean the math changed: every other kind's entry is dropped (it would be stale); new
    figures on a kind never recorded cannot tell, and drop them too, unless ``keep_others`` (the
    `record` command, which checks first that the run is within the cross-kind bounds)."""
    kinds = recorded(path)
    mine = next((k for k in kinds if k["kind"] == kind), None)
    if figures is not None and not keep_others and (mine is None or mine["figures"] != figures):
        kinds = [mine] if mine else []
    if mine is None or mine not in kinds:
        mine = {"kind": kind, "figures": {}, "analysis": None}
        kinds.append(mine)
    if figures is not None:
        mine["figures"] = figures
    if analysis is not None:
        mine["analysis"] = analysis
    note = "Written by scripts/refresh_docs.py (default-run-console, analysis-tables); see scripts/docs_tour_figures.py."
    path.write_text(
        json.dumps({"about": note, "kinds": kinds}, indent=1, ensure_ascii=False) + "\n"
    )


def main(argv: list[str]) -> int:
    """``python scripts/docs_tour_figures.py record``: run the README tour's command and its
    analysis on this machine (about 4 min of CPU) and add this CPU kind to docs/tour_figures.json,
    keeping the others, after checking the run against the README within the cross-kind bounds (a
    run outside them means the math changed: refresh the README instead)."""
    if argv != ["record"]:
        print(main.__doc__)
        return 2
    import tempfile

    from docs_context import Context
    from docs_producers_runs import analysis_text
    from docs_regions import all_regions, displayed_commands
    from docs_runner import Runner

    regions = {r.name: r for r in all_regions()}
    excerpt = regions["default-run-console"].body
    (command,) = displayed_commands(excerpt)
    threads = re.search(r"\((\d+) CPU threads?", excerpt)[1]
    os.environ["OMP_NUM_THREADS"] = threads
    kind = cpu_kind()
    print(f"recording the tour's figures for {kind}: {command} (OMP_NUM_THREADS={threads}) ...")
    with tempfile.TemporaryDirectory() as work:
        ctx = Context(Runner(Path(work)))
        ran = figures(ctx.run(command).console)
        diff = cross_kind_differences(figures(excerpt), ran)
        if diff:
            print("the run is outside the cross-kind bounds (refresh the README instead):")
            print("\n".join("  " + d for d in diff))
            return 1
        body, _ = analysis_text(ctx)
    record(kind, figures=ran, analysis=after_console(body), keep_others=True)
    print(f"recorded in {KINDS_FILE.relative_to(ROOT)}")
    return 0


def after_console(text: str) -> str:
    """A region's text after its console block: the tables and figures derived from a run (its
    machine line left out: scripts/docs_machine.py)."""
    return without_made_line(text.strip("\n")).split("\n```\n", 1)[1].strip("\n")


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
