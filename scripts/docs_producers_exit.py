"""Producers of the depth-methods study of docs/studying_depth.md (issue 46): fixed H = 6 against
training past H and the learned exit, on the debug preset, three seeds each. The two studies and
their comparison, then the depth report of every run, summarised over the seeds (mean ± sample
standard deviation). The studies write under outputs/studies/ of the repository, as for a reader,
so a refresh after finished studies reuses their runs and only compares and reports.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from docs_context import Context, prose
from docs_producers_depth import shell
from docs_runner import Result, duration, machine
from docs_tour_figures import cpu_kind

FIXED = "outputs/studies/depth_h6_fixed"
METHODS = "outputs/studies/depth_h6_methods"
STUDY_FIXED = "python -m torchtitan_loom.tools.study train_configs/studies/depth_h6_fixed.toml"
STUDY_METHODS = "python -m torchtitan_loom.tools.study train_configs/studies/depth_h6_methods.toml"
COMPARE = (
    f"python -m torchtitan_loom.tools.compare {FIXED} {METHODS} --out /tmp/loom_h6_compare --force"
)
OUT = "/tmp/loom_h6_depth"
# Every run's depth report (loops 1..12 under the "last" policy, the one training past H uses);
# the learned-exit runs also sweep the head's thresholds (its default) and three KL thresholds
# (the zero-shot exit on the same LM).
_DEPTH = (
    "for run in {runs}; do python -m torchtitan_loom.tools.depth $run --beyond last {sweep} \\\n"
    "    --out " + OUT + "/${{run#outputs/studies/}} --force > /dev/null || exit 1; done"
)
DEPTH_FIXED = _DEPTH.format(
    runs=f"{FIXED}/*/seed-* {METHODS}/H6_past_H/seed-* {METHODS}/H6_all_12_loops/seed-*",
    sweep='--kl "" --confidence ""',
)
DEPTH_LEARNED = _DEPTH.format(
    runs=f"{METHODS}/H6_learned_exit/seed-*", sweep='--kl 0.01,0.03,0.1 --confidence ""'
)
VARIANTS = (  # (variant, study folder), in the order the tables show them
    ("H6", FIXED),
    ("H6_180_steps", FIXED),
    ("H6_past_H", METHODS),
    ("H6_all_12_loops", METHODS),
    ("H6_learned_exit", METHODS),
)
SEEDS = (0, 1, 2)
DEPTHS = (DEPTH_FIXED, DEPTH_LEARNED)
STUDY_TIMEOUT_S = 4 * 3600
H = 6


def _studies(ctx: Context) -> list[Result]:
    return [
        ctx.once(c, lambda c=c: ctx.runner.run(c, timeout_s=STUDY_TIMEOUT_S))
        for c in (STUDY_FIXED, STUDY_METHODS)
    ]


def _compare(ctx: Context) -> tuple[Result, dict]:
    _studies(ctx)
    res = ctx.run(COMPARE)
    return res, json.loads(
        (Path(ctx.runner.real("/tmp/loom_h6_compare")) / "compare.json").read_text()
    )


def _reports(ctx: Context) -> tuple[float, dict[str, list[dict]]]:
    """(wall seconds of the reports, {variant: [depth.json of each seed]})."""
    _studies(ctx)
    runs = [ctx.once(c, lambda c=c: ctx.runner.run(c, timeout_s=STUDY_TIMEOUT_S)) for c in DEPTHS]
    wall_s = sum(r.wall_s for r in runs)
    root = Path(ctx.runner.real(OUT))
    reports = {
        v: [
            json.loads((root / Path(folder).name / v / f"seed-{s}" / "depth.json").read_text())
            for s in SEEDS
        ]
        for v, folder in VARIANTS
    }
    return wall_s, reports


def _ms(values: list[float], fmt: str = "{:.4f}") -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{fmt.format(statistics.fmean(values))} ± {fmt.replace('+', '').format(sd)}"


def study_table(ctx: Context) -> str:
    studies = _studies(ctx)
    res, numbers = _compare(ctx)
    table = res.stdout.split("\n\nwritten:")[0]
    table = "\n".join(ln for ln in table.splitlines() if ln.startswith("|"))
    walls = [r["wall_s"] for r in numbers["runs"] if r.get("wall_s")]
    return (
        shell(STUDY_FIXED)
        + "\n\n"
        + shell(STUDY_METHODS)
        + "\n\n"
        + shell(COMPARE)
        + "\n\n"
        + table
        + "\n\n"
        + prose(
            "Mean ± sample standard deviation over the seeds; losses are the held-out loss after "
            "each loop at each run's last step (120, or 180 for H6_180_steps), as its own eval "
            f"logged it. The {len(walls)} runs took {duration(sum(walls))} of wall time summed "
            f"over the runs, on {cpu_kind()} ({machine()}); a rerun of the study commands skips "
            f"them ({duration(sum(s.wall_s for s in studies))} here)."
        )
    )


def past_h_table(ctx: Context) -> str:
    wall_s, reports = _reports(ctx)
    _, numbers = _compare(ctx)
    # compare names a group of two study folders "<study>/<variant>"
    fpt = {g["name"].rsplit("/", 1)[-1]: g["flops_per_token"] for g in numbers["groups"]}

    def loss(rep: dict, loops: int) -> float:
        return rep["fixed"]["last"][loops - 1]["loss"]

    lines = [
        "| variant | training FLOPs/token | loss after 3 | after 6 (H) | after 9 | after 12 (2H) "
        "| 2H against its own H |",
        "|---|---|---|---|---|---|---|",
    ]
    for v, _ in VARIANTS:
        reps = reports[v]
        rel = [100 * (loss(r, 2 * H) / loss(r, H) - 1) for r in reps]
        f = fpt.get(v)
        flops = f"{f['mean'] / 1e6:.1f}M" if f else "—"
        cells = [_ms([loss(r, t) for r in reps]) for t in (3, H, 9, 2 * H)]
        lines.append(f"| {v} | {flops} | " + " | ".join(cells) + f" | {_ms(rel, '{:+.1f}')}% |")
    return (
        shell(DEPTH_FIXED)
        + "\n\n"
        + shell(DEPTH_LEARNED)
        + "\n\n"
        + "\n".join(lines)
        + "\n\n"
        + prose(
            "Held-out loss (each run's eval slice, 50,000 tokens) after each number of loops, "
            "loops past 6 under router 6 (the `last` policy, the one training past H uses); mean "
            "± sample standard deviation over seeds 0, 1, 2; the last column is each run's loss "
            f"at 12 loops against its own at 6, in %. The {len(SEEDS) * len(VARIANTS)} reports "
            f"took {duration(wall_s)} on {machine()}."
        )
    )


def learned_table(ctx: Context) -> str:
    _, reports = _reports(ctx)
    reps = reports["H6_learned_exit"]
    points: dict[tuple[str, float], list[dict]] = {}
    for rep in reps:
        for a in rep["adaptive"]:
            points.setdefault((a["criterion"], a["threshold"]), []).append(a)
    lines = [
        "| exit | threshold | mean loops | loss | vs fixed curve, same loops | fixed loops, same "
        "loss | fewer loops than fixed, same loss |",
        "|---|---:|---|---|---|---|---|",
    ]
    for (criterion, threshold), pts in points.items():
        fewer = [p["fewer_loops_same_loss"] for p in pts]
        same = [p["fixed_loops_same_loss"] for p in pts]
        vs = [100 * (p["loss"] / p["curve_loss_at_loops"] - 1) for p in pts]
        lines.append(
            f"| {criterion} | {threshold:g} | {_ms([p['mean_loops'] for p in pts], '{:.2f}')} | "
            f"{_ms([p['loss'] for p in pts])} | {_ms(vs, '{:+.2f}')}% | "
            + (
                f"{_ms(same, '{:.2f}')} | {_ms([100 * x for x in fewer], '{:+.0f}')}% |"
                if None not in same
                else "— (worse than 1 loop in a seed) | — |"
            )
        )
    fixed = [
        "| loops | " + " | ".join(str(t) for t in range(1, H + 1)) + " |",
        "|---|" + "---|" * H,
        "| loss | "
        + " | ".join(
            _ms([r["fixed"]["last"][t - 1]["loss"] for r in reps]) for t in range(1, H + 1)
        )
        + " |",
    ]
    verdicts = "\n".join(f"- seed {s}: {r['verdict']['text']}." for s, r in zip(SEEDS, reps))
    return (
        "\n".join(fixed)
        + "\n\n"
        + "\n".join(lines)
        + "\n\n"
        + prose(
            "The learned-exit runs' fixed depths (first table) and adaptive points (second), "
            "mean ± sample standard deviation over seeds 0, 1, 2, from the reports above. An "
            "adaptive point's vs-curve figure is its loss against the fixed-depth line at its "
            "mean loops (+ worse); its fixed loops of the same loss are what the falling part of "
            "the fixed-depth curve needs for that loss, and the last column the share of them it "
            "does not run (the issue's goal: 25% or more at the best fixed depth's loss). Each "
            "seed's verdict:"
        )
        + "\n\n"
        + verdicts
    )
