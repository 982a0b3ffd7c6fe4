"""Lines libraries write to the process's stderr that a user cannot act on, dropped where they are
written: file descriptor 2, so what C++ code (the profiler's kineto), child processes (lm-eval's
``git describe``) and Python code (tqdm bars, library warnings) print all pass through one filter.
Every other line is written back, in order, when the block ends.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def dropping_stderr_lines(drop: Callable[[str], bool]) -> Iterator[None]:
    """Inside: stderr is caught; at the end every caught line for which ``drop`` is false is
    written to the real stderr (a line is one ``\\n``-ended piece, ``\\r`` redraws included)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            text = caught.read().decode("utf-8", errors="replace")
            kept = [ln for ln in text.splitlines(keepends=True) if not drop(ln)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def progress_bar(line: str) -> bool:
    """A tqdm bar (its redraws share one line): ``… 8/8 [00:00<00:00, 356.67it/s]``."""
    return "it/s]" in line or "s/it]" in line or "?it/s]" in line
