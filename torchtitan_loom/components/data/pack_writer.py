"""Writing a pack (the format of pack_format.py) from tokenised documents.

Documents stream in one at a time; each gets EOS appended and is cut into records of at most
`max_seq_len` tokens (a final piece shorter than 2 tokens is dropped: it would have no target).
Tokens go to a raw file as they arrive, so memory holds only the record lengths. `finish()`
chooses the holdout (the last records of the corpus, by token count, at most 10% of records),
draws the training orderings, writes everything into a temporary directory beside the output
and renames it into place, so an interrupted pack never looks complete. A full disk is one line
(an OSError naming the output), with the temporary directory removed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from torchtitan_loom.components.data.pack_format import token_dtype

FORMAT_VERSION = 1
HOLDOUT_MAX_RECORD_FRACTION = (
    0.1  # as the reference packer: the holdout never takes >10% of records
)
_COPY_BLOCK = 1 << 24  # tokens per block when moving the raw stream into tokens.npy


class PackWriter:
    """Incremental pack writer. Use as a context manager so a failure removes the temp dir:

    with PackWriter(out, tokenizer_info, max_seq_len=1024) as w:
        for ids in docs: w.add_document(ids)
        w.finish(epochs=9, holdout_tokens=20_000_000, seed=0)
    """

    def __init__(
        self,
        out: str | Path,
        tokenizer_info: dict,
        max_seq_len: int,
        extra_metadata: dict | None = None,
    ):
        if max_seq_len < 2:
            raise ValueError(
                f"max_seq_len {max_seq_len}: records need at least 2 tokens (one input, one label)"
            )
        for key in ("vocab_size", "name_or_path", "eos_token_id"):
            if key not in tokenizer_info:
                raise ValueError(
                    f"tokenizer_info lacks {key!r}; it needs vocab_size, name_or_path, eos_token_id"
                )
        self.out = Path(out)
        self.tokenizer_info = dict(tokenizer_info)
        self.max_seq_len = int(max_seq_len)
        self.extra_metadata = dict(extra_metadata or {})
        self.dtype = token_dtype(int(tokenizer_info["vocab_size"]))
        self.out.parent.mkdir(parents=True, exist_ok=True)
        # Beside the output so the final rename stays on one filesystem (atomic).
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.tmp-", dir=self.out.parent))
        self._raw = open(self.tmp / "tokens.bin", "wb")
        self._lens: list[np.ndarray] = []
        self.num_documents = 0
        self.total_tokens = 0
        self.max_token_id = -1

    def __enter__(self) -> PackWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def add_document(self, ids: np.ndarray) -> None:
        """Append one document's token ids (without EOS; it is added here)."""
        with self._disk("the tokens"):
            self._add(ids)

    @contextlib.contextmanager
    def _disk(self, what: str) -> Iterator[None]:
        """A full disk (or quota) while writing ``what``: the temporary folder removed, then one
        line naming the output (an OSError without an errno prints as its message alone)."""
        try:
            yield
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            self.abort()
            raise OSError(
                f"{self.out}: no space left on its disk writing {what} ({self.total_tokens:,} "
                f"tokens so far); nothing written, the partial pack removed: free space or "
                f"choose another --out"
            ) from None

    def _add(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids)
        vocab = int(self.tokenizer_info["vocab_size"])
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise ValueError(
                f"document {self.num_documents}: token ids must lie in 0..{vocab - 1} "
                f"(the tokenizer's vocab_size), got {int(ids.min())}..{int(ids.max())}"
            )
        eos = int(self.tokenizer_info["eos_token_id"])
        doc = np.empty(len(ids) + 1, dtype=self.dtype)
        doc[:-1] = ids
        doc[-1] = eos
        n, c = len(doc), self.max_seq_len
        lens = np.full(n // c, c, dtype=np.int64)
        if n % c >= 2:
            lens = np.append(lens, n % c)
        kept = int(lens.sum())
        if kept:
            self._raw.write(doc[:kept].tobytes())
            self._lens.append(lens)
            self.max_token_id = max(self.max_token_id, int(doc[:kept].max()))
        self.num_documents += 1
        self.total_tokens += kept

    def finish(
        self, epochs: int, holdout_tokens: int, seed: int = 0, replace: bool = False
    ) -> Path:
        """Write orderings, holdout and metadata, then rename the temp dir to `out`.

        Raises FileExistsError if `out` exists and `replace` is False (the temp dir is removed).
        """
        if epochs < 1:
            raise ValueError(f"epochs {epochs}: need at least 1 training ordering")
        with self._disk("the pack's files"):
            return self._finish(epochs, holdout_tokens, seed, replace)

    def _finish(self, epochs: int, holdout_tokens: int, seed: int, replace: bool) -> Path:
        self._raw.close()
        lens = np.concatenate(self._lens) if self._lens else np.zeros(0, np.int64)
        n = len(lens)
        if n < 2 and holdout_tokens > 0 or n < 1:
            self.abort()
            raise ValueError(
                f"the corpus gave {n} record(s) ({self.total_tokens} tokens): too few "
                "for training orderings plus a holdout; add documents or set holdout tokens to 0"
            )
        starts = np.zeros(n, np.int64)
        np.cumsum(lens[:-1], out=starts[1:])
        n_hold = _holdout_records(lens, holdout_tokens)
        n_train = n - n_hold
        rng = np.random.default_rng(seed)
        for k in range(epochs):
            perm = rng.permutation(
                n_train
            )  # drawn one after another from one generator, as the reference
            _write_epoch(self.tmp / f"epoch_{k}", starts[perm], lens[perm])
        holdout_epoch = epochs if n_hold else None
        if n_hold:
            _write_epoch(self.tmp / f"epoch_{epochs}", starts[n_train:], lens[n_train:])
        self._write_tokens()
        meta = {
            "tokenizer_info": self.tokenizer_info,
            "max_seq_len": self.max_seq_len,
            "total_length": int(self.total_tokens),
            "layout": "document",
            "format_version": FORMAT_VERSION,
            "num_documents": self.num_documents,
            "num_records": int(n),
            "training_epochs": int(epochs),
            "holdout_epoch": holdout_epoch,
            "holdout_records": int(n_hold),
            "holdout_tokens": int(lens[n_train:].sum()),
            "max_token_id": int(self.max_token_id),
            "seed": int(seed),
            **self.extra_metadata,
        }
        (self.tmp / "metadata.json").write_text(json.dumps(meta, indent=2) + "\n")
        return self._publish(replace)

    def _write_tokens(self) -> None:
        """tokens.npy: the .npy header, then the raw stream copied in blocks by write() — never
        through a memory map, whose page faults on a full disk kill the process (SIGBUS) where a
        write() says ENOSPC."""
        raw = self.tmp / "tokens.bin"
        header = {
            "descr": np.lib.format.dtype_to_descr(self.dtype),
            "fortran_order": False,
            "shape": (self.total_tokens,),
        }
        with open(self.tmp / "tokens.npy", "wb") as out, open(raw, "rb") as f:
            np.lib.format.write_array_header_1_0(out, header)
            shutil.copyfileobj(f, out, _COPY_BLOCK * self.dtype.itemsize)
            out.flush()
            os.fsync(out.fileno())
        raw.unlink()

    def _publish(self, replace: bool) -> Path:
        if self.out.exists():
            if not replace:
                self.abort()
                raise FileExistsError(
                    f"output {str(self.out)!r} already exists (pass --force to replace it)"
                )
            shutil.rmtree(self.out)
        try:
            os.rename(self.tmp, self.out)
        except OSError:
            self.abort()  # lost a race against another writer of the same output
            raise FileExistsError(f"output {str(self.out)!r} appeared while writing") from None
        return self.out

    def abort(self) -> None:
        """Remove the temporary directory (idempotent)."""
        if not self._raw.closed:
            self._raw.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _holdout_records(lens: np.ndarray, holdout_tokens: int) -> int:
    """Number of final records whose cumulative length first reaches `holdout_tokens`, capped at
    10% of records (at least one when asked for any) and always leaving one training record."""
    if holdout_tokens <= 0:
        return 0
    from_end = np.cumsum(lens[::-1])
    need = int(np.searchsorted(from_end, holdout_tokens, side="left")) + 1
    cap = max(1, int(len(lens) * HOLDOUT_MAX_RECORD_FRACTION))
    return max(0, min(need, cap, len(lens) - 1))


def _write_epoch(d: Path, starts: np.ndarray, lens: np.ndarray) -> None:
    d.mkdir()
    np.save(d / "doc_start.npy", starts.astype(np.int64))
    np.save(d / "doc_len.npy", lens.astype(np.int32))
