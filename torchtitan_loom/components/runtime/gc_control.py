"""Python garbage collection at fixed steps (``training.gc_freq``), as TorchTitan does.

CPython's automatic GC starts whenever allocation counters cross a threshold, i.e. at a different
moment on every rank; a rank that pauses for a collection stalls the next collective of all the
others. With ``gc_freq`` N > 0 the automatic GC is off and every rank collects the young generations
(``gc.collect(1)``) after steps N, 2N, ... (all at the same step); ``close()`` turns it back on.
"""

from __future__ import annotations

import gc

GENERATION = 1  # young generations: cheap, and what accumulates between steps


class GarbageCollection:
    def __init__(self, gc_freq: int) -> None:
        self.freq = gc_freq
        self._was_enabled = gc.isenabled()
        if self.freq > 0:
            gc.disable()
            gc.collect(GENERATION)

    def step(self, step: int) -> bool:
        """Collect after global step ``step`` when it is a multiple of the frequency; True when it did."""
        if self.freq > 0 and step % self.freq == 0:
            gc.collect(GENERATION)
            return True
        return False

    def close(self) -> None:
        if self.freq > 0 and self._was_enabled:
            gc.enable()
