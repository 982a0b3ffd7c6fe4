"""Where a pack's documents come from: --jsonl, --text, --parquet files and a Hugging Face
dataset (--hf-dataset), read in one fixed order (all --jsonl files, then --text, then --parquet,
each list in the order given with globs sorted, then the dataset's rows in dataset order). A bad
input raises PackInputError with one line naming the file (and line) and what is valid.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import stat
from collections.abc import Callable, Iterator
from pathlib import Path


class PackInputError(ValueError):
    """Bad input to the packer: main prints its one line and exits 2."""


def expand(patterns: list[str], flag: str) -> list[Path]:
    """Files matched by each pattern, in the order given, sorted within a glob."""
    files: list[Path] = []
    for pat in patterns:
        hits = sorted(glob.glob(pat)) if glob.has_magic(pat) else ([pat] if _readable(pat) else [])
        if not hits:
            raise PackInputError(f"{flag} {pat!r} matches no file")
        files += [Path(h) for h in hits]
    return files


def _readable(path: str) -> bool:
    """A regular file, or a named pipe (``--jsonl <(zcat corpus.jsonl.gz)`` passes /dev/fd/N)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return stat.S_ISREG(mode) or stat.S_ISFIFO(mode)


def _size(path: Path) -> str:
    """A file's size for the progress line ('a pipe' when it has none)."""
    try:
        st = os.stat(path)
    except OSError:
        return "unreadable"
    return f"{st.st_size / 1e6:,.1f} MB" if stat.S_ISREG(st.st_mode) else "a pipe"


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
    if saved_dataset(name):
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
    except Exception as exc:  # datasets raises many types (not found, offline, bad config)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "no message"
        raise PackInputError(
            f"--hf-dataset {name!r}: cannot load it ({type(exc).__name__}: {first})"
        ) from None
    if not args.streaming:
        return ds, len(ds)
    splits = getattr(ds.info, "splits", None) or {}
    known = splits.get(args.hf_split) if hasattr(splits, "get") else None
    return ds, (known.num_examples or None) if known is not None else None


def saved_dataset(name: str) -> bool:
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


def read_documents(
    args: argparse.Namespace,
    hf_rows=None,
    on_source: Callable[[str], None] = lambda source: None,
) -> Iterator[str]:
    """All input documents in a fixed order; ``on_source`` names each source as reading starts
    (the packer's progress names it when the read is slow)."""
    files = [
        *((f, _jsonl_docs, args.text_field) for f in expand(args.jsonl, "--jsonl")),
        *((f, _text_docs, args.text_split) for f in expand(args.text, "--text")),
        *((f, _parquet_docs, args.text_field) for f in expand(args.parquet, "--parquet")),
    ]
    for i, (f, docs, option) in enumerate(files, 1):
        on_source(f"{str(f)!r} (file {i} of {len(files)}, {_size(f)})")
        yield from docs(f, option)
    if hf_rows is not None:
        on_source(f"the rows of --hf-dataset {args.hf_dataset!r}")
        yield from _hf_docs(hf_rows, args.text_field)
