"""The branch diagnostics of a run over training, for tools.analyze's report: for each statistic a
row of layer × loop heatmaps at up to four diagnostic steps (first to last, one colour scale),
and the per-submodule gradient norms per diagnostic step. Read from the run's metrics.jsonl
(keys of components/observability/diagnostics.py); a step logged twice (a resumed run that went back) counts
with its last row.

Legend: L layers, H loops, P panels (steps shown), G parameter groups × segments, T diagnostic steps.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Literal

import numpy as np

from torchtitan_loom.tools.input_files import metrics_rows
from torchtitan_loom.tools.out_files import write_figure

PANELS = 4
_BRANCH_KEY = re.compile(r"^diag/([^/]+)/([^/]+)/layer_(\d+)/loop_(\d+)$")
_GRAD_KEY = re.compile(r"^diag/grad_norm/(.+)/segment_(\d+)$")
TITLES = {
    "norm": "mean token L2 norm",
    "var": "element variance",
    "erank": "effective rank (64 rows)",
    "top_sv": "top singular value share",
    "cos": "mean pairwise cosine",
}


def read_diagnostics(metrics_path: str) -> dict[str, Any]:
    """{"branch": {(branch, stat): {step: array [L, H]}}, "grad": {step: {"group/segment_j": norm}}}."""
    rows: dict[int, dict[str, Any]] = {}
    # A damaged line (cut by a crash, edited) is skipped with one warning: the rest still reads.
    for row in metrics_rows(metrics_path):
        diag = {k: v for k, v in row.items() if k.startswith("diag/")}
        if diag:
            rows[row["step"]] = diag
    branch: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    grad: dict[int, dict[str, float]] = {}
    for step, diag in sorted(rows.items()):
        cells: dict[tuple[str, str], dict[tuple[int, int], float]] = {}
        for key, value in diag.items():
            if m := _BRANCH_KEY.match(key):
                cells.setdefault((m[1], m[2]), {})[(int(m[3]), int(m[4]) - 1)] = (
                    math.nan if value is None else value
                )
            elif (m := _GRAD_KEY.match(key)) and value is not None:
                grad.setdefault(step, {})[f"{m[1]} (segment {m[2]})"] = value
        for name, by_cell in cells.items():
            L = 1 + max(l for l, _ in by_cell)
            H = 1 + max(t for _, t in by_cell)
            grid_LH = np.full((L, H), math.nan)
            for (l, t), v in by_cell.items():
                grid_LH[l, t] = v
            branch.setdefault(name, {})[step] = grid_LH
    return {"branch": branch, "grad": grad}


def _figure(
    width_in: float,
    height_in: float,
    layout: Literal["constrained", "compressed", "tight"] | None = None,
):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_in, height_in), dpi=100, layout=layout)
    FigureCanvasAgg(fig)
    return fig


def stat_figure(by_step: dict[int, np.ndarray], title: str):
    """Up to PANELS layer × loop heatmaps, first to last diagnostic step, one colour scale."""
    steps = sorted(by_step)
    shown = [
        steps[round(i * (len(steps) - 1) / max(PANELS - 1, 1))]
        for i in range(min(PANELS, len(steps)))
    ]
    shown = sorted(set(shown))
    grids = [by_step[s] for s in shown]
    finite = np.concatenate([g[np.isfinite(g)] for g in grids]) if grids else np.array([])
    vmin, vmax = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    fig = _figure(2.6 * len(shown) + 1.2, 3.4)
    axes = [fig.add_subplot(1, len(shown), i + 1) for i in range(len(shown))]
    image = None
    for ax, step, grid_LH in zip(axes, shown, grids):
        image = ax.imshow(
            grid_LH, aspect="auto", cmap="viridis", vmin=vmin, vmax=vmax, interpolation="nearest"
        )
        ax.set_title(f"step {step}", fontsize=9)
        ax.set_xlabel("loop")
        ax.set_xticks(range(grid_LH.shape[1]), [str(t + 1) for t in range(grid_LH.shape[1])])
        ax.set_yticks(range(grid_LH.shape[0]))
    axes[0].set_ylabel("layer")
    fig.suptitle(title, fontsize=10)
    fig.subplots_adjust(
        top=0.8, bottom=0.17, left=0.06, right=0.9
    )  # room for the titles and axis labels
    fig.colorbar(image, ax=axes, label=title.split(": ", 1)[-1])
    return fig


def grad_figure(grad: dict[int, dict[str, float]]):
    """Submodule gradient norms (rows) per diagnostic step (columns), log colour scale."""
    steps = sorted(grad)
    names = sorted({n for by_name in grad.values() for n in by_name})
    grid_GT = np.array([[grad[s].get(n, math.nan) for s in steps] for n in names])
    # Wide enough for the longest name (7 pt ≈ 0.06 in a character), the cells, the colour bar
    # and its label: a narrow figure cut the label and the title off.
    longest = max((len(n) for n in names), default=0)
    fig = _figure(
        max(5.0, 0.5 * len(steps) + 2.6 + 0.06 * longest),
        max(2.5, 0.25 * len(names) + 1.2),
        layout="constrained",  # lays the colour bar and its label out too
    )
    ax = fig.add_subplot(1, 1, 1)
    image = ax.imshow(
        np.log10(np.clip(grid_GT, 1e-12, None)),
        aspect="auto",
        cmap="viridis",
        interpolation="nearest",
    )
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.set_xticks(range(len(steps)), [str(s) for s in steps], fontsize=7, rotation=90)
    ax.set_xlabel("step")
    ax.set_title("gradient norm per submodule (before clipping)", fontsize=10)
    fig.colorbar(image, ax=ax, label="log10 norm")
    return fig


def report_section(metrics_path: str, out: str) -> list[str]:
    """Markdown lines (figures written under `out`); [] when the run logged no diagnostics."""
    if not os.path.isfile(metrics_path):
        return []
    data = read_diagnostics(metrics_path)
    if not data["branch"] and not data["grad"]:
        return []
    lines = [
        "## Branch diagnostics over training",
        "",
        f"From `{metrics_path}` (metrics.diag_interval). Each panel is one diagnostic step; rows are "
        "layers, columns loops. Definitions: docs/inside_the_loops.md.",
        "",
    ]
    for (branch, stat), by_step in sorted(data["branch"].items()):
        name = f"diag_{branch}_{stat}.png"
        fig = stat_figure(by_step, f"{branch} output: {TITLES.get(stat, stat)}")
        write_figure(fig, os.path.join(out, name), out, dpi=100)
        lines += [f"![{branch} {stat}]({name})", ""]
    if data["grad"]:
        write_figure(grad_figure(data["grad"]), os.path.join(out, "diag_grad_norm.png"), out, 100)
        lines += ["![gradient norm per submodule](diag_grad_norm.png)", ""]
    return lines
