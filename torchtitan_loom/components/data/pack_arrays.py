"""Opening a pack's .npy arrays safely, and checking every token id of tokens.npy.

An array file is checked before numpy maps it: a regular file (not a FIFO or device), the .npy
magic, a header numpy parses without evaluating code, an integer dtype, and a file size equal to
header + data (shorter: truncated; longer: damaged). It is never loaded with allow_pickle, and
numpy's advice to load a file "unsafely" is never shown: a file that is not an array is one line
saying so and how to rebuild the pack.

Token ids are checked at pack open, not at step 1 (where an id ≥ the model's vocabulary is an
IndexError in the embedding): a vectorised min/max over the memory-mapped stream, in blocks so
memory stays bounded (~1 GB/s, so a few seconds for a multi-GB pack; a progress line is printed
when it takes longer than PROGRESS_AFTER_S). The range found is memoised in memory for the
file's identity (device, inode, size, mtime, ctime), so the config check, the train loader and
the eval loader of one launch scan a pack once; nothing is written into the pack folder.
"""

from __future__ import annotations

import functools
import os
import stat
import sys
import time
from pathlib import Path

import numpy as np

from torchtitan_loom.components.data.pack_error import REPACK, PackError, fail

NPY_MAGIC = b"\x93NUMPY"
SCAN_BLOCK = 1 << 22  # tokens per block: 8-16 MiB, so the max pass finds the block in cache
PROGRESS_AFTER_S = 5.0  # a scan still going after this long says so, then every this often


def load_array(pack: Path, f: Path, mmap: bool = True) -> np.ndarray:
    """The 1-D integer array in ``f`` (read-only memory map, or in memory with ``mmap=False``);
    PackError naming ``f`` and how to rebuild the pack for anything else."""
    rel = f.relative_to(pack)
    try:
        st = os.stat(f)  # follows a link: a pack may keep tokens.npy on another disk
    except FileNotFoundError:
        raise fail(pack, f"{rel} is missing", REPACK) from None
    except OSError as exc:
        raise fail(pack, f"{rel} is unreadable ({exc.strerror or exc})", REPACK) from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "not a regular file"
        raise fail(pack, f"{rel} is {kind}", f"it must be a .npy array file; {REPACK}")
    dtype, shape, offset = _npy_header(pack, f, rel)
    if dtype.hasobject or dtype.kind not in "iu" or len(shape) != 1:
        raise fail(
            pack,
            f"{rel} has dtype {dtype} and shape {shape}",
            "it must be a 1-D integer array (tokens uint16 or uint32, doc_start int64, doc_len int32)",
        )
    expected = offset + int(shape[0]) * dtype.itemsize
    if st.st_size != expected:
        problem = (
            "truncated or unreadable" if st.st_size < expected else "longer than its header says"
        )
        raise fail(
            pack,
            f"{rel} is {problem} ({st.st_size:,} bytes; its header promises "
            f"{shape[0]:,} × {dtype.itemsize} bytes after {offset} header bytes = {expected:,})",
            REPACK,
        )
    try:  # validated above; allow_pickle stays False so nothing in the file can run code
        return np.load(f, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise fail(
            pack, f"{rel} is truncated or unreadable ({type(exc).__name__})", REPACK
        ) from None


def _npy_header(pack: Path, f: Path, rel: Path) -> tuple[np.dtype, tuple, int]:
    """(dtype, shape, data offset) from the header of the .npy file ``f``; numpy's header reader
    evaluates only Python literals, never code."""
    invalid = (
        f"{rel} is not a valid token array (not a .npy file written by numpy.save, or damaged)"
    )
    try:
        with open(f, "rb") as fh:
            head = fh.read(len(NPY_MAGIC))
            if head != NPY_MAGIC:
                raise fail(pack, f"{invalid}: it starts with {head!r}", REPACK)
            fh.seek(0)
            version = np.lib.format.read_magic(fh)
            if version == (1, 0):
                shape, _fortran, dtype = np.lib.format.read_array_header_1_0(fh)
            elif version == (2, 0):
                shape, _fortran, dtype = np.lib.format.read_array_header_2_0(fh)
            else:
                raise fail(pack, f"{invalid}: .npy format version {version}", REPACK)
            return np.dtype(dtype), tuple(shape), fh.tell()
    except PackError:
        raise
    except (ValueError, OSError, EOFError, SyntaxError, TypeError) as exc:
        raise fail(pack, f"{invalid}: {type(exc).__name__} in its header", REPACK) from None


def token_range(pack: Path, f: Path) -> tuple[int, int]:
    """(smallest, largest) token id in the .npy file ``f`` (already checked by load_array),
    memoised for the file's identity so one launch scans a pack once; (0, -1) when empty."""
    st = os.stat(f)
    identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return _scanned_range(str(f), identity, str(pack))


@functools.lru_cache(maxsize=8)
def _scanned_range(f: str, identity: tuple, pack: str) -> tuple[int, int]:
    """A pure function of the file's content, which ``identity`` stands for (memoised: a rewrite
    of the file changes its mtime and ctime, hence the key)."""
    tokens = np.load(f, mmap_mode="r", allow_pickle=False)
    lo, hi = 0, -1
    started = last = time.perf_counter()
    n = len(tokens)
    for start in range(0, n, SCAN_BLOCK):
        block = tokens[start : start + SCAN_BLOCK]
        lo = int(block.min()) if start == 0 else min(lo, int(block.min()))
        hi = max(hi, int(block.max()))
        now = time.perf_counter()
        if now - last >= PROGRESS_AFTER_S:
            last = now
            done = min(start + SCAN_BLOCK, n)
            print(
                f"pack {pack!r}: checking token ids, {done:,} of {n:,} tokens "
                f"({100 * done / n:.0f}%, {now - started:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    return lo, hi


def first_bad_token(tokens: np.ndarray, vocab_size: int) -> tuple[int, int] | None:
    """(position, id) of the first token id outside 0..vocab_size-1, None if there is none
    (only the error path pays for this second, position-finding scan)."""
    for start in range(0, len(tokens), SCAN_BLOCK):
        block = tokens[start : start + SCAN_BLOCK].astype(np.int64)
        bad = np.flatnonzero((block < 0) | (block >= vocab_size))
        if len(bad):
            return start + int(bad[0]), int(block[bad[0]])
    return None
