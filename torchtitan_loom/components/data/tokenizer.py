"""Tokenizers: a byte-level tokenizer that needs nothing installed, and a Hugging Face
`tokenizer.json` loader through the optional `tokenizers` package.

Both expose the same small surface used by the packer and the trainer:
`name_or_path`, `vocab_size`, `eos_id`, `pad_id`, `encode(text) -> list[int]`,
`encode_array(text) -> np.ndarray` (int64, no special tokens added) and `decode(ids) -> str`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import numpy as np

BYTE_TOKENIZER_NAME = "byte"
# Common end-of-text spellings, tried in this order when no EOS token is given explicitly.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
INSTALL_HINT = "pip install torchtitan_loom[data]"


class Tokenizer(Protocol):
    """What the packer and the trainer need from a tokenizer."""

    name_or_path: str
    vocab_size: int
    eos_id: int
    pad_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def encode_array(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are bytes, 256 = EOS, 257 = PAD (vocab_size 258)."""

    name_or_path = BYTE_TOKENIZER_NAME
    vocab_size = 258
    eos_id = 256
    pad_id: int | None = 257  # declared as the Tokenizer protocol has it

    def encode(self, text: str) -> list[int]:
        """Bytes of `text` as ids; no EOS is appended (the packer appends it)."""
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """Same as `encode`, as an int64 array (fast path for the packer)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        """Bytes back to text; special ids are dropped, invalid UTF-8 is replaced."""
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")


def _tokenizer_json_path(name_or_path: str | Path) -> Path:
    p = Path(name_or_path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ValueError(
            f"tokenizer {str(name_or_path)!r}: no such file; valid values are "
            f"'{BYTE_TOKENIZER_NAME}', a path to a tokenizer.json file, or a directory containing one"
        )
    return p


def _eos_from_config(json_path: Path) -> str | None:
    """The EOS token named in a tokenizer_config.json next to tokenizer.json, if any."""
    cfg = json_path.parent / "tokenizer_config.json"
    if not cfg.is_file():
        return None
    try:
        eos = json.loads(cfg.read_text()).get("eos_token")
    except (OSError, ValueError):
        return None
    if isinstance(eos, dict):  # HF sometimes stores {"content": "...", ...}
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


class HFTokenizer:
    """A Hugging Face `tokenizer.json` loaded with the `tokenizers` package.

    The EOS id comes from `eos_token` when given, else from `tokenizer_config.json` next to the
    file, else from the first of `EOS_CANDIDATES` present in the vocabulary.
    """

    def __init__(self, name_or_path: str | Path, eos_token: str | None = None):
        try:
            from tokenizers import Tokenizer as _HFTok
        except ImportError as e:
            raise ImportError(
                f"loading the tokenizer {str(name_or_path)!r} needs the optional `tokenizers` "
                f"package: {INSTALL_HINT} (or use the built-in tokenizer '{BYTE_TOKENIZER_NAME}')"
            ) from e
        json_path = _tokenizer_json_path(name_or_path)
        self._tok = _HFTok.from_file(str(json_path))
        self.name_or_path = str(name_or_path)
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.eos_id = self._find_eos(eos_token, json_path)
        pad = self._tok.token_to_id("<pad>")
        self.pad_id = int(pad) if pad is not None else None

    def _find_eos(self, eos_token: str | None, json_path: Path) -> int:
        if eos_token is not None:
            tid = self._tok.token_to_id(eos_token)
            if tid is None:
                raise ValueError(
                    f"tokenizer {self.name_or_path!r}: eos token {eos_token!r} is not in its "
                    f"vocabulary; pass a token that is (e.g. one of {list(EOS_CANDIDATES)})"
                )
            return int(tid)
        for cand in (_eos_from_config(json_path), *EOS_CANDIDATES):
            tid = self._tok.token_to_id(cand) if cand is not None else None
            if tid is not None:
                return int(tid)
        raise ValueError(
            f"tokenizer {self.name_or_path!r}: cannot guess the end-of-text token (none of "
            f"{list(EOS_CANDIDATES)} is in the vocabulary); name it explicitly (packer flag --eos-token)"
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` without special tokens (the packer appends EOS itself)."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_array(self, text: str) -> np.ndarray:
        """Same as `encode`, as an int64 array."""
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        """Ids back to text, special tokens skipped."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def build_tokenizer(name_or_path: str | Path, eos_token: str | None = None) -> Tokenizer:
    """'byte' → ByteTokenizer; a tokenizer.json path (or a directory holding one) → HFTokenizer."""
    if str(name_or_path) == BYTE_TOKENIZER_NAME:
        if eos_token is not None:
            raise ValueError(
                f"eos_token {eos_token!r}: the byte tokenizer has a fixed EOS (id 256); leave it unset"
            )
        return ByteTokenizer()
    _tokenizer_json_path(name_or_path)  # clear error before importing anything
    return HFTokenizer(name_or_path, eos_token=eos_token)


def same_tokenizer_name(a: str, b: str) -> bool:
    """Whether two tokenizer names refer to the same tokenizer, ignoring where it is stored
    ('/x/SmolLM/tokenizer.json', '/y/SmolLM/' and 'HuggingFaceTB/SmolLM' all match 'SmolLM')."""

    def key(name: str) -> str:
        parts = [p for p in str(name).replace("\\", "/").split("/") if p]
        if parts and parts[-1] == "tokenizer.json":
            parts = parts[:-1]
        return parts[-1] if parts else ""

    return key(a) == key(b)
