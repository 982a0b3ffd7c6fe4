"""What the depth report reads and how it runs it (tools/depth_run.py measures over it). By default
exactly what the run's held-out eval reads (components/evaluation/held_out.py, built in
trainer/build.py): the training pack's holdout epoch, or epoch 0 of data.val_path; eval.tokens
valid labels, counted per batch of eval.batch_size (else training.global_batch_size) rows, so the
read stops after the same batch; rows of training.seq_len; forwards of training.micro_batch_size
rows; MoE capacity dropping as trained. The loss after H loops is then the eval_loss the run
logged for the same checkpoint. Every flag that moves away from the eval is named in ``differs``,
which the report prints. Torch-free.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

CAPACITY = ("trained", "off")  # --capacity: as the run trained (and evaluated), or no dropping
# A checkpoint without its run's config.toml (an export without one) has no eval to match.
NO_CONFIG_TOKENS = 20_000
NO_CONFIG_ROWS = 8


@dataclasses.dataclass(frozen=True)
class Reads:
    """The held-out read: ``data`` (a pack; its holdout epoch) or ``val_path`` (epoch 0 of that
    pack), up to ``tokens`` valid labels in batches of ``rows`` rows of ``seq_len``, run in
    forwards of ``forward_rows``, by the model as trained when ``as_trained`` names how its
    arguments differ from the decoding model's (the spec's portable_args; "" = the decoding
    model)."""

    data: str
    val_path: str | None
    tokens: int
    seq_len: int
    rows: int
    forward_rows: int
    as_trained: str
    differs: tuple[str, ...]

    def source(self) -> str:
        return f"epoch 0 of {self.val_path}" if self.val_path else f"the holdout of {self.data}"

    def describe(self) -> str:
        """One sentence: what was read, and where it differs from the run's eval."""
        capacity = (
            f"the model as trained ({self.as_trained})"
            if self.as_trained
            else "the model as decoding runs it"
        )
        what = (
            f"{self.tokens:,} tokens or more (whole batches) of {self.source()} in rows of "
            f"{self.seq_len}, batches of "
            f"{self.rows} rows run {self.forward_rows} at a time, {capacity}"
        )
        if not self.differs:
            return f"Read as the run's held-out eval reads: {what}"
        return f"Read: {what}; unlike the run's held-out eval: {'; '.join(self.differs)}"


def resolve(
    run_cfg: Any,
    pack: str,
    trained: str,
    max_seq_len: int,
    *,
    data: str | None,
    tokens: int | None,
    seq_len: int | None,
    batch_rows: int | None,
    capacity: str,
) -> Reads:
    """The Reads of the command's flags (None: the eval's value) for a checkpoint whose run config
    is ``run_cfg`` (None: no config.toml), training pack ``pack`` and ``trained``: how the trained
    model's arguments differ from the decoding model's ("" when they do not)."""
    factor = trained if capacity == "trained" else ""
    differs: list[str] = []
    if capacity == "off" and trained:
        differs.append(f"--capacity off: the model as decoding runs it (trained with {trained})")
    if run_cfg is None:
        rows = batch_rows or NO_CONFIG_ROWS
        differs.insert(0, "no config.toml next to the checkpoint, so no eval to match")
        return Reads(
            data or pack,
            None,
            tokens or NO_CONFIG_TOKENS,
            seq_len or max_seq_len,
            rows,
            rows,
            factor,
            tuple(differs),
        )
    t, ev = run_cfg.training, run_cfg.eval
    val_path = run_cfg.data.val_path or None
    eval_reads = Reads(
        pack,
        val_path,
        ev.tokens,
        t.seq_len,
        ev.batch_size or t.global_batch_size,
        t.micro_batch_size,
        trained,
        (),
    )
    if data is not None and (
        val_path is not None or os.path.realpath(data) != os.path.realpath(pack)
    ):
        differs.append(f"--data {data} (the eval reads {eval_reads.source()})")
    given = {
        "tokens": (tokens, ev.tokens, "eval.tokens"),
        "seq-len": (seq_len, t.seq_len, "training.seq_len"),
        "batch-rows": (batch_rows, t.micro_batch_size, "training.micro_batch_size"),
    }
    for flag, (value, evals, key) in given.items():
        if value is not None and value != evals:
            differs.append(f"--{flag} {value} ({key} = {evals})")
    return dataclasses.replace(
        eval_reads,
        data=data or pack,
        val_path=None if data is not None else val_path,
        tokens=tokens or ev.tokens,
        seq_len=seq_len or t.seq_len,
        forward_rows=batch_rows or t.micro_batch_size,
        as_trained=factor,
        differs=tuple(differs),
    )
