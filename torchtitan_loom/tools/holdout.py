"""The holdout check before scoring: recompute the checkpoint's held-out loss and compare it with
the ``eval_loss`` its run logged at that step in ``metrics.jsonl``.

A gap larger than the threshold means the weights, the tokenizer/pack or the code differ from
what the run had. The loss is recomputed the way the trainer's eval computed it: the run's eval
loader (pack, val_path, seq_len, eval rows, eval.tokens), its micro-batches, and the model args
as trained (capacity dropping as trained: the logged number was measured with it). The module
shares the inference model's tensors (no copy).

Modes: ``on`` (refuse to score on a gap, or when there is nothing to compare with), ``record``
(compute and record, never refuse), ``off`` (skip).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from torchtitan_loom.components.checkpoint import names
from torchtitan_loom.components.loss import count_valid, token_ce_sum
from torchtitan_loom.distributed import utils as dist_utils
from torchtitan_loom.protocols import get_train_spec, portable_args
from torchtitan_loom.tools.input_files import metrics_rows
from torchtitan_loom.tools.loading import Loaded, LoadError, run_folder
from torchtitan_loom.tools.progress import Progress

MODES = ("on", "off", "record")


@dataclass
class HoldoutResult:
    mode: str
    step: int | None
    logged: float | None
    recomputed: float | None
    threshold: float
    tokens: int = 0

    @property
    def gap(self) -> float | None:
        if self.logged is None or self.recomputed is None:
            return None
        return abs(self.recomputed - self.logged)

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "step": self.step,
            "logged_eval_loss": self.logged,
            "recomputed_eval_loss": self.recomputed,
            "gap": self.gap,
            "threshold": self.threshold,
            "tokens": self.tokens,
        }


def logged_eval_loss(metrics_path: str, step: int) -> float | None:
    """``eval_loss`` of the last metrics.jsonl row of ``step`` that has one (later rows win: a
    resumed run appends steps it had already logged). A damaged line is skipped with one warning
    naming the file and the line (tools/input_files.py); with the row of ``step`` among them, the
    check then finds no logged loss and says so."""
    found = None
    for row in metrics_rows(metrics_path):
        loss = row.get("eval_loss")
        if row["step"] == step and isinstance(loss, (int, float)) and not isinstance(loss, bool):
            found = float(loss)
    return found


def metrics_file(loaded: Loaded) -> str | None:
    """metrics.jsonl of the run the checkpoint belongs to (an export remembers its source)."""
    sources = [loaded.checkpoint]
    info = (loaded.on_disk.model_args if loaded.on_disk is not None else None) or {}
    if info.get("source"):
        sources.append(info["source"])
    if loaded.config is not None:
        sources.append(loaded.config.job.dump_folder)
    for src in sources:
        folder = run_folder(src)
        if folder is not None:
            return os.path.join(folder, names.METRICS_JSONL)
    return None


@torch.no_grad()
def recompute_eval_loss(
    loaded: Loaded,
    device: torch.device,
    rank: int = 0,
    world: int = 1,
    progress: Progress | None = None,
) -> tuple[float, int]:
    """(held-out loss after all H loops, valid tokens) as the trainer's eval measured it;
    ``progress`` gets a line after the first batch and then every ~10 s."""
    from torchtitan_loom.components.data import PackError, build_eval_loader

    cfg, pack_path = loaded.config, loaded.pack_path
    assert cfg is not None and pack_path is not None  # check() returns early without them
    t = cfg.training
    with torch.device("meta"):
        trained = type(loaded.model)(
            portable_args(get_train_spec(loaded.name), loaded.args, decoding=False)
        )
    trained.load_state_dict(loaded.model.state_dict(), assign=True)  # shares the tensors
    rows = cfg.eval.batch_size or t.global_batch_size
    try:
        loader = build_eval_loader(
            pack_path,
            seq_len=t.seq_len,
            vocab_size=loaded.args.vocab_size,
            batch_rows=rows,
            dp_rank=rank,
            dp_world=world,
            val_path=cfg.data.val_path or None,
            max_tokens=cfg.eval.tokens,
        )
    except (PackError, ValueError) as exc:
        raise LoadError(f"holdout check: {exc}") from None
    ce = torch.zeros(1, dtype=torch.float64, device=device)
    n_tok = torch.zeros(1, dtype=torch.float64, device=device)
    mb = t.micro_batch_size
    for batch in loader:
        for i in range(0, batch["input_ids"].shape[0], mb):
            m = {k: v[i : i + mb].to(device) for k, v in batch.items()}
            out = trained(m["input_ids"], m["positions"], m["doc_ids"])
            ce += token_ce_sum(out.logits_BSV, m["labels"]).double()
            n_tok += count_valid(m["labels"])
        if progress is not None:

            def read(n: torch.Tensor = n_tok) -> str:
                return f"holdout check: {int(n.item()):,} held-out tokens read"

            progress.tick(read)
    dist_utils.all_reduce(ce)
    dist_utils.all_reduce(n_tok)
    return (ce / n_tok.clamp(min=1)).item(), int(n_tok.item())


def check(
    loaded: Loaded,
    mode: str,
    threshold: float,
    device: torch.device,
    rank: int = 0,
    world: int = 1,
    progress: Progress | None = None,
) -> HoldoutResult:
    """Run the check; raises LoadError when ``mode == "on"`` and it fails (or cannot run)."""
    result = HoldoutResult(mode, loaded.step, None, None, threshold)
    if mode == "off":
        return result
    if loaded.config is None or loaded.pack_path is None:
        if mode == "on":
            raise LoadError(
                f"holdout check: {loaded.checkpoint} has no config.toml, so the run's holdout is "
                "unknown; pass --holdout-check off"
            )
        return result
    metrics = metrics_file(loaded)
    if metrics is not None and loaded.step is not None:
        result.logged = logged_eval_loss(metrics, loaded.step)
    if result.logged is None and mode == "on":
        where = metrics or "metrics.jsonl (not found)"
        raise LoadError(
            f"holdout check: no eval_loss logged at step {loaded.step} in {where}; evaluate at the "
            "checkpoint steps (eval.interval), or pass --holdout-check record|off"
        )
    if progress is not None:
        progress.phase(f"holdout check: recomputing the held-out loss of step {loaded.step}")
    result.recomputed, result.tokens = recompute_eval_loss(loaded, device, rank, world, progress)
    gap = result.gap  # never None in mode "on": logged was found and recomputed is set
    if mode == "on" and gap is not None and gap > threshold:
        raise LoadError(
            f"holdout check failed: recomputed eval loss {result.recomputed:.5f} vs {result.logged:.5f} "
            f"logged at step {loaded.step} (gap {result.gap:.5f} > --holdout-threshold {threshold}); "
            "the weights, tokenizer/pack or code differ from the run's"
        )
    return result
