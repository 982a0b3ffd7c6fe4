"""How a spawned test rank ends: its function runs; when it returns, the process leaves at once
(``os._exit(0)``), without the interpreter's finalization.

Why: a rank's gloo process groups outlive ``destroy_process_group`` (DTensor's caches and the
meshes keep them), so their worker threads are still alive when the interpreter finalizes. A
worker that drops the last reference to a finished collective's tensor whose Python object
Python already let go must take the GIL to free it; from finalization on, CPython ends any thread
that asks for the GIL (``pthread_exit``), and that unwind through the work's destructor is
``std::terminate``: "terminate called without an active exception", SIGABRT, a failed test
whose ranks all did their work. It needs a worker not scheduled between the collective's end and
the process's exit, so it shows on a loaded machine (test_estimate_comm's 2-rank case on torch
2.11, two runs side by side: 2 aborts in 46; a core dump of one is what this describes). Leaving
without finalization takes that window away; the results a rank reports are files it wrote and
closed before returning.

A rank that raises is not touched: torch.multiprocessing reports its traceback as before.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any


def run_then_exit(rank: int, fn: Callable[..., Any], *args: Any) -> None:
    """``fn(rank, *args)``; then the process exits 0, flushing only stdout and stderr."""
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
