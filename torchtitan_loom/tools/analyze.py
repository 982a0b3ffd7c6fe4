"""Look inside the loops of a checkpoint: a self-contained report.md with PNG figures.

    python -m torchtitan_loom.tools.analyze CKPT [--data PATH] [--tokens N] [--out DIR]

CKPT is a checkpoint directory (``.../checkpoint/step-N``), a checkpoint folder or a run's dump
folder (its newest complete checkpoint). The held-out data is the holdout epoch of ``--data`` (a
pack), else of the run's ``data.path`` (from the checkpoint's config.toml), else the bundled
corpus. The report covers the held-out loss after every loop, the routing-diversity table per
layer and per loop (definitions in components/observability/routing_stats.py and the README), a loop × expert
load heatmap per layer, for a few documents which experts each token visits in each loop, and
when the run logged branch diagnostics (metrics.diag_interval) their layer × loop heatmaps over
training (tools/analyze_diag.py). This module is the command line (it imports no torch before its
first line); tools/analyze_run.py measures, tools/analyze_report.py writes the report.

Without ``--out`` the report goes to ``<run folder>/analysis/step-<N>/`` (next to the run's
checkpoint folder and metrics.jsonl), never into the current directory. A symbolic link at a
name the report writes is refused (one line, exit 2), never written through. Progress lines on
stdout: one per phase and, while routing, one after the first batch and then one every ~10 s.
A damaged line of the run's metrics.jsonl (read for the diagnostics figures) is skipped with one
warning line naming the file and the line (tools/input_files.py).

The figures carry titles, axis labels and colour bars, to be readable without the code
(matplotlib, a dependency of the package).
"""

from __future__ import annotations

import argparse
import sys

from torchtitan_loom.components.runtime import exit_codes

# Nothing here imports torch: the first line is printed before that wait.
from torchtitan_loom.components.runtime.messages import shorten_line
from torchtitan_loom.tools.progress import Progress

DEFAULT_OUT = "<run folder>/analysis/step-<N>"


SAMPLE_TOKENS = 40  # tokens of each document picture


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
    parser.add_argument("--out", default=None, help=f"output directory (default {DEFAULT_OUT})")
    parser.add_argument(
        "--seq-len", type=int, default=None, help="row length (default: the run's training.seq_len)"
    )
    parser.add_argument("--batch-rows", type=int, default=8, help="rows per forward (default 8)")
    parser.add_argument(
        "--samples", type=int, default=3, help="documents with a routing picture (default 3)"
    )
    parser.add_argument(
        "--sample-tokens",
        type=int,
        default=SAMPLE_TOKENS,
        help=f"tokens shown per document (default {SAMPLE_TOKENS})",
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
    if ns.samples < 1 and (ns.layer is not None or ns.sample_tokens != SAMPLE_TOKENS):
        print(
            "analyze error: --layer and --sample-tokens shape the document pictures, and "
            f"--samples {ns.samples} draws none: leave them out, or pass --samples 1 or more",
            file=sys.stderr,
        )
        return exit_codes.BAD_INPUT
    progress = Progress("analyze")
    print(
        f"analyze: loading {ns.ckpt}, then routing {ns.tokens:,} held-out tokens (rounded up to "
        "whole batches) through it ...",
        flush=True,
    )
    import torch

    from torchtitan_loom.tools.analyze_run import AnalyzeError, analyze

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
                progress,
            )
    except AnalyzeError as exc:
        print(shorten_line(f"analyze error: {exc}"), file=sys.stderr)
        return exit_codes.BAD_INPUT
    print(f"report written: {path}")
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
