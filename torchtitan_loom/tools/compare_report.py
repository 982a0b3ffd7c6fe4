"""tools.compare's output: the markdown tables (per group and per run), compare.md with them and
the figures, compare.json with every number, and the two figures (held-out loss after the last
loop against training tokens and against training FLOPs = tokens × FLOPs per token: each group's
seed mean, its seeds faint). Every file goes through tools/out_files.py (never through a link).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from torchtitan_loom.tools.compare_diff import changes, changes_table
from torchtitan_loom.tools.compare_runs import Group, RunSummary, group_numbers, run_numbers
from torchtitan_loom.tools.out_files import write_figure, write_file

FIGURES = ("loss_vs_tokens.png", "loss_vs_flops.png")
NAMES = frozenset({"compare.md", "compare.json", *FIGURES})  # what --force may replace
DPI = 100
FIGURE_SIZE_IN = (7.0, 4.5)
SPREAD = (
    "± is the sample standard deviation over the seeds (n − 1 in the denominator); a group of "
    "one run has no ±. Only finished runs enter a group's numbers."
)
DEFINITIONS = (
    "tokens: tokens trained on with a target (metrics tokens_seen); FLOPs/token: training FLOPs "
    "per token as the trainer counts them (its tflops ÷ tokens/s); train time: the logged steps' "
    "time from the metrics' tokens/s (evals and start-up not counted); wall time: the study's "
    "launches of the run (known for runs of a study); params / active params: the model built "
    "from the run's config.toml on the meta device; loss after loop t: the last held-out eval."
)


def count(n: float | None) -> str:
    """1,251,584 → 1.25M; None → —."""
    if n is None:
        return "—"
    for unit, size in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.3g}"


def duration(s: float | None) -> str:
    if s is None:
        return "—"
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.2f} h"


def spread(ms: dict[str, Any] | None, fmt: Callable[[float], str]) -> str:
    """``mean ± std`` (``mean`` alone for one run, — for none)."""
    if ms is None:
        return "—"
    return fmt(ms["mean"]) + (f" ± {fmt(ms['std'])}" if ms["std"] is not None else "")


def loss(v: float) -> str:
    return f"{v:.4f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def group_table(numbers: list[dict[str, Any]]) -> list[str]:
    loops = max((len(g["final_loss_per_loop"]) for g in numbers), default=0)
    tasks = sorted({k for g in numbers for k in g["scores"]})
    header = ["variant", "runs (seeds)", "params", "active params", "FLOPs/token", "tokens"]
    header += ["train time", "wall time", *(f"loss after loop {t + 1}" for t in range(loops))]
    rows = []
    for g in numbers:
        left_out = len(g["runs"]) - len(g["used"])
        runs = f"{len(g['used'])} ({', '.join(str(s) for s in g['seeds'])})"
        runs += f" + {left_out} unfinished" if left_out else ""
        per_loop = g["final_loss_per_loop"] + [None] * (loops - len(g["final_loss_per_loop"]))
        rows.append(
            [
                g["name"],
                runs,
                count(g["params"]),
                count(g["active_params"]),
                count(g["flops_per_token"]["mean"]) if g["flops_per_token"] else "—",
                spread(g["tokens"], count),
                spread(g["train_s"], duration),
                spread(g["wall_s"], duration),
                *(spread(ms, loss) for ms in per_loop),
                *(spread(g["scores"].get(k), loss) for k in tasks),
            ]
        )
    return _table(header + tasks, rows)


def run_table(runs: list[RunSummary]) -> list[str]:
    loops = max((len(r.final_losses or []) for r in runs), default=0)
    tasks = sorted({k for r in runs for k in r.scores})
    names = run_names(runs)
    header = ["run", "variant", "seed", "status", "eval step", "tokens", "train time"]
    header += ["wall time", *(f"loss after loop {t + 1}" for t in range(loops)), *tasks]
    rows = []
    for r, name in zip(runs, names):
        final = (r.final_losses or []) + [None] * (loops - len(r.final_losses or []))
        rows.append(
            [
                name,
                r.group,
                "—" if r.seed is None else str(r.seed),
                f"{r.status} (step {r.step})",
                str(r.evals[-1].step) if r.evals else "—",
                count(r.tokens),
                duration(r.train_s),
                duration(r.wall_s),
                *("—" if v is None else loss(v) for v in final),
                *(loss(r.scores[k]) if k in r.scores else "—" for k in tasks),
            ]
        )
    return _table(header, rows)


def run_names(runs: list[RunSummary]) -> list[str]:
    """Each run folder relative to the folder all of them are in."""
    paths = [os.path.abspath(r.path) for r in runs]
    if len(paths) == 1:
        return [os.path.basename(paths[0])]
    common = os.path.commonpath(paths)
    return [os.path.relpath(p, common) for p in paths]


def _curves(
    g: Group, flops: bool
) -> tuple[list[tuple[list[float], list[float]]], tuple[list[float], list[float]]]:
    """The seeds' (x, last-loop loss) lines and their mean at the eval steps all of them have."""
    runs = g.used or g.runs

    def x(r: RunSummary, tokens: float) -> float:
        if not flops:
            return tokens
        return tokens * r.flops_per_token if r.flops_per_token else float("nan")  # not drawn

    lines = [([x(r, e.tokens) for e in r.evals], [e.losses[-1] for e in r.evals]) for r in runs]
    common = set.intersection(*({e.step for e in r.evals} for r in runs)) if runs else set()
    mean_x, mean_y = [], []
    for step in sorted(common):
        pts = [next(e for e in r.evals if e.step == step) for r in runs]
        mean_x.append(sum(x(r, e.tokens) for r, e in zip(runs, pts)) / len(pts))
        mean_y.append(sum(e.losses[-1] for e in pts) / len(pts))
    return lines, (mean_x, mean_y)


def loss_figure(groups: list[Group], flops: bool) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGURE_SIZE_IN, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colors = [f"C{i % 10}" for i in range(len(groups))]
    for g, color in zip(groups, colors):
        lines, (mx, my) = _curves(g, flops)
        for xs, ys in lines:
            ax.plot(xs, ys, color=color, alpha=0.3, linewidth=1)
        n = len(g.used or g.runs)
        ax.plot(
            mx,
            my,
            color=color,
            marker="o",
            linewidth=2,
            label=f"{g.name} (mean of {n} seed{'s' * (n > 1)})",
        )
    what = (
        "training FLOPs (tokens × FLOPs per token)" if flops else "training tokens (with a target)"
    )
    ax.set_title(f"Held-out loss after the last loop vs {what.split(' (')[0]}")
    ax.set_xlabel(what)
    ax.set_ylabel("held-out loss after the last loop")
    ax.grid(alpha=0.3)
    if groups:
        ax.legend(fontsize="small")
    return fig


def write_outputs(
    out: str, inputs: list[str], groups: list[Group], runs: list[RunSummary], notes: list[str]
) -> str:
    """compare.md, compare.json and the figures into ``out`` (which exists); the console table."""
    numbers = [group_numbers(g) for g in groups]
    table = group_table(numbers)
    diff = changes(groups)  # once: each group against the first
    changed = changes_table(groups, diff)
    table += ["", *changed] if changed else []
    for g in numbers:
        g["changes"] = {k: v for k, (v, _) in diff.get(g["name"], {}).items()}
    md = [
        f"# Comparison of {len(runs)} runs in {len(groups)} groups",
        "",
        f"Inputs: {', '.join(f'`{p}`' for p in inputs)}",
        "",
        "## Groups",
        "",
        *table,
        "",
        SPREAD,
        "",
        DEFINITIONS,
        "",
        "## Runs",
        "",
        *run_table(runs),
        "",
        "## Held-out loss against training tokens and FLOPs",
        "",
        "Each group's mean over its seeds (at the eval steps all of them reached); its seeds "
        "faint.",
        "",
        *(f"![{name[:-4].replace('_', ' ')}]({name})" for name in FIGURES),
        "",
    ]
    md += ["## Notes", "", *(f"- {n}" for n in notes), ""] if notes else []
    for name, flops in zip(FIGURES, (False, True)):
        write_figure(loss_figure(groups, flops), os.path.join(out, name), out, DPI)
    doc = {
        "inputs": inputs,
        "spread": SPREAD,
        "definitions": DEFINITIONS,
        "groups": numbers,
        "runs": [run_numbers(r) for r in runs],
        "notes": notes,
        "figures": list(FIGURES),
    }
    write_file(os.path.join(out, "compare.json"), json.dumps(doc, indent=2) + "\n", out)
    write_file(os.path.join(out, "compare.md"), "\n".join(md), out)
    return "\n".join(table)
