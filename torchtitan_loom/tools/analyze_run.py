"""The measuring half of tools.analyze (tools/analyze.py is the command line): load the
checkpoint, route the held-out tokens through every loop, then hand the numbers to
tools/analyze_report.py and tools/analyze_diag.py, which write the report and its figures.

Where the report goes: ``--out DIR``, else ``<run folder>/analysis/step-<N>/`` (the run folder is
the one holding the checkpoint folder and metrics.jsonl), never the current directory. Nothing is
written through a symbolic link there (tools/out_files.py): a link at a name the report uses
(``report.md``, a ``*.png``) is refused before anything is written.
"""

from __future__ import annotations

import os
import sys
from typing import Any, cast

import torch

from torchtitan_loom.components.checkpoint import names
from torchtitan_loom.components.evaluation.loop_by_loop import LoopByLoop
from torchtitan_loom.components.runtime.messages import count
from torchtitan_loom.protocols import ModelProtocol
from torchtitan_loom.tools import out_files
from torchtitan_loom.tools.analyze_diag import report_section
from torchtitan_loom.tools.analyze_report import write_report
from torchtitan_loom.tools.progress import Progress

ANALYSIS_DIR = "analysis"


class AnalyzeError(ValueError):
    """Bad input to the tool: reported as one line, exit code 2."""


@torch.no_grad()
def evaluate(
    model: Any,
    loader: Any,
    device: torch.device,
    samples: int,
    sample_tokens: int,
    progress: Progress | None = None,
    tokens: int | None = None,
) -> dict[str, Any]:
    """Loss after every loop, RoutingStats, and the routed ids of the first `samples` documents.
    ``progress``: a line after the first batch, then every ~10 s (``tokens``: the target)."""
    if model.routing is None:
        raise AnalyzeError("the model has no routed experts: nothing to analyze")
    sums = LoopByLoop(model, device)
    docs: list[dict[str, Any]] = []
    n_batches = 0
    for batch in loader:
        ids_LHBSK = sums.add({k: v.to(device) for k, v in batch.items()})
        if len(docs) < samples and ids_LHBSK is not None:
            docs += _sample_docs(batch, ids_LHBSK.cpu(), samples - len(docs), sample_tokens)
        n_batches += 1
        n_tok = int(sums.n_tok.item())
        if progress is not None:
            of = f" of {tokens:,}" if tokens else ""

            def routed(n: int = n_tok, of: str = of, b: int = n_batches) -> str:
                return f"{n:,}{of} held-out tokens routed ({count(b, 'batch')})"

            progress.tick(routed)
    n_tok = int(sums.n_tok.item())
    if n_tok == 0:
        raise AnalyzeError(
            "the held-out data has no valid tokens; pass --data with a pack that has a holdout"
        )
    losses = (sums.ce_H.cpu() / n_tok).tolist()
    return {"losses": losses, "routing": sums.routing, "docs": docs, "tokens": n_tok}


def _sample_docs(
    batch: dict[str, torch.Tensor], topk_LHBSK: torch.Tensor, count: int, max_tokens: int
) -> list[dict[str, Any]]:
    """The first `count` documents of the batch with ≥ 8 tokens: their token ids and ids [L, H, S, K]."""
    docs: list[dict[str, Any]] = []
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
    out: str | None,
    seq_len: int | None,
    batch_rows: int,
    samples: int,
    sample_tokens: int,
    layer: int | None,
    progress: Progress | None = None,
) -> str:
    """Measure ``ckpt_arg`` on the held-out data and write the report; returns report.md's path.
    ``out`` None: the run's own folder (see the module doc)."""
    from torchtitan_loom.components.checkpoint import found
    from torchtitan_loom.components.data import build_eval_loader, bundled_corpus_path
    from torchtitan_loom.components.data.pack_format import PackError, open_pack
    from torchtitan_loom.config.errors import ConfigError
    from torchtitan_loom.config.toml_file import read_toml

    progress = progress or Progress("analyze")
    try:
        ck = found.find(ckpt_arg)
        model, run = ck.build(), read_toml(ck.config_path) if ck.config_path else {}
    except (found.NotACheckpoint, ConfigError, OSError) as exc:
        raise AnalyzeError(str(exc)) from None
    if ck.note:
        print(f"warning: {ck.note}", file=sys.stderr)
    ckpt, info = ck.folder, dict(ck.model_args or {}, step=ck.step)
    out, owner = (out, out) if out is not None else default_out(ckpt, run, info["step"])
    out_files.below(out, owner, AnalyzeError)  # before the slow part: a planted link fails now
    check_out_links(out)
    data = data or run.get("data", {}).get("path") or str(bundled_corpus_path(None))
    a = cast(ModelProtocol, model).args
    seq_len = seq_len or run.get("training", {}).get("seq_len") or a.max_seq_len
    routing = cast(ModelProtocol, model).routing
    n_layers = routing.num_layers if routing is not None else 0
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
    reads = loader.num_label_tokens  # whole batches: --tokens rounded up (the held-out eval's way)
    progress.phase(
        f"step {info['step']} loaded; routing {reads:,} held-out tokens of {data} in batches of "
        f"{batch_rows} rows, --tokens {tokens:,} rounded up to whole batches"
    )
    result = evaluate(model, loader, torch.device("cpu"), samples, sample_tokens, progress, reads)
    from pathlib import Path

    from torchtitan_loom.tools.loading import LoadError, recorded_tokenizer

    try:  # resolved against the pack, never the current directory
        tokenizer = recorded_tokenizer(Path(pack.path), pack.tokenizer_name)
    except LoadError:
        tokenizer = ""  # token labels fall back to ids
    progress.phase(f"writing the report and its figures to {out}")
    try:
        out_files.make_out(out, AnalyzeError, owner)
        check_out_links(out)
        diag = report_section(_metrics_path(ckpt, run), out)
        return write_report(result, info, ckpt, data, out, tokenizer, layer, diag)
    except OSError as exc:  # UnsafePathError (a link planted meanwhile), a full disk
        raise AnalyzeError(f"{out}: cannot write the report: {exc}") from None


def default_out(
    ckpt: str, run: dict[str, Any], step: Any, kind: str = ANALYSIS_DIR
) -> tuple[str, str]:
    """(report folder, the folder that owns it) when --out is not given:
    ``<run folder>/<kind>/step-<N>/`` (kind: analysis, depth); the run folder holds metrics.jsonl above the checkpoint,
    else it is the run's job.dump_folder, else the folder above the checkpoint folder."""
    from torchtitan_loom.tools.loading import run_folder

    dump = run.get("job", {}).get("dump_folder")
    found = run_folder(ckpt)
    if found is None and dump and os.path.isdir(dump):
        found = dump
    found = found or os.path.dirname(os.path.dirname(os.path.abspath(ckpt)))
    name = f"step-{step}" if isinstance(step, int) else os.path.basename(os.path.abspath(ckpt))
    return os.path.join(found, kind, name), found


def check_out_links(out: str) -> None:
    """AnalyzeError naming the first symbolic link in ``out`` at a name the report writes
    (report.md, a PNG, or their temporary ``.partial``)."""
    if not os.path.isdir(out):
        return  # created later
    for name in sorted(os.listdir(out)):
        base = name.removesuffix(".partial")
        path = os.path.join(out, name)
        if (base == "report.md" or base.endswith(".png")) and os.path.islink(path):
            raise AnalyzeError(
                f"{path} is a symbolic link (to {os.readlink(path)!r}); refusing to write the "
                "report through it: remove the link or choose another --out"
            )


def _metrics_path(ckpt: str, run: dict[str, Any]) -> str:
    """The run's metrics.jsonl: beside the checkpoint folder (<dump>/checkpoint/step-N), else in the
    dump folder its config names."""
    near = os.path.normpath(os.path.join(ckpt, os.pardir, os.pardir, names.METRICS_JSONL))
    named = os.path.join(run.get("job", {}).get("dump_folder", ""), names.METRICS_JSONL)
    return near if os.path.isfile(near) or not os.path.isfile(named) else named
