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

import json
import re
from pathlib import Path

import numpy as np

from torchtitan_loom.components.data.tokenizer import same_tokenizer_name

REFERENCE_HOLDOUT_EPOCH = 9
_EPOCH_DIR = re.compile(r"^epoch_(\d+)$")
_SCAN_BLOCK = 1 << 26  # tokens per block when scanning for the largest id (bounded memory)


class PackError(ValueError):
    """A pack that cannot be used: the message names the pack, the problem and what is valid."""


def token_dtype(vocab_size: int) -> np.dtype:
    """Storage dtype of tokens.npy for a tokenizer of `vocab_size` ids."""
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.uint32)


class Pack:
    """An opened, validated pack. `tokens` is a read-only memory map of tokens.npy."""

    def __init__(self, path: Path, metadata: dict, epochs: dict[int, Path]):
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
        self.tokens = np.load(path / "tokens.npy", mmap_mode="r")

    # A memory map must not be pickled (it would copy the whole stream into the pickle): loader
    # workers receive the path and map the file again.
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("tokens")
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.tokens = np.load(self.path / "tokens.npy", mmap_mode="r")

    def records(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(doc_start int64 [R], doc_len int64 [R]) of epoch directory `epoch`, in stored order."""
        d = self.epoch_dirs[epoch]
        start = np.load(d / "doc_start.npy").astype(np.int64, copy=False)
        length = np.load(d / "doc_len.npy").astype(np.int64, copy=False)
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


def _fail(path: Path, problem: str, valid: str) -> PackError:
    return PackError(f"pack {str(path)!r}: {problem}; {valid}")


def _load_array(path: Path, f: Path, mmap_mode: str | None = "r") -> np.ndarray:
    """np.load with a truncated or damaged file reported as a PackError naming it."""
    try:
        return np.load(f, mmap_mode=mmap_mode)
    except (ValueError, OSError, EOFError) as e:
        raise _fail(
            path,
            f"{f.relative_to(path)} is truncated or unreadable ({e})",
            "re-pack the corpus (python -m torchtitan_loom.tools.pack) or restore the file",
        ) from None


def read_metadata(path: Path) -> dict:
    """metadata.json of a pack, with the required keys checked."""
    meta_file = path / "metadata.json"
    if not meta_file.is_file():
        raise _fail(
            path,
            "metadata.json is missing",
            "a pack directory holds metadata.json, tokens.npy and epoch_k/ directories "
            "(write one with `python -m torchtitan_loom.tools.pack`)",
        )
    try:
        meta = json.loads(meta_file.read_text())
    except ValueError as e:
        raise _fail(path, f"metadata.json is not valid JSON ({e})", "rewrite the pack") from None
    info = meta.get("tokenizer_info")
    missing = [k for k in ("max_seq_len", "total_length") if k not in meta]
    if not isinstance(info, dict):
        missing.append("tokenizer_info")
    else:
        missing += [f"tokenizer_info.{k}" for k in ("vocab_size", "eos_token_id") if k not in info]
    if missing:
        raise _fail(
            path,
            f"metadata.json lacks {missing}",
            "it needs tokenizer_info {vocab_size, name_or_path, eos_token_id}, "
            "max_seq_len, total_length and layout",
        )
    if meta.get("layout", "document") != "document":
        raise _fail(
            path,
            f"metadata.json layout is {meta['layout']!r}",
            "only layout 'document' is supported",
        )
    return meta


def _find_epochs(path: Path) -> dict[int, Path]:
    epochs = {
        int(m.group(1)): p for p in path.iterdir() if p.is_dir() and (m := _EPOCH_DIR.match(p.name))
    }
    if not epochs:
        raise _fail(
            path, "no epoch_k directories", "a pack needs epoch_0 (and usually more orderings)"
        )
    return epochs


def _check_epoch(path: Path, k: int, d: Path, n_tokens: int) -> None:
    """Both record arrays present, 1-D integer, of equal length, inside the token stream."""
    arrays = {}
    for name in ("doc_start.npy", "doc_len.npy"):
        f = d / name
        if not f.is_file():
            raise _fail(
                path,
                f"epoch_{k}/{name} is missing",
                "every epoch_k directory holds doc_start.npy (int64) and doc_len.npy (int32)",
            )
        a = _load_array(path, f)
        if a.ndim != 1 or a.dtype.kind not in "iu":
            raise _fail(
                path,
                f"epoch_{k}/{name} has dtype {a.dtype} and shape {a.shape}",
                "it must be a 1-D integer array",
            )
        arrays[name] = a
    start, length = arrays["doc_start.npy"], arrays["doc_len.npy"]
    if len(start) != len(length):
        raise _fail(
            path,
            f"epoch_{k} has {len(start)} doc_start entries but {len(length)} doc_len entries",
            "both files must have one entry per record",
        )
    if len(start) == 0:
        return
    start64, len64 = start.astype(np.int64), length.astype(np.int64)
    bad = (start64 < 0) | (len64 < 1) | (start64 + len64 > n_tokens)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise _fail(
            path,
            f"epoch_{k} record {i} (start {int(start64[i])}, length {int(len64[i])}) "
            f"lies outside tokens.npy ({n_tokens} tokens)",
            "every record needs length ≥ 1 and start + length ≤ the number of tokens",
        )


def max_token_id(tokens: np.ndarray) -> int:
    """Largest id in the stream, scanned in blocks so memory stays bounded."""
    top = -1
    for lo in range(0, len(tokens), _SCAN_BLOCK):
        top = max(top, int(np.max(tokens[lo : lo + _SCAN_BLOCK])))
    return top


def open_pack(
    path: str | Path,
    seq_len: int,
    vocab_size: int,
    tokenizer_name: str | None = None,
    scan_tokens: bool | None = None,
) -> Pack:
    """Open and validate the pack at `path` for a model of sequence length `seq_len` and
    vocabulary `vocab_size`. Raises PackError (a ValueError) naming the first problem found.

    The largest token id is taken from metadata["max_token_id"] when the packer recorded it
    (a full scan of a multi-GB stream on every start would be slow); `scan_tokens=True` forces
    the scan, `False` skips it, `None` scans only when the metadata has no max_token_id.
    """
    path = Path(path)
    if not path.is_dir():
        raise _fail(path, "no such directory", "pass the directory written by the packer")
    meta = read_metadata(path)
    tok_file = path / "tokens.npy"
    if not tok_file.is_file():
        raise _fail(path, "tokens.npy is missing", "a pack holds its token stream in tokens.npy")
    tokens = _load_array(path, tok_file)
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise _fail(
            path,
            f"tokens.npy has dtype {tokens.dtype} and shape {tokens.shape}",
            "it must be a 1-D unsigned integer array (uint16 or uint32)",
        )
    if int(meta["total_length"]) != len(tokens):
        raise _fail(
            path,
            f"metadata total_length {meta['total_length']} != {len(tokens)} tokens in tokens.npy",
            "the two must agree (the pack is incomplete or was edited)",
        )
    epochs = _find_epochs(path)
    holdout = _holdout_index(meta, epochs)
    orderings = sorted(k for k in epochs if k != holdout)
    if orderings != list(range(len(orderings))):
        missing = sorted(set(range(max(orderings, default=0) + 1)) - set(orderings)) or [0]
        raise _fail(
            path,
            f"epoch_{missing[0]} is missing (training orderings present: {orderings})",
            "training orderings are epoch_0 … epoch_(n-1) without gaps; re-pack the corpus",
        )
    for k, d in sorted(epochs.items()):
        _check_epoch(path, k, d, len(tokens))
    pack = Pack(path, meta, epochs)
    if pack.holdout_epoch is not None and pack.holdout_epoch not in epochs:
        raise _fail(
            path,
            f"metadata holdout_epoch {pack.holdout_epoch} has no epoch_{pack.holdout_epoch} directory",
            f"existing epochs are {sorted(epochs)}",
        )
    if not pack.training_epochs:
        raise _fail(
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
        raise _fail(
            path,
            f"seq_len {seq_len} does not fit its records of up to max_seq_len "
            f"{pack.max_seq_len} tokens",
            f"valid seq_len is 1..{pack.max_seq_len - 1} (max_seq_len - 1, one token is the label shift)",
        )
    if tokenizer_name is not None and not same_tokenizer_name(tokenizer_name, pack.tokenizer_name):
        raise _fail(
            path,
            f"it was tokenised with {pack.tokenizer_name!r}, the config asks for {tokenizer_name!r}",
            "use the tokenizer the pack was written with, or re-pack the corpus",
        )
    if not 0 <= pack.eos_id < vocab_size:
        raise _fail(
            path,
            f"EOS id {pack.eos_id} is outside the model vocabulary of {vocab_size}",
            f"the model's vocab_size must exceed every token id (≥ {pack.tokenizer_vocab_size})",
        )
    recorded = pack.metadata.get("max_token_id")
    if scan_tokens or (scan_tokens is None and recorded is None):
        top = max_token_id(pack.tokens)
    else:
        top = -1 if recorded is None else int(recorded)
    if top >= vocab_size:
        raise _fail(
            path,
            f"token id {top} is ≥ the model vocab_size {vocab_size}",
            f"the model's vocab_size must be > every token id (the pack's tokenizer has "
            f"{pack.tokenizer_vocab_size} ids)",
        )
