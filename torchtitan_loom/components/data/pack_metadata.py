"""Reading a pack's metadata.json: a small regular file, valid JSON, and every field the code uses
of the right type and range, so a damaged value is one PackError line when the pack is opened
(naming the file, the key, the value and what is valid), never a traceback later.

What is checked, and why these bounds:

    tokenizer_info.vocab_size    int 1..2^32        token ids are stored as uint16 / uint32
    tokenizer_info.eos_token_id  int 0..2^32-1      a token id (the model check bounds it further)
    tokenizer_info.name_or_path  string             compared with the config's tokenizer
    max_seq_len                  int 2..2^31-1      doc_len.npy is int32; a record needs 2 tokens
    total_length                 int 0..2^48        checked against tokens.npy when it is opened
    layout                       "document"
    holdout_epoch                null or int 0..10^6
    max_token_id                 int -1..2^32-1     (-1: an empty stream)
    counts our packer writes     int ≥ 0            num_documents, num_records, training_epochs, ...
"""

from __future__ import annotations

import json
from pathlib import Path

from torchtitan_loom.components.data.pack_error import REPACK, fail, shown
from torchtitan_loom.components.runtime.safe_files import UnsafePathError, read_text

# Our packer writes well under 1 KiB; anything near this is damage, not metadata (and reading it
# whole into memory would be the damage's cost).
METADATA_MAX_BYTES = 1 << 20
MAX_TOKEN_SPACE = 1 << 32  # ids fit uint32, the widest token dtype
MAX_RECORD_LEN = (1 << 31) - 1  # doc_len.npy is int32
MAX_TOTAL_LENGTH = 1 << 48  # ~280 trillion tokens: more is a damaged number, not a corpus
MAX_EPOCH_INDEX = 10**6
# Counts our packer records for information; checked only for type and sign (nothing reads them).
_INFO_COUNTS = (
    "format_version",
    "num_documents",
    "num_records",
    "training_epochs",
    "holdout_records",
    "holdout_tokens",
    "seed",
)
_LAYOUT = (
    "it needs tokenizer_info {vocab_size, name_or_path, eos_token_id}, max_seq_len, total_length "
    "and layout"
)


def read_metadata(path: Path) -> dict:
    """metadata.json of the pack directory ``path``, with every field the code uses validated."""
    path = Path(path)
    meta = _parse(path, path / "metadata.json")
    info = meta.get("tokenizer_info")
    missing = [k for k in ("max_seq_len", "total_length") if k not in meta]
    if not isinstance(info, dict):
        missing.append("tokenizer_info")
    else:
        missing += [f"tokenizer_info.{k}" for k in ("vocab_size", "eos_token_id") if k not in info]
    if missing:
        raise fail(path, f"metadata.json lacks {missing}", _LAYOUT)
    assert isinstance(info, dict)  # else "tokenizer_info" would be in missing
    if meta.get("layout", "document") != "document":
        raise fail(
            path,
            f"metadata.json layout is {shown(meta['layout'])}",
            "only layout 'document' is supported",
        )
    _int(path, "tokenizer_info.vocab_size", info["vocab_size"], 1, MAX_TOKEN_SPACE)
    _int(path, "tokenizer_info.eos_token_id", info["eos_token_id"], 0, MAX_TOKEN_SPACE - 1)
    if not isinstance(info.get("name_or_path", ""), str):
        raise fail(
            path,
            f"metadata.json key 'tokenizer_info.name_or_path' is {shown(info['name_or_path'])}",
            "it must be a string: 'byte' or the tokenizer.json path the pack was written with",
        )
    _int(path, "max_seq_len", meta["max_seq_len"], 2, MAX_RECORD_LEN, "the record length")
    _int(path, "total_length", meta["total_length"], 0, MAX_TOTAL_LENGTH, "tokens in tokens.npy")
    if meta.get("holdout_epoch") is not None:
        _int(path, "holdout_epoch", meta["holdout_epoch"], 0, MAX_EPOCH_INDEX, "or null")
    if "max_token_id" in meta:
        _int(path, "max_token_id", meta["max_token_id"], -1, MAX_TOKEN_SPACE - 1)
    for key in _INFO_COUNTS:
        if key in meta:
            _int(path, key, meta[key], 0, MAX_TOTAL_LENGTH)
    return meta


def _parse(path: Path, meta_file: Path) -> dict:
    """The JSON object in ``meta_file``, read without following a link or blocking on a FIFO and
    at most METADATA_MAX_BYTES long."""
    if meta_file.is_dir() and not meta_file.is_symlink():
        raise fail(path, "metadata.json is a directory", "it must be the packer's JSON file")
    try:
        text = read_text(str(meta_file), METADATA_MAX_BYTES)
    except FileNotFoundError:
        raise fail(
            path,
            "metadata.json is missing",
            "a pack directory holds metadata.json, tokens.npy and epoch_k/ directories "
            "(write one with `python -m torchtitan_loom.tools.pack`)",
        ) from None
    except UnsafePathError as exc:  # a link, a FIFO or device, or an oversized file
        raise fail(
            path,
            f"metadata.json refused: {exc}",
            f"it must be a regular JSON file of at most {METADATA_MAX_BYTES:,} bytes; {REPACK}",
        ) from None
    except OSError as exc:
        raise fail(path, f"metadata.json is unreadable ({exc.strerror or exc})", REPACK) from None
    try:
        meta = json.loads(text)
    except RecursionError:  # json's C parser recurses once per nesting level
        raise fail(
            path, "metadata.json is not valid JSON (nested too deeply to parse)", REPACK
        ) from None
    except ValueError as exc:
        raise fail(path, f"metadata.json is not valid JSON ({exc})", REPACK) from None
    if not isinstance(meta, dict):
        raise fail(path, f"metadata.json holds {shown(meta)}, not a JSON object", _LAYOUT)
    return meta


def _int(path: Path, key: str, value: object, lo: int, hi: int, what: str = "") -> int:
    """``value`` when it is a JSON integer in lo..hi (not a bool, not a float such as 3.0 or 1e999),
    else a PackError naming the key, the value and the valid range."""
    if type(value) is not int or not lo <= value <= hi:
        note = f" ({what})" if what else ""
        raise fail(
            path,
            f"metadata.json key {key!r} is {shown(value)}",
            f"it must be an integer in {lo}..{hi:,}{note}; {REPACK}",
        )
    return value
