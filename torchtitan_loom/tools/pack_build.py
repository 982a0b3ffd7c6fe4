"""The packer's work: check that --out can be written (or replaced with --force) before any
tokenizing, tokenise the documents in parallel (results consumed in submission order, so the pack
does not depend on the number of workers), write them with PackWriter, and verify a written pack.
"""

from __future__ import annotations

import argparse
import collections
import functools
import multiprocessing as mp
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_loom.components.data.pack_arrays import token_range
from torchtitan_loom.components.data.pack_format import open_pack, read_metadata
from torchtitan_loom.components.data.pack_writer import PackWriter
from torchtitan_loom.components.data.tokenizer import build_tokenizer
from torchtitan_loom.tools.pack_sources import (
    PackInputError,
    open_hf_dataset,
    read_documents,
    saved_dataset,
)

DOCS_PER_TASK = 256  # documents sent to a worker at a time
PROGRESS_EVERY_S = 2.0  # seconds between progress lines on stderr
QUIET_S = 4.0  # a step silent this long says what it waits on (users saw 25-50 s of nothing)


def _batches(docs: Iterator[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    for d in docs:
        batch.append(d)
        if len(batch) == DOCS_PER_TASK:
            yield batch
            batch = []
    if batch:
        yield batch


@functools.lru_cache(maxsize=2)
def _tokenizer_for(name: str, eos_token: str | None):
    """A pure builder, memoised so each worker process loads its tokenizer once."""
    return build_tokenizer(name, eos_token)


def _encode_batch(task: tuple[str, str | None, list[str]]) -> list[np.ndarray]:
    name, eos_token, texts = task
    tok = _tokenizer_for(name, eos_token)
    return [tok.encode_array(t) for t in texts]


def _ordered_parallel(
    pool,
    name: str,
    eos_token: str | None,
    batches: Iterator[list[str]],
    ahead: int,
    on_first_wait: Callable[[], None] = lambda: None,
) -> Iterator[list[np.ndarray]]:
    """Results in submission order (so the pack does not depend on the number of workers), with
    at most `ahead` batches in flight (Pool.imap would read the whole corpus into its queue).
    ``on_first_wait`` runs before the first result is awaited (the workers may still be starting)."""
    pending: collections.deque = collections.deque()
    waited = False
    for b in batches:
        pending.append(pool.apply_async(_encode_batch, ((name, eos_token, b),)))
        if len(pending) >= ahead:
            if not waited:
                on_first_wait()
                waited = True
            yield pending.popleft().get()
    if pending and not waited:
        on_first_wait()
    while pending:
        yield pending.popleft().get()


class Progress:
    """What the packer is doing, on stderr: a 'docs, tokens and their rates' line every
    PROGRESS_EVERY_S while documents flow (with an ETA when the document count is known), and,
    while a step prints nothing (loading the tokenizer, opening a dataset, reading a large file,
    starting the tokenizer workers, writing the pack), a line naming the step once it has been
    quiet for QUIET_S and then every QUIET_S. A step that ends or fails sooner prints nothing, so
    an input error stays the only line. Use as a context manager (it starts and stops a watcher
    thread)."""

    def __init__(self, total_docs: int | None = None) -> None:
        self.t0 = self.last = time.perf_counter()
        self.total_docs = total_docs
        self._lock = threading.Lock()
        self._step: str | None = None
        self._step_t0 = self.t0
        self._done = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="pack-progress", daemon=True)

    def __enter__(self) -> Progress:
        self._watcher.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._watcher.join()

    def restart_clock(self) -> None:
        """Rates and ETA count from now (the tokenising), not from the loading before it."""
        with self._lock:
            self.t0 = time.perf_counter()

    def step(self, what: str) -> None:
        """Name the step that starts now (printed only if it stays quiet for QUIET_S)."""
        with self._lock:
            self._step, self._step_t0 = what, time.perf_counter()

    def _watch(self) -> None:
        while not self._done.wait(min(QUIET_S, 0.5)):
            with self._lock:
                now = time.perf_counter()
                if self._step is None or now - self.last < QUIET_S:
                    continue
                self.last = now
                line = f"pack: {self._step} ({now - self._step_t0:.0f} s) ..."
            print(line, file=sys.stderr, flush=True)

    def update(self, docs: int, tokens: int, final: bool = False) -> None:
        now = time.perf_counter()
        with self._lock:
            if not (final or now - self.last >= PROGRESS_EVERY_S):
                return
            self.last = now
        dt = max(now - self.t0, 1e-9)
        line = f"pack: {docs:,} docs ({docs / dt:,.0f}/s), {tokens:,} tokens ({tokens / dt:,.0f}/s)"
        if final:
            line += f", done in {dt:.1f}s"
        elif self.total_docs and docs:
            eta = (self.total_docs - docs) / (docs / dt)
            line += f", {100 * docs / self.total_docs:.1f}% of {self.total_docs:,} docs, ETA {eta:,.0f}s"
        print(line, file=sys.stderr, flush=True)


def _replace_problem(out: Path) -> str | None:
    """Why ``--force`` could not replace the existing ``out`` once the pack is written (it is
    built next to ``out``, then ``out`` is removed and the new pack renamed into place), else None.
    Checked before any tokenizing, so a long pack never fails at its very end."""
    from torchtitan_loom.config.io_checks import writable_dir_problem

    if out.is_symlink() or not out.is_dir():
        return "it is not a directory (a pack is one); remove it or choose another --out"
    if os.path.ismount(out):
        return (
            "it is a mount point, which cannot be removed and replaced; choose a folder inside "
            f"it, e.g. --out {str(out / 'pack')!r}"
        )
    problem = writable_dir_problem(str(out))
    if problem:
        return f"its old contents cannot be removed: it {problem}"
    return None


def run_pack(args: argparse.Namespace, created_by: str) -> Path:
    """Tokenise the inputs and write the pack (its metadata's ``created_by``: the writing tool's
    module); returns its directory."""
    if args.out.exists() and not args.force:
        raise PackInputError(f"--out {str(args.out)!r} already exists; pass --force to replace it")
    from torchtitan_loom.config.io_checks import writable_dir_problem

    problem = writable_dir_problem(
        str(args.out.parent)
    )  # the pack is written next to --out, then renamed
    if problem:
        raise PackInputError(
            f"--out {str(args.out)!r}: its folder {problem}; choose a writable place"
        )
    if args.out.exists() or args.out.is_symlink():
        problem = _replace_problem(args.out)
        if problem:
            raise PackInputError(f"--out {str(args.out)!r} --force: {problem}")
    if args.seq_len < 2 or args.epochs < 1 or args.workers < 1 or args.holdout_tokens < 0:
        raise PackInputError(
            "need --seq-len ≥ 2 (the record length: training.seq_len + 1), --epochs ≥ 1, "
            "--workers ≥ 1 and --holdout-tokens ≥ 0"
        )
    with Progress() as progress:
        return _tokenise_and_write(args, created_by, progress)


def _load_tokenizer(args: argparse.Namespace):
    try:
        return build_tokenizer(args.tokenizer, args.eos_token)
    except (ValueError, ImportError, OSError):
        raise
    except Exception as e:  # the tokenizers library raises its own bare Exception
        raise ValueError(
            f"--tokenizer {str(args.tokenizer)!r}: cannot load it ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else 'no message'}); pass 'byte' or a valid "
            f"tokenizer.json (or a directory holding one)"
        ) from None


def _tokenise_and_write(args: argparse.Namespace, created_by: str, progress: Progress) -> Path:
    progress.step(f"loading the tokenizer {str(args.tokenizer)!r}")
    tok = _load_tokenizer(args)
    # An absolute path: the tools read it back wherever they run (a relative one means relative to the pack).
    where = tok.name_or_path if tok.name_or_path == "byte" else os.path.abspath(tok.name_or_path)
    info = {"vocab_size": tok.vocab_size, "name_or_path": where, "eos_token_id": tok.eos_id}
    if args.hf_dataset:
        how = "streaming" if args.streaming else "a first use downloads and prepares it"
        progress.step(f"opening --hf-dataset {args.hf_dataset!r} ({how})")
    hf_rows, hf_total = open_hf_dataset(args) if args.hf_dataset else (None, None)
    # The ETA needs every input's document count: known when the HF dataset is the only input.
    only_hf = hf_rows is not None and not (args.jsonl or args.text or args.parquet)
    progress.total_docs = hf_total if only_hf else None
    extra: dict[str, Any] = {"created_by": created_by}
    if args.hf_dataset:
        extra["hf_dataset"] = {
            "name": args.hf_dataset,
            "config": args.hf_config,
            "split": None
            if saved_dataset(args.hf_dataset) and args.hf_split is None
            else args.hf_split or "train",
        }
    with PackWriter(args.out, info, args.seq_len, extra_metadata=extra) as w:
        reading = read_documents(args, hf_rows, on_source=lambda s: progress.step(f"reading {s}"))
        batches = _batches(reading)
        encoded: Iterator[list[np.ndarray]]  # each batch's documents as token ids
        if args.workers == 1:
            encoded = ([tok.encode_array(t) for t in b] for b in batches)
            pool = None
        else:
            progress.step(f"starting {args.workers} tokenizer worker processes")
            # forkserver, not fork: forking a process that runs threads (torch, loggers, a caller's
            # own) can deadlock the workers; seen as a hang of pool.terminate() after an input error.
            pool = mp.get_context("forkserver" if sys.platform == "linux" else "spawn").Pool(
                args.workers
            )
            encoded = _ordered_parallel(
                pool,
                args.tokenizer,
                args.eos_token,
                batches,
                4 * args.workers,
                lambda: progress.step(
                    f"tokenising the first documents ({args.workers} worker processes start up)"
                ),
            )
        progress.restart_clock()  # rates count the tokenising, not the loading before it
        try:
            for arrays in encoded:
                for ids in arrays:
                    w.add_document(ids)
                progress.update(w.num_documents, w.total_tokens)
        finally:
            if pool is not None:
                pool.terminate()
        progress.update(w.num_documents, w.total_tokens, final=True)
        progress.step(
            f"writing {args.epochs} orderings and {w.total_tokens:,} tokens into {str(args.out)!r}"
        )
        return w.finish(
            epochs=args.epochs,
            holdout_tokens=args.holdout_tokens,
            seed=args.seed,
            replace=args.force,
        )


def verify(path: Path) -> dict:
    """Validate the pack fully (every token id scanned) and return its statistics."""
    meta = read_metadata(path)
    vocab = int(meta["tokenizer_info"]["vocab_size"])
    pack = open_pack(path, seq_len=int(meta["max_seq_len"]) - 1, vocab_size=vocab, scan_tokens=True)
    lens = {k: pack.records(k)[1] for k in pack.epoch_dirs}
    train_lens = lens[pack.training_epochs[0]]
    hold = (
        lens.get(pack.holdout_epoch, np.zeros(0, np.int64))
        if pack.holdout_epoch is not None
        else np.zeros(0)
    )
    lo, hi = token_range(Path(path), Path(path) / "tokens.npy")  # memoised by open_pack's scan
    return {
        "path": str(path),
        "tokenizer": pack.tokenizer_name,
        "vocab_size": vocab,
        "eos_token_id": pack.eos_id,
        "max_seq_len": pack.max_seq_len,
        "tokens": len(pack.tokens),
        "token_dtype": str(pack.tokens.dtype),
        "token_id_range": [lo, hi] if len(pack.tokens) else [0, 0],
        "training_epochs": list(pack.training_epochs),
        "records_per_training_epoch": len(train_lens),
        "training_tokens_per_epoch": int(train_lens.sum()),
        "mean_record_length": round(float(train_lens.mean()), 2) if len(train_lens) else 0.0,
        "holdout_epoch": pack.holdout_epoch,
        "holdout_records": len(hold),
        "holdout_tokens": int(np.sum(hold)),
    }
