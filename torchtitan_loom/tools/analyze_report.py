"""The analyze tool's report: report.md with its PNG figures (loss after every loop, routing
diversity per layer and per loop, a loop × expert load heatmap per layer, the routing pictures of
sample documents), from what tools/analyze.py measured on the held-out data. The figures carry
titles, axis labels and colour bars (components/observability/routing_plots.py).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from torchtitan_loom.components.observability.routing_stats import RoutingStats
from torchtitan_loom.components.runtime.messages import count
from torchtitan_loom.tools.out_files import write_figure, write_file


def _token_text(pack_tokenizer: str, vocab_ids: list[int]) -> list[str]:
    """A short printable label per token id (bytes for the byte tokenizer, else the tokenizer's
    piece, else the id)."""
    from torchtitan_loom.components.data.tokenizer import build_tokenizer

    try:
        tok = build_tokenizer(pack_tokenizer) if pack_tokenizer else None
    except (ImportError, OSError, ValueError):
        tok = None
    labels = []
    for i in vocab_ids:
        text = tok.decode([i]) if tok is not None else ""
        text = text.replace("\n", "⏎").replace(" ", "␣")
        labels.append(text[:6] if text else f"#{i}")
    return labels


def _loss_lines(losses: list[float], H: int) -> list[str]:
    return [
        "## Held-out loss after every loop",
        "",
        "Running only the first t loops and applying the head (early exit). Lower is better.",
        "",
        "| loop | " + " | ".join(str(t + 1) for t in range(H)) + " |",
        "|---|" + "---|" * H,
        "| loss | " + " | ".join(f"{v:.4f}" for v in losses) + " |",
        "",
        "![loss per loop](loss_per_loop.png)",
        "",
    ]


def _diversity_lines(routing: RoutingStats, s: dict[str, float]) -> list[str]:
    """The routing diversity table, one row per layer and their mean (``s``: routing.summary())."""
    H, E = routing.H, routing.E
    rows = routing.per_layer()
    lines = [
        "## Routing diversity per layer",
        "",
        f"Over the held-out tokens (padding excluded). *distinct*: different experts a token visits "
        f"over the {H} loops (between k = {routing.K} and {min(E, H * routing.K)}); *overlap*: share of "
        f"a token's top-k kept from loop t to t+1, mean over t; *entropy*: load entropy / log E (1 = "
        f"uniform), mean over loops; *max/mean*: hottest expert's load ÷ mean load, mean over loops; "
        f"*dead*: experts no token chose in any loop; *dead/loop*: experts unchosen in a loop, mean over loops.",
        "",
        "| layer | distinct | overlap | entropy | max/mean | dead | dead/loop |",
        "|---|---|---|---|---|---|---|",
    ]

    def fmt(r: dict[str, float]) -> str:
        return (
            f"{r['distinct_experts']:.2f} | {r['overlap']:.3f} | {r['load_entropy']:.3f} | "
            f"{r['load_max_mean']:.2f} | {r['dead_experts']:g} | {r['dead_experts_per_loop']:.2f}"
        )

    for layer, r in enumerate(rows):
        lines.append(f"| {layer} | {fmt(r)} |")
    lines.append(
        "| **mean** | "
        + fmt(
            {
                k[len("routing_") :]: v
                for k, v in s.items()
                if k.startswith("routing_") and "_loop_" not in k
            }
        )
        + " |"
    )
    return lines


def _per_loop_lines(H: int, s: dict[str, float]) -> list[str]:
    """The per-loop table (mean over layers, ``s``: routing.summary()) and what its stream columns
    mean."""
    lines = [
        "",
        "## Per loop (mean over layers)",
        "",
        "| loop | overlap with next | load entropy | max/mean | stream RMS | cos with next |",
        "|---|---|---|---|---|---|",
    ]
    for t in range(1, H + 1):
        overlap, cos = (
            (f"{s[f'routing_overlap_loop_{t}']:.3f}", f"{s[f'stream_cos_loop_{t}']:.3f}")
            if t < H
            else ("–", "–")
        )
        lines.append(
            f"| {t} | {overlap} | {s[f'routing_load_entropy_loop_{t}']:.3f} | "
            f"{s[f'routing_load_max_mean_loop_{t}']:.2f} | {s[f'stream_rms_loop_{t}']:.3f} | {cos} |"
        )
    lines += [
        "",
        "The stream is RMS-normalised at the end of every loop, so its RMS stays ≈ 1 by construction; "
        "the cosine shows how much a loop still changes the token's representation.",
        "",
    ]
    return lines


def _document_lines(
    docs: list[dict[str, Any]], tokenizer: str, layer_for_docs: int, E: int, save, plots
) -> list[str]:
    """The sample documents' routing pictures (each saved by ``save``) and their captions."""
    lines = [
        "## Routing of sample documents",
        "",
        f"Layer {layer_for_docs}. Columns are the document's tokens (input text below each); each band "
        f"of rows is one loop and holds the {E} experts top to bottom; a black cell = the token visits "
        f"that expert in that loop.",
        "",
    ]
    for i, doc in enumerate(docs):
        labels = _token_text(tokenizer, doc["tokens"])
        name = f"doc_{i}.png"
        title = f"Sample document {i}: experts visited per loop (layer {layer_for_docs})"
        save(plots.routing_picture_figure(doc["topk_LHSK"][layer_for_docs], labels, E, title), name)
        distinct = np.mean(
            [
                len(set(doc["topk_LHSK"][layer_for_docs][:, s_].reshape(-1).tolist()))
                for s_ in range(len(labels))
            ]
        )
        lines += [
            f"**Document {i}** ({len(labels)} tokens; {distinct:.2f} distinct experts per token in "
            f"layer {layer_for_docs}): `{''.join(labels)[:120]}`",
            "",
            f"![document {i}]({name})",
            "",
        ]
    return lines


def write_report(
    result: dict[str, Any],
    info: dict[str, Any],
    ckpt: str,
    data: str,
    out: str,
    tokenizer: str,
    layer_for_docs: int,
    tail: list[str] | None = None,
) -> str:
    """Write the figures and report.md (ending with ``tail``, e.g. the diagnostics section) into
    ``out``, which exists; every file through out_files.write_file (never through a link)."""
    from torchtitan_loom.components.observability import routing_plots as plots

    def save(fig, name: str) -> None:
        write_figure(fig, os.path.join(out, name), out, plots.DPI)

    routing: RoutingStats = result["routing"]
    losses, H, E = result["losses"], routing.H, routing.E
    step = info.get("step")
    lines = [
        "# LOOM routing and loop analysis",
        "",
        f"- checkpoint: `{ckpt}`" + (f" (step {step})" if step is not None else ""),
        f"- model: {info.get('name')}/{info.get('flavor')}: L = {routing.L} layers, H = {count(H, 'loop')}, "
        f"E = {E} routed experts, top-k = {routing.K}",
        f"- held-out data: `{data}`, {result['tokens']:,} tokens with a target",
        "",
    ]

    save(
        plots.loss_curve_figure(losses, "Held-out loss after each loop (early exit)"),
        "loss_per_loop.png",
    )
    lines += _loss_lines(losses, H)
    summary = routing.summary()
    lines += _diversity_lines(routing, summary)
    lines += _per_loop_lines(H, summary)

    lines += [
        "## Expert load per layer",
        "",
        "Each row is a loop, each column a routed expert; colour = how often the expert is in a token's "
        "top-k, divided by the uniform share (1 = balanced, 0 = never chosen).",
        "",
    ]
    share_LHE = routing.load_share_LHE().cpu().numpy()
    vmax = plots.share_vmax(share_LHE)  # one colour scale for all layers, so they compare
    for layer in range(routing.L):
        name = f"load_layer_{layer}.png"
        save(
            plots.heatmap_figure(
                share_LHE[layer], f"Expert load, layer {layer} (held-out tokens)", vmax=vmax
            ),
            name,
        )
        lines += [f"![expert load, layer {layer}]({name})", ""]

    lines += _document_lines(result["docs"], tokenizer, layer_for_docs, E, save, plots)
    if tail:
        lines += ["", ""] + tail  # as the diagnostics section was appended before
    path = os.path.join(out, "report.md")
    write_file(path, "\n".join(lines), out)
    return path
