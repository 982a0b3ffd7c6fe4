"""The packed-document format (LOOM_SPEC §8.1) and its validation.

A pack is a directory:

    tokens.npy              1-D token stream, uint16 (vocab ≤ 65,535) or uint32
    epoch_k/doc_start.npy   int64 [R_k]  start of each record in tokens.npy
    epoch_k/doc_len.npy     int32 [R_k]  length of each record (a chunk of ≤ max_seq_len tokens)
    metadata.json           tokenizer_info {vocab_size, name_or_path, eos_token_id},
                            max_seq_len, total_length, layout = "document"

`epoch_0 … epoch_{n-1}` are the training orderings (shuffled records); one more epoch directory
holds the holdout records in corpus order. Which one: `metadata["holdout_epoch"]` when the key is
present (our packer writes it; null = no holdout); otherwise, as in packs of the LOOM reference
packer, `epoch_9` if it exists, else the pack has no holdout.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from torchtitan_loom.components.data.pack_arrays import first_bad_token, load_array, token_range
from torchtitan_loom.components.data.pack_error import REPACK, PackError, fail
from torchtitan_loom.components.data.pack_metadata import read_metadata
from torchtitan_loom.components.data.tokenizer import same_tokenizer_name

__all__ = ["Pack", "PackError", "open_pack", "read_metadata", "token_dtype"]

REFERENCE_HOLDOUT_EPOCH = 9
_EPOCH_DIR = re.compile(r"^epoch_(\d+)$")


def token_dtype(vocab_size: int) -> np.dtype:
    """Storage dtype of tokens.npy for a tokenizer of `vocab_size` ids."""
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.uint32)


class Pack:
    """An opened, validated pack. `tokens` is a read-only memory map of tokens.npy."""

    def __init__(self, path: Path, metadata: dict, epochs: dict[int, Path], tokens: np.ndarray):
        self.path = path
        self.metadata = metadata
        info = metadata["tokenizer_info"]
        self.tokenizer_name = str(info.get("name_or_path", ""))
        self.tokenizer_vocab_size = int(info["vocab_size"])
        self.eos_id = int(info["eos_token_id"])
        self.max_seq_len = int(metadata["max_seq_len"])
        self.epoch_dirs = dict(sorted(epochs.items()))
        self.holdout_epoch = _holdout_index(metadata, self.epoch_dirs)
        self.training_epochs = tuple(k for k in self.epoch_dirs if k != self.holdout_epoch)
        self.tokens = tokens

    # A memory map must not be pickled (it would copy the whole stream into the pickle): loader
    # workers receive the path and map the file again.
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("tokens")
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.tokens = load_array(self.path, self.path / "tokens.npy")

    def records(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(doc_start int64 [R], doc_len int64 [R]) of epoch directory `epoch`, in stored order."""
        d = self.epoch_dirs[epoch]
        start = load_array(self.path, d / "doc_start.npy", mmap=False).astype(np.int64, copy=False)
        length = load_array(self.path, d / "doc_len.npy", mmap=False).astype(np.int64, copy=False)
        return start, length

    def __repr__(self) -> str:
        return (
            f"Pack({str(self.path)!r}, tokens={len(self.tokens)}, max_seq_len={self.max_seq_len}, "
            f"training_epochs={list(self.training_epochs)}, holdout_epoch={self.holdout_epoch})"
        )


def _holdout_index(metadata: dict, epochs: dict[int, Path]) -> int | None:
    if "holdout_epoch" in metadata:
        h = metadata["holdout_epoch"]
        return None if h is None else int(h)
    return REFERENCE_HOLDOUT_EPOCH if REFERENCE_HOLDOUT_EPOCH in epochs else None


def _find_epochs(path: Path) -> dict[int, Path]:
    epochs = {
        int(m.group(1)): p for p in path.iterdir() if p.is_dir() and (m := _EPOCH_DIR.match(p.name))
    }
    if not epochs:
        raise fail(
            path, "no epoch_k directories", "a pack needs epoch_0 (and usually more orderings)"
        )
    return epochs


def _check_epoch(path: Path, k: int, d: Path, n_tokens: int) -> None:
    """Both record arrays present, 1-D integer, of equal length, inside the token stream."""
    arrays = {}
    for name in ("doc_start.npy", "doc_len.npy"):
        if not os.path.lexists(d / name):
            raise fail(
                path,
                f"epoch_{k}/{name} is missing",
                "every epoch_k directory holds doc_start.npy (int64) and doc_len.npy (int32)",
            )
        arrays[name] = load_array(path, d / name)  # 1-D integer, size matching its header
    start, length = arrays["doc_start.npy"], arrays["doc_len.npy"]
    if len(start) != len(length):
        raise fail(
            path,
            f"epoch_{k} has {len(start)} doc_start entries but {len(length)} doc_len entries",
            "both files must have one entry per record",
        )
    if len(start) == 0:
        return
    start64, len64 = start.astype(np.int64), length.astype(np.int64)
    # start > n - len, not start + len > n: a damaged start near 2^63 would wrap the sum around.
    bad = (start64 < 0) | (len64 < 1) | (len64 > n_tokens) | (start64 > n_tokens - len64)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise fail(
            path,
            f"epoch_{k} record {i} (start {int(start64[i])}, length {int(len64[i])}) "
            f"lies outside tokens.npy ({n_tokens} tokens)",
            "every record needs length ≥ 1 and start + length ≤ the number of tokens",
        )


def open_pack(
    path: str | Path,
    seq_len: int,
    vocab_size: int,
    tokenizer_name: str | None = None,
    scan_tokens: bool | None = None,
) -> Pack:
    """Open and validate the pack at `path` for a model of sequence length `seq_len` and
    vocabulary `vocab_size`. Raises PackError (a ValueError) naming the first problem found.

    Every token id is checked against `vocab_size` here (a scan of the stream, memoised in
    memory per file, see pack_arrays.py), so a damaged id is this error, not an IndexError at
    step 1. `scan_tokens=False` skips the scan and trusts metadata["max_token_id"] instead.
    """
    path = Path(path)
    if not path.is_dir():
        raise fail(path, "no such directory", "pass the directory written by the packer")
    meta = read_metadata(path)
    tok_file = path / "tokens.npy"
    if not os.path.lexists(tok_file):
        raise fail(path, "tokens.npy is missing", "a pack holds its token stream in tokens.npy")
    tokens = load_array(path, tok_file)
    _check_token_dtype(path, tokens.dtype, int(meta["tokenizer_info"]["vocab_size"]))
    if int(meta["total_length"]) != len(tokens):
        raise fail(
            path,
            f"metadata total_length {meta['total_length']} != {len(tokens)} tokens in tokens.npy",
            "the two must agree (the pack is incomplete or was edited)",
        )
    epochs = _find_epochs(path)
    holdout = _holdout_index(meta, epochs)
    orderings = sorted(k for k in epochs if k != holdout)
    if orderings != list(range(len(orderings))):
        missing = sorted(set(range(max(orderings, default=0) + 1)) - set(orderings)) or [0]
        raise fail(
            path,
            f"epoch_{missing[0]} is missing (training orderings present: {orderings})",
            "training orderings are epoch_0 … epoch_(n-1) without gaps; re-pack the corpus",
        )
    for k, d in sorted(epochs.items()):
        _check_epoch(path, k, d, len(tokens))
    pack = Pack(path, meta, epochs, tokens)
    if pack.holdout_epoch is not None and pack.holdout_epoch not in epochs:
        raise fail(
            path,
            f"metadata holdout_epoch {pack.holdout_epoch} has no epoch_{pack.holdout_epoch} directory",
            f"existing epochs are {sorted(epochs)}",
        )
    if not pack.training_epochs:
        raise fail(
            path,
            "no training ordering (only the holdout epoch exists)",
            "a pack needs epoch_0 at least",
        )
    _check_against_model(pack, seq_len, vocab_size, tokenizer_name, scan_tokens)
    return pack


def _check_against_model(
    pack: Pack, seq_len: int, vocab_size: int, tokenizer_name: str | None, scan_tokens: bool | None
) -> None:
    path = pack.path
    if seq_len < 1 or seq_len > pack.max_seq_len - 1:
        raise fail(
            path,
            f"seq_len {seq_len} does not fit its records of up to max_seq_len "
            f"{pack.max_seq_len} tokens",
            f"valid seq_len is 1..{pack.max_seq_len - 1} (max_seq_len - 1, one token is the label shift)",
        )
    if tokenizer_name is not None and not same_tokenizer_name(tokenizer_name, pack.tokenizer_name):
        raise fail(
            path,
            f"it was tokenised with {pack.tokenizer_name!r}, the config asks for {tokenizer_name!r}",
            "use the tokenizer the pack was written with, or re-pack the corpus",
        )
    if not 0 <= pack.eos_id < vocab_size:
        raise fail(
            path,
            f"EOS id {pack.eos_id} is outside the model vocabulary of {vocab_size}",
            f"the model's vocab_size must exceed every token id (≥ {pack.tokenizer_vocab_size})",
        )
    valid = (
        f"the model's vocab_size must be > every token id (the pack's tokenizer has "
        f"{pack.tokenizer_vocab_size} ids)"
    )
    recorded = int(pack.metadata.get("max_token_id", -1))
    if recorded >= vocab_size:  # what the packer saw: the pack is for a larger vocabulary
        raise fail(path, f"token id {recorded} is ≥ the model vocab_size {vocab_size}", valid)
    if scan_tokens is False:
        return
    lo, hi = token_range(path, path / "tokens.npy")
    if lo < 0 or hi >= vocab_size:  # ids the packer never wrote: the stream is damaged
        pos, tid = first_bad_token(pack.tokens, vocab_size) or (-1, hi if hi >= vocab_size else lo)
        what = "negative" if tid < 0 else f"≥ the model vocab_size {vocab_size}"
        raise fail(
            path,
            f"token id {tid} is {what} (tokens.npy position {pos:,} of {len(pack.tokens):,}, "
            f"the first bad one)",
            f"{valid}; {REPACK}",
        )


def _check_token_dtype(path: Path, dtype: np.dtype, vocab_size: int) -> None:
    """tokens.npy's dtype can hold every id of the pack's tokenizer (a uint16 stream of a
    100k-id tokenizer has lost the high bits of its ids)."""
    bits = dtype.itemsize * 8 - (1 if dtype.kind == "i" else 0)
    if vocab_size > 1 << bits:
        raise fail(
            path,
            f"tokens.npy stores {dtype} but the tokenizer has {vocab_size:,} ids (ids ≥ "
            f"{1 << bits:,} do not fit)",
            f"a stream needs uint32 for more than 65,536 ids; {REPACK}",
        )
