"""Packer CLI: corpus files → packed-document pack (LOOM_SPEC §8.1); `--verify DIR` checks one.

    python -m torchtitan_loom.tools.pack --jsonl 'data/*.jsonl' --tokenizer byte --out packs/mine
    python -m torchtitan_loom.tools.pack --hf-dataset HuggingFaceFW/fineweb-edu --hf-config sample-10BT \
        --streaming --tokenizer path/to/tokenizer.json --out packs/fineweb-edu
    python -m torchtitan_loom.tools.pack --verify packs/mine

Documents are read in input order (all --jsonl files, then --text, then --parquet, each list in
the order given with globs sorted, then the --hf-dataset rows in dataset order), tokenised in parallel by --workers processes (results are
consumed in order, so the pack does not depend on the number of workers), EOS-terminated and
chunked into records of --seq-len tokens.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import json
import multiprocessing as mp
import os
import re
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from torchtitan_loom.components.runtime import exit_codes
from torchtitan_loom.components.data.pack_format import PackError, open_pack, read_metadata
from torchtitan_loom.components.data.pack_writer import PackWriter
from torchtitan_loom.components.data.tokenizer import build_tokenizer
from torchtitan_loom.components.runtime.messages import shorten_line

DOCS_PER_TASK = 256  # documents sent to a worker at a time
PROGRESS_EVERY_S = 2.0  # seconds between progress lines on stderr


class PackInputError(ValueError):
    """Bad input to the packer: main prints its one line and exits 2."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torchtitan_loom.tools.pack",
        description="Tokenise a corpus into the packed-document format read by the trainer, "
        "or check an existing pack with --verify.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    src = p.add_argument_group("inputs (at least one, unless --verify)")
    src.add_argument(
        "--jsonl",
        nargs="+",
        default=[],
        metavar="FILE",
        help="JSON-lines files or globs; one document per line, text in --text-field",
    )
    src.add_argument(
        "--text",
        nargs="+",
        default=[],
        metavar="FILE",
        help="plain-text files or globs; split into documents per --text-split",
    )
    src.add_argument(
        "--parquet",
        nargs="+",
        default=[],
        metavar="FILE",
        help="parquet files or globs (needs pyarrow); one document per row, text in --text-field",
    )
    src.add_argument(
        "--hf-dataset",
        default=None,
        metavar="NAME",
        help="a Hugging Face dataset (needs the optional extra: pip install 'torchtitan_loom[data]'): "
        "a hub name, a builder such as parquet/json with --hf-data-files, or a directory "
        "written by Dataset.save_to_disk; one document per row, text in --text-field",
    )
    src.add_argument(
        "--hf-config", default=None, metavar="C", help="configuration (subset) of --hf-dataset"
    )
    src.add_argument(
        "--hf-split",
        default=None,
        metavar="S",
        help="split of --hf-dataset (default: train); a single saved Dataset has none",
    )
    src.add_argument(
        "--hf-data-files",
        nargs="+",
        default=None,
        metavar="FILE",
        help="data files of a builder --hf-dataset (parquet, json, text, ...)",
    )
    src.add_argument(
        "--streaming",
        action="store_true",
        help="read --hf-dataset row by row as it downloads, never materialising it (no Arrow cache)",
    )
    src.add_argument(
        "--text-field", default="text", help="field / column holding the text in jsonl and parquet"
    )
    src.add_argument(
        "--text-split",
        choices=("file", "blankline", "line"),
        default="file",
        help="how --text files split into documents: the whole file, paragraphs "
        "separated by blank lines, or single lines",
    )
    p.add_argument(
        "--tokenizer",
        default="byte",
        help="'byte' (built-in byte-level tokenizer) or a path to a Hugging Face tokenizer.json / its directory",
    )
    p.add_argument(
        "--eos-token",
        default=None,
        help="end-of-text token of a Hugging Face tokenizer; when unset: the one in tokenizer_config.json, "
        "else the first of <|endoftext|>, </s>, <eos> in the vocabulary)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output pack directory (must not exist unless --force)",
    )
    p.add_argument("--force", action="store_true", help="replace an existing --out directory")
    p.add_argument(
        "--seq-len",
        type=int,
        default=1024,
        help="record (chunk) length in tokens (metadata max_seq_len). A record of N tokens holds "
        "N - 1 inputs and their next-token targets, so it trains training.seq_len ≤ N - 1: "
        "--seq-len 1025 for training.seq_len 1024",
    )
    p.add_argument(
        "--epochs",
        type=int,
        default=9,
        help="number of shuffled training orderings epoch_0..epoch_{N-1}; the holdout is epoch_N",
    )
    p.add_argument(
        "--holdout-tokens",
        type=int,
        default=20_000_000,
        help="tokens held out for eval: the last records of the corpus, at most 10%% of records; 0 = none",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=min(8, os.cpu_count() or 1),
        help="tokenizer processes (output is identical for any number)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the training orderings (numpy default_rng)"
    )
    p.add_argument(
        "--verify",
        type=Path,
        default=None,
        metavar="DIR",
        help="check the pack in DIR, print its statistics, exit non-zero if it is invalid",
    )
    return p


def expand(patterns: list[str], flag: str) -> list[Path]:
    """Files matched by each pattern, in the order given, sorted within a glob."""
    files: list[Path] = []
    for pat in patterns:
        hits = (
            sorted(glob.glob(pat))
            if glob.has_magic(pat)
            else ([pat] if os.path.isfile(pat) else [])
        )
        if not hits:
            raise PackInputError(f"{flag} {pat!r} matches no file")
        files += [Path(h) for h in hits]
    return files


def _utf8(raw: bytes, path: Path, lineno: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PackInputError(
            f"{path}:{lineno}: not valid UTF-8 (byte {e.start} of the line: "
            f"{raw[e.start : e.start + 1]!r}); re-encode the file as UTF-8"
        ) from None


def _jsonl_docs(path: Path, field: str) -> Iterator[str]:
    with open(path, "rb") as f:  # decoded per line, so a bad byte is reported with its line
        for lineno, raw in enumerate(f, 1):
            line = _utf8(raw, path, lineno)
            if not line.strip():
                continue
            try:
                text = json.loads(line)[field]
            except (ValueError, KeyError, TypeError):
                raise PackInputError(
                    f"{path}:{lineno}: not a JSON object with a string field {field!r} "
                    "(set --text-field to the field holding the text)"
                ) from None
            if not isinstance(text, str):
                raise PackInputError(
                    f"{path}:{lineno}: field {field!r} is {type(text).__name__}, expected a string"
                )
            yield text


def _text_docs(path: Path, split: str) -> Iterator[str]:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        _utf8(
            raw[raw.rfind(b"\n", 0, e.start) + 1 :].split(b"\n", 1)[0],
            path,
            raw.count(b"\n", 0, e.start) + 1,
        )
        raise
    if split == "file":
        yield text
    elif split == "line":
        yield from (line for line in text.splitlines() if line.strip())
    else:
        yield from (
            para.strip("\r\n") for para in re.split(r"\r?\n[ \t]*\r?\n", text) if para.strip()
        )


def _parquet_docs(path: Path, field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PackInputError(
            "--parquet needs the optional pyarrow package: pip install torchtitan_loom[data]"
        ) from None
    pf = pq.ParquetFile(path)
    if field not in pf.schema_arrow.names:
        raise PackInputError(
            f"{path}: no column {field!r} (columns: {pf.schema_arrow.names}); set --text-field"
        )
    for g in range(pf.num_row_groups):
        yield from (
            t
            for t in pf.read_row_group(g, columns=[field]).column(field).to_pylist()
            if t is not None
        )


def open_hf_dataset(args: argparse.Namespace):
    """(rows, number of rows or None): --hf-dataset as a Dataset, or an IterableDataset with --streaming."""
    try:
        import datasets
    except ImportError:
        raise PackInputError(
            "--hf-dataset needs the optional datasets package: pip install 'torchtitan_loom[data]'"
        ) from None
    name, split = args.hf_dataset, args.hf_split or "train"
    if _saved_dataset(name):
        ds = datasets.load_from_disk(name)
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise PackInputError(f"--hf-split {split!r} not in {name!r} (splits: {list(ds)})")
            ds = ds[split]
        elif args.hf_split is not None:
            raise PackInputError(
                f"--hf-split {args.hf_split!r}: {name!r} is a single Dataset saved with "
                f"save_to_disk, it has no splits; leave --hf-split out"
            )
        total = len(ds)
        return (ds.to_iterable_dataset() if args.streaming else ds), total
    if _looks_like_path(name) and not os.path.exists(name):
        raise PackInputError(
            f"--hf-dataset {name!r}: no such directory; pass a folder written by "
            f"Dataset.save_to_disk, a hub name (owner/name) or a builder such as parquet"
        )
    try:
        ds = datasets.load_dataset(
            name,
            args.hf_config,
            split=split,
            data_files=args.hf_data_files,
            streaming=args.streaming,
        )
    except Exception as exc:  # noqa: BLE001 - datasets raises many types (not found, offline, bad config)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "no message"
        raise PackInputError(
            f"--hf-dataset {name!r}: cannot load it ({type(exc).__name__}: {first})"
        ) from None
    if not args.streaming:
        return ds, len(ds)
    splits = getattr(ds.info, "splits", None) or {}
    known = splits.get(args.hf_split) if hasattr(splits, "get") else None
    return ds, (known.num_examples or None) if known is not None else None


def _saved_dataset(name: str) -> bool:
    """A folder written by Dataset(Dict).save_to_disk."""
    return os.path.isdir(name) and any(
        os.path.isfile(os.path.join(name, f)) for f in ("dataset_info.json", "dataset_dict.json")
    )


def _looks_like_path(name: str) -> bool:
    """A local path rather than a hub name (``owner/name``) or a builder (``parquet``)."""
    return os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1


def _hf_docs(rows, field: str) -> Iterator[str]:
    for i, row in enumerate(rows):
        if field not in row:
            raise PackInputError(
                f"--hf-dataset row {i} has no column {field!r} (columns: {list(row)}); "
                "set --text-field"
            )
        if row[field] is not None:
            yield row[field]


def read_documents(args: argparse.Namespace, hf_rows=None) -> Iterator[str]:
    """All input documents in a fixed order."""
    for f in expand(args.jsonl, "--jsonl"):
        yield from _jsonl_docs(f, args.text_field)
    for f in expand(args.text, "--text"):
        yield from _text_docs(f, args.text_split)
    for f in expand(args.parquet, "--parquet"):
        yield from _parquet_docs(f, args.text_field)
    if hf_rows is not None:
        yield from _hf_docs(hf_rows, args.text_field)


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
    pool, name: str, eos_token: str | None, batches: Iterator[list[str]], ahead: int
) -> Iterator[list[np.ndarray]]:
    """Results in submission order (so the pack does not depend on the number of workers), with
    at most `ahead` batches in flight (Pool.imap would read the whole corpus into its queue)."""
    pending: collections.deque = collections.deque()
    for b in batches:
        pending.append(pool.apply_async(_encode_batch, ((name, eos_token, b),)))
        if len(pending) >= ahead:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


class Progress:
    """Periodic 'docs, tokens and their rates' line on stderr, with an ETA when the document count is known."""

    def __init__(self, total_docs: int | None = None) -> None:
        self.t0 = self.last = time.perf_counter()
        self.total_docs = total_docs

    def update(self, docs: int, tokens: int, final: bool = False) -> None:
        now = time.perf_counter()
        if final or now - self.last >= PROGRESS_EVERY_S:
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


def run_pack(args: argparse.Namespace) -> Path:
    """Tokenise the inputs and write the pack; returns its directory."""
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
    try:
        tok = build_tokenizer(args.tokenizer, args.eos_token)
    except (ValueError, ImportError, OSError):
        raise
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises its own bare Exception
        raise ValueError(
            f"--tokenizer {str(args.tokenizer)!r}: cannot load it ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else 'no message'}); pass 'byte' or a valid "
            f"tokenizer.json (or a directory holding one)"
        ) from None
    # An absolute path: the tools read it back wherever they run (a relative one means relative to the pack).
    where = tok.name_or_path if tok.name_or_path == "byte" else os.path.abspath(tok.name_or_path)
    info = {"vocab_size": tok.vocab_size, "name_or_path": where, "eos_token_id": tok.eos_id}
    hf_rows, hf_total = open_hf_dataset(args) if args.hf_dataset else (None, None)
    # The ETA needs every input's document count: known when the HF dataset is the only input.
    only_hf = hf_rows is not None and not (args.jsonl or args.text or args.parquet)
    progress = Progress(hf_total if only_hf else None)
    extra = {"created_by": "torchtitan_loom.tools.pack"}
    if args.hf_dataset:
        extra["hf_dataset"] = {
            "name": args.hf_dataset,
            "config": args.hf_config,
            "split": None
            if _saved_dataset(args.hf_dataset) and args.hf_split is None
            else args.hf_split or "train",
        }
    with PackWriter(args.out, info, args.seq_len, extra_metadata=extra) as w:
        batches = _batches(read_documents(args, hf_rows))
        if args.workers == 1:
            encoded = ([tok.encode_array(t) for t in b] for b in batches)
            pool = None
        else:
            # forkserver, not fork: forking a process that runs threads (torch, loggers, a caller's
            # own) can deadlock the workers; seen as a hang of pool.terminate() after an input error.
            pool = mp.get_context("forkserver" if sys.platform == "linux" else "spawn").Pool(
                args.workers
            )
            encoded = _ordered_parallel(
                pool, args.tokenizer, args.eos_token, batches, 4 * args.workers
            )
        try:
            for arrays in encoded:
                for ids in arrays:
                    w.add_document(ids)
                progress.update(w.num_documents, w.total_tokens)
        finally:
            if pool is not None:
                pool.terminate()
        progress.update(w.num_documents, w.total_tokens, final=True)
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
    toks = pack.tokens
    return {
        "path": str(path),
        "tokenizer": pack.tokenizer_name,
        "vocab_size": vocab,
        "eos_token_id": pack.eos_id,
        "max_seq_len": pack.max_seq_len,
        "tokens": int(len(toks)),
        "token_dtype": str(toks.dtype),
        "token_id_range": [
            int(toks.min()) if len(toks) else 0,
            int(toks.max()) if len(toks) else 0,
        ],
        "training_epochs": list(pack.training_epochs),
        "records_per_training_epoch": int(len(train_lens)),
        "training_tokens_per_epoch": int(train_lens.sum()),
        "mean_record_length": round(float(train_lens.mean()), 2) if len(train_lens) else 0.0,
        "holdout_epoch": pack.holdout_epoch,
        "holdout_records": int(len(hold)),
        "holdout_tokens": int(np.sum(hold)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verify is not None:
        if args.out is not None or args.jsonl or args.text or args.parquet or args.hf_dataset:
            parser.error(
                "--verify DIR checks an existing pack; do not combine it with inputs or --out"
            )
        try:
            stats = verify(args.verify)
        except PackError as e:
            print(shorten_line(f"error: {e}"), file=sys.stderr)
            return exit_codes.BAD_INPUT
        for k, v in stats.items():
            print(f"{k}: {v}")
        return exit_codes.OK
    if args.out is None or not (args.jsonl or args.text or args.parquet or args.hf_dataset):
        parser.error(
            "packing needs --out and at least one of --jsonl / --text / --parquet / --hf-dataset "
            "(or use --verify DIR)"
        )
    try:
        out = run_pack(args)
    except (
        ValueError,
        ImportError,
        OSError,
    ) as e:  # PackInputError, a tokenizer, a write that failed
        print(shorten_line(f"error: {e}"), file=sys.stderr)
        return exit_codes.BAD_INPUT
    print(f"wrote {out}", file=sys.stderr)
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
