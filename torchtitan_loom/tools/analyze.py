"""Look inside the loops of a checkpoint: a self-contained report.md with PNG figures.

    python -m torchtitan_loom.tools.analyze CKPT [--data PATH] [--tokens N] [--out DIR]

CKPT is a checkpoint directory (``.../checkpoint/step-N``), a checkpoint folder or a run's dump
folder (its newest complete checkpoint). The held-out data is the holdout epoch of ``--data`` (a
pack), else of the run's ``data.path`` (from the checkpoint's config.toml), else the bundled
corpus. The report covers the held-out loss after every loop, the routing-diversity table per
layer and per loop (definitions in components/observability/routing_stats.py and the README), a loop × expert
load heatmap per layer, for a few documents which experts each token visits in each loop, and
when the run logged branch diagnostics (metrics.diag_interval) their layer × loop heatmaps over
training (tools/analyze_diag.py). This module measures and runs the command line; the report
and its figures are written by tools/analyze_report.py.

The figures carry titles, axis labels and colour bars, to be readable without the code
(matplotlib, a dependency of the package).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

from torchtitan_loom.components.runtime.messages import shorten_line
from torchtitan_loom.components.runtime import exit_codes
from torchtitan_loom.components.loss import count_valid, token_ce_sum
from torchtitan_loom.components.observability.routing_stats import RoutingStats
from torchtitan_loom.data_contract import real_tokens
from torchtitan_loom.tools.analyze_diag import report_section
from torchtitan_loom.tools.analyze_report import write_report

DEFAULT_OUT = "analysis"


class AnalyzeError(ValueError):
    """Bad input to the tool: reported as one line, exit code 2."""


def _run_config(ckpt: str) -> dict[str, Any]:
    path = os.path.join(ckpt, "config.toml")
    if not os.path.isfile(path):
        return {}
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    with open(path, "rb") as fh:
        return tomllib.load(fh)


@torch.no_grad()
def evaluate(
    model: Any, loader: Any, device: torch.device, samples: int, sample_tokens: int
) -> dict[str, Any]:
    """Loss after every loop, RoutingStats, and the routed ids of the first `samples` documents."""
    H = model.num_loops
    if model.routing is None:
        raise AnalyzeError("the model has no routed experts: nothing to analyze")
    n_layers, n_experts = model.routing
    routing: RoutingStats | None = None
    ce_H = torch.zeros(H, dtype=torch.float64)
    n_tok = 0
    docs: list[dict[str, Any]] = []
    for batch in loader:
        mb = {k: v.to(device) for k, v in batch.items()}
        carry, topk_per_loop = None, []
        for loop in range(1, H + 1):
            out = model(
                mb["input_ids"],
                mb["positions"],
                mb["doc_ids"],
                loop_start=loop,
                loop_end=loop,
                carry=carry,
                return_topk=True,
            )
            carry = out.carry
            ce_H[loop - 1] += token_ce_sum(out.logits_BSV, mb["labels"]).double().cpu()
            if routing is None:  # top-k from the ids' own shape
                routing = RoutingStats(n_layers, H, n_experts, out.topk_LTBSK.shape[-1], device)
            if loop == 1:
                routing.start_batch(real_tokens(mb["doc_ids"]))
            routing.add_loop(out.topk_LTBSK[:, 0], model.carry_stream(carry))
            if len(docs) < samples:
                topk_per_loop.append(out.topk_LTBSK[:, 0].cpu())
        n_tok += int(count_valid(mb["labels"]))
        if len(docs) < samples:
            docs += _sample_docs(
                batch, torch.stack(topk_per_loop, dim=1), samples - len(docs), sample_tokens
            )
    if n_tok == 0:
        raise AnalyzeError(
            "the held-out data has no valid tokens; pass --data with a pack that has a holdout"
        )
    return {"losses": (ce_H / n_tok).tolist(), "routing": routing, "docs": docs, "tokens": n_tok}


def _sample_docs(
    batch: dict[str, torch.Tensor], topk_LHBSK: torch.Tensor, count: int, max_tokens: int
) -> list[dict[str, Any]]:
    """The first `count` documents of the batch with ≥ 8 tokens: their token ids and ids [L, H, S, K]."""
    docs = []
    for row in range(batch["doc_ids"].shape[0]):
        doc_row = batch["doc_ids"][row]
        for doc in doc_row.unique().tolist():
            if doc < 0 or len(docs) == count:
                continue
            cols = (doc_row == doc).nonzero().flatten()[:max_tokens]
            if cols.numel() >= 8:
                docs.append(
                    {
                        "row": row,
                        "tokens": batch["input_ids"][row, cols].tolist(),
                        "topk_LHSK": topk_LHBSK[:, :, row, cols].numpy(),
                    }
                )
    return docs


def analyze(
    ckpt_arg: str,
    data: str | None,
    tokens: int,
    out: str,
    seq_len: int | None,
    batch_rows: int,
    samples: int,
    sample_tokens: int,
    layer: int | None,
) -> str:
    from torchtitan_loom.components.checkpoint.layout import read_json
    from torchtitan_loom.components.data import build_eval_loader, bundled_corpus_path
    from torchtitan_loom.components.data.pack_format import PackError, open_pack
    from torchtitan_loom.tools.export import ExportError, load_checkpoint_model

    try:
        model, info, ckpt = load_checkpoint_model(ckpt_arg)
    except (ExportError, OSError) as exc:
        raise AnalyzeError(str(exc)) from None
    run = _run_config(ckpt)
    info = dict(info, step=(read_json(os.path.join(ckpt, "meta.json")) or {}).get("step"))
    data = data or run.get("data", {}).get("path") or str(bundled_corpus_path(None))
    a = model.args
    seq_len = seq_len or run.get("training", {}).get("seq_len") or a.max_seq_len
    n_layers = model.routing.num_layers if model.routing is not None else 0
    if layer is None:
        layer = n_layers // 2
    if not 0 <= layer < n_layers:
        raise AnalyzeError(f"--layer {layer}: the model has routed layers 0..{n_layers - 1}")
    try:
        pack = open_pack(data, seq_len=seq_len, vocab_size=a.vocab_size)
        loader = build_eval_loader(
            data,
            seq_len=seq_len,
            vocab_size=a.vocab_size,
            batch_rows=batch_rows,
            dp_rank=0,
            dp_world=1,
            max_tokens=tokens,
        )
    except (PackError, ValueError, OSError) as exc:
        raise AnalyzeError(f"--data {data}: {exc}") from None
    result = evaluate(model, loader, torch.device("cpu"), samples, sample_tokens)
    from pathlib import Path

    from torchtitan_loom.tools.loading import LoadError, recorded_tokenizer

    try:  # resolved against the pack, never the current directory
        tokenizer = recorded_tokenizer(Path(pack.path), pack.tokenizer_name)
    except LoadError:
        tokenizer = ""  # token labels fall back to ids
    path = write_report(result, info, ckpt, data, out, tokenizer, layer)
    diag = report_section(_metrics_path(ckpt, run), out)
    if diag:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write("\n\n" + "\n".join(diag))
    return path


def _metrics_path(ckpt: str, run: dict[str, Any]) -> str:
    """The run's metrics.jsonl: beside the checkpoint folder (<dump>/checkpoint/step-N), else in the
    dump folder its config names."""
    near = os.path.normpath(os.path.join(ckpt, os.pardir, os.pardir, "metrics.jsonl"))
    named = os.path.join(run.get("job", {}).get("dump_folder", ""), "metrics.jsonl")
    return near if os.path.isfile(near) or not os.path.isfile(named) else named


def main(argv: list[str] | None = None) -> int:
    """The command line; returns 0, or 2 with one ``analyze error:`` line."""
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_loom.tools.analyze", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "ckpt", help="checkpoint directory (step-N), checkpoint folder or run dump folder"
    )
    parser.add_argument(
        "--data",
        default=None,
        help="packed corpus whose holdout epoch is read "
        "(default: the run's data.path, else the bundled corpus)",
    )
    parser.add_argument(
        "--tokens", type=int, default=20_000, help="held-out tokens to read (default 20000)"
    )
    parser.add_argument(
        "--out", default=DEFAULT_OUT, help=f"output directory (default ./{DEFAULT_OUT})"
    )
    parser.add_argument(
        "--seq-len", type=int, default=None, help="row length (default: the run's training.seq_len)"
    )
    parser.add_argument("--batch-rows", type=int, default=8, help="rows per forward (default 8)")
    parser.add_argument(
        "--samples", type=int, default=3, help="documents with a routing picture (default 3)"
    )
    parser.add_argument(
        "--sample-tokens", type=int, default=40, help="tokens shown per document (default 40)"
    )
    parser.add_argument(
        "--layer", type=int, default=None, help="layer of the document pictures (default L // 2)"
    )
    ns = parser.parse_args(argv)
    for key in ("tokens", "batch_rows", "sample_tokens"):
        if getattr(ns, key) < 1:
            print(
                f"analyze error: --{key.replace('_', '-')} {getattr(ns, key)}: must be ≥ 1",
                file=sys.stderr,
            )
            return exit_codes.BAD_INPUT
    print(
        f"analyze: loading {ns.ckpt}, then routing {ns.tokens:,} held-out tokens through it ...",
        flush=True,
    )
    try:
        with torch.no_grad():  # scoped: main() may run inside another program (tests do)
            path = analyze(
                ns.ckpt,
                ns.data,
                ns.tokens,
                ns.out,
                ns.seq_len,
                ns.batch_rows,
                max(ns.samples, 0),
                ns.sample_tokens,
                ns.layer,
            )
    except AnalyzeError as exc:
        print(shorten_line(f"analyze error: {exc}"), file=sys.stderr)
        return exit_codes.BAD_INPUT
    print(f"report written: {path}")
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
