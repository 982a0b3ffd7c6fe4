"""Pictures of routing and of the per-loop loss, as RGB arrays (for TensorBoard) or PNG files.

Every figure carries a title, axis labels and its values: the heatmaps a colour bar (and the
number in each cell when there are few enough to read), the loss curve the loss at each loop.
Matplotlib (a dependency) is used through its object API (Figure + Agg canvas), never pyplot, so
nothing global changes.

Legend: H loops, E experts, L layers, S tokens of a document, K top-k.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

DPI = 100
HEATMAP_SIZE_IN = (7.0, 3.2)  # figure size of a loop × expert heatmap -> 700 × 320 px
CURVE_SIZE_IN = (5.0, 3.2)  # figure size of the loss-per-loop curve -> 500 × 320 px
CMAP = "viridis"
SHARE_LABEL = "load ÷ uniform (1 = balanced)"
# Up to this many loop × expert cells the heatmap prints each cell's value (the debug model has
# 3 × 8; the presets' 9..12 × 30 would be unreadable, their colour bar gives the scale).
MAX_LABELLED_CELLS = 64


def _figure(size_in: tuple[float, float]):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size_in, dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def _to_chw(fig) -> np.ndarray:
    fig.canvas.draw()
    rgb_HWC = np.asarray(fig.canvas.buffer_rgba())[..., :3]
    return np.ascontiguousarray(rgb_HWC.transpose(2, 0, 1))


def share_vmax(share: np.ndarray) -> float:
    """Colour scale top: at least 2 (so 1 = balanced sits mid-scale), more when an expert is hotter."""
    return float(max(2.0, np.nanmax(share) if share.size else 2.0))


def heatmap_figure(share_HE: np.ndarray, title: str, vmax: float | None = None):
    """A loop × expert heatmap of load ÷ uniform with a colour bar (a matplotlib Figure)."""
    H, E = share_HE.shape
    fig = _figure(HEATMAP_SIZE_IN)
    ax = fig.add_subplot(1, 1, 1)
    image = ax.imshow(
        share_HE,
        aspect="auto",
        cmap=CMAP,
        vmin=0.0,
        vmax=vmax or share_vmax(share_HE),
        interpolation="nearest",
    )
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("routed expert")
    ax.set_ylabel("loop")
    ax.set_xticks(range(0, E, max(1, E // 16)))
    ax.set_yticks(range(H), [str(t + 1) for t in range(H)])
    if H * E <= MAX_LABELLED_CELLS:
        top = vmax or share_vmax(share_HE)
        for (t, e), value in np.ndenumerate(share_HE):
            dark = value < 0.6 * top  # viridis: light text on the dark half
            colour = "white" if dark else "black"
            ax.text(e, t, f"{value:.2f}", ha="center", va="center", fontsize=7, color=colour)
    fig.colorbar(image, ax=ax, label=SHARE_LABEL)
    fig.tight_layout()
    return fig


def loss_curve_figure(losses_H: Sequence[float], title: str):
    """Held-out loss after each loop (the early-exit curve), a matplotlib Figure."""
    fig = _figure(CURVE_SIZE_IN)
    ax = fig.add_subplot(1, 1, 1)
    loops = list(range(1, len(losses_H) + 1))
    ax.plot(loops, losses_H, marker="o")
    for x, y in zip(loops, losses_H):
        ax.annotate(
            f"{y:.3f}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8
        )
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("exit after loop")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.set_xticks(loops)
    ax.margins(x=0.08, y=0.2)  # room for the value labels
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def routing_picture_figure(
    ids_HSK: np.ndarray, tokens: Sequence[str], num_experts: int, title: str
):
    """One document: for each loop (a band of rows, one per expert) and token (column), a black
    cell where the token visits that expert."""
    from matplotlib.transforms import blended_transform_factory

    H, S, _ = ids_HSK.shape
    E = num_experts
    grid = np.zeros((H * E, S))
    for t in range(H):
        for s in range(S):
            grid[t * E + ids_HSK[t, s], s] = 1.0
    fig = _figure((max(6.0, 0.22 * S + 1.8), max(3.0, 0.16 * H * E + 1.4)))
    ax = fig.add_subplot(1, 1, 1)
    ax.imshow(grid, aspect="auto", cmap="Greys", vmin=0, vmax=1, interpolation="nearest")
    for t in range(1, H):
        ax.axhline(t * E - 0.5, color="tab:red", linewidth=1.0)
    step = max(1, E // 8)  # expert ids on the rows, thinned for many experts
    rows = [t * E + e for t in range(H) for e in range(0, E, step)]
    ax.set_yticks(rows, [str(r % E) for r in rows], fontsize=6)
    to_left = blended_transform_factory(ax.transAxes, ax.transData)
    for t in range(H):
        ax.text(
            -0.045,
            t * E + (E - 1) / 2,
            f"loop {t + 1}",
            transform=to_left,
            ha="right",
            va="center",
            fontsize=9,
        )
    short = all(len(tok) <= 2 for tok in tokens)
    ax.set_xticks(range(S), list(tokens), rotation=0 if short else 90, fontsize=8 if short else 7)
    ax.set_xlabel("token of the document (input text; ␣ = space, ⏎ = newline)")
    ax.set_ylabel("routed expert id", fontsize=8)
    ax.set_title(title + " — black = expert chosen", fontsize=10)
    fig.tight_layout()
    return fig


def heatmap_image(share_HE: np.ndarray, title: str) -> np.ndarray:
    """uint8 RGB [3, h, w] of ``heatmap_figure`` (for TensorBoard)."""
    return _to_chw(heatmap_figure(share_HE, title))


def loss_curve_image(losses_H: Sequence[float], title: str) -> np.ndarray:
    """uint8 RGB [3, h, w] of ``loss_curve_figure`` (for TensorBoard)."""
    return _to_chw(loss_curve_figure(losses_H, title))


def save_figure(fig, path: str) -> None:
    fig.savefig(path, dpi=DPI)
