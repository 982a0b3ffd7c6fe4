"""Progress lines of the slow tools (analyze, lm_eval): one line when a phase starts, and inside a
long loop one after the first step (it says how long a step takes) and then one every EVERY_S
seconds, each with the time since the tool started. Modest on purpose: a console or a job log
shows where the tool is without a line per batch. No torch import.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

EVERY_S = 10.0


class Progress:
    """``phase(text)`` prints ``"<tool>: <text> (<t> s) ..."``; ``tick(text)`` prints
    ``"<tool>: <text> (<t> s)"`` on its first call and then at most once every ``every_s``."""

    def __init__(
        self,
        tool: str,
        stream: TextIO | None = None,
        every_s: float = EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.tool, self.every_s, self.clock = tool, every_s, clock
        self.stream = stream if stream is not None else sys.stdout
        self.start = clock()
        self.last_tick: float | None = None

    def elapsed(self) -> float:
        return self.clock() - self.start

    def _print(self, line: str) -> None:
        print(line, file=self.stream, flush=True)

    def new_loop(self) -> None:
        """The next ``tick`` prints (the first step of a new loop says how long a step takes)."""
        self.last_tick = None

    def phase(self, text: str) -> None:
        self.new_loop()
        self._print(f"{self.tool}: {text} ({self.elapsed():.0f} s) ...")

    def tick(self, text: str | Callable[[], str]) -> None:
        """``text`` may be a function, called only when a line is printed."""
        now = self.clock()
        if self.last_tick is not None and now - self.last_tick < self.every_s:
            return
        self.last_tick = now
        self._print(f"{self.tool}: {text() if callable(text) else text} ({now - self.start:.0f} s)")
