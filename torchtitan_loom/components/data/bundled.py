"""The bundled corpus: built on first use into a cache directory, then reused.

Several ranks may call `bundled_corpus_path` at the same time on a fresh machine: each builds in
its own temporary directory and renames it into place; a rank that loses the rename race removes
its copy and uses the winner's (a rename of a complete directory is atomic, so a visible corpus
directory is always complete).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from torchtitan_loom.components.data.pack_format import PackError, open_pack

CACHE_ENV = "TORCHTITAN_LOOM_CACHE"


def default_cache_dir() -> Path:
    """$TORCHTITAN_LOOM_CACHE, else ~/.cache/torchtitan_loom."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "torchtitan_loom"


def ensure_built(
    final: Path,
    build: Callable[[Path], object],
    verify: Callable[[Path], bool],
    log: Callable[[str], None] | None = None,
) -> Path:
    """Return `final` once it exists and verifies, building it with `build(final)` if needed.

    `build` must write atomically and raise FileExistsError if `final` appeared meanwhile.
    A directory that exists but does not verify is moved aside (kept for inspection) and rebuilt.
    """
    if final.exists():
        if verify(final):
            return final
        try:
            os.rename(final, final.with_name(f".{final.name}.broken-{uuid.uuid4().hex[:8]}"))
        except OSError:
            pass  # another process moved it first
    final.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if log is not None:
        log(f"building the bundled corpus into {final} (first use; later runs reuse it) ...")
    try:
        build(final)
    except FileExistsError:
        pass  # another process won the race; its directory is complete
    if log is not None:
        log(f"bundled corpus ready in {time.perf_counter() - started:.1f} s")
    if not verify(final):
        raise PackError(
            f"pack {str(final)!r}: the bundled corpus was built but does not verify; "
            "delete the directory and retry"
        )
    return final


def bundled_corpus_path(
    cache_dir: str | Path | None = None, log: Callable[[str], None] | None = None
) -> Path:
    """Directory of the bundled synthetic corpus (byte tokenizer, records of 257 tokens, so the
    model trains at seq_len 256), built on first use under `cache_dir`."""
    from torchtitan_loom.components.data import synthetic_corpus as sc

    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / sc.CORPUS_NAME

    def verify(path: Path) -> bool:
        try:
            pack = open_pack(
                path, seq_len=sc.MAX_SEQ_LEN - 1, vocab_size=258, tokenizer_name="byte"
            )
        except (PackError, OSError):
            return False
        return pack.metadata.get("corpus") == sc.CORPUS_NAME

    return ensure_built(final, sc.write_bundled_pack, verify, log)
