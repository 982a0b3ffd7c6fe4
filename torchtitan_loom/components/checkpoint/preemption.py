"""Preemption: SIGTERM / SIGUSR1 ask the trainer to finish its step, save and exit 0.

The handler only records the signal; the trainer polls ``requested()`` once per step, between
steps, so a save never starts in the middle of an update. Ranks receive a scheduler's signal at
slightly different moments, so with several processes the flag is agreed by an all-reduce (max):
every rank stops after the same step, and a rank that got no signal stops too.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionWatcher:
    """Installs handlers for SIGTERM and SIGUSR1 (main thread only); ``close()`` restores the old ones."""

    def __init__(self, enabled: bool = True, device: torch.device | str = "cpu") -> None:
        self.received = 0
        self._device = torch.device(device)
        self._previous: dict[int, Any] = {}
        if enabled and threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    @property
    def installed(self) -> bool:
        """True while this watcher's handlers are installed."""
        return bool(self._previous)

    def _handle(self, signum: int, frame: Any) -> None:
        # Only record it: printing here could re-enter a print the main thread is in the middle of.
        if not self.received:
            self.received = signum

    def requested(self) -> int:
        """The signal number every rank agrees on (0: keep training). Collective when distributed."""
        if not self.installed:
            return 0
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([self.received], dtype=torch.int64, device=self._device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            return int(flag.item())
        return self.received

    def close(self) -> None:
        """Put back the handlers that were there before."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
