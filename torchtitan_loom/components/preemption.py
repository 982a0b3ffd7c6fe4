"""The one owner of stop signals: SIGTERM / SIGUSR1 / SIGINT and ``checkpoint.exit_after_step`` ask
the trainer to stop after a step, save and exit (0; 130 for SIGINT). The checkpoint manager only
saves what the trainer asks for.

The handler records the signal and acknowledges it at once with a line written straight to the
stdout file descriptor (no buffered print, which the interrupted code may be inside). The trainer
polls ``requested()`` between steps, per micro-batch during eval, and per micro-batch of a step
until its first optimizer update (a step abandoned there leaves no trace), so a save never starts
in the middle of an update. A second SIGINT raises KeyboardInterrupt (stop without saving). Ranks receive a scheduler's signal at
slightly different moments, so with several processes the flag is agreed by an all-reduce (max):
every rank stops after the same step, and a rank that got no signal stops too.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import torch
import torch.distributed as dist

from torchtitan_loom.components import exit_codes

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class PreemptionWatcher:
    """Installs handlers for SIGTERM, SIGUSR1 and SIGINT (main thread only); ``close()`` restores
    the old ones."""

    def __init__(self, enabled: bool = True, device: torch.device | str = "cpu", exit_after_step: int = 0) -> None:
        self.exit_after_step = exit_after_step  # 0: never
        self.received = 0
        self.agreed = 0  # the signal every rank agreed on (set by requested())
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
        # Record it and acknowledge with os.write: a print here could re-enter one in progress.
        if self.received and signum == signal.SIGINT:
            raise KeyboardInterrupt  # Ctrl-C twice: stop now, without saving
        if not self.received:
            self.received = signum
            name = signal.Signals(signum).name
            msg = (f"[torchtitan_loom] received {name}: stopping at the next micro-batch, then saving"
                   f"{' (SIGINT again: stop without saving)' if signum == signal.SIGINT else ''}\n")
            try:
                os.write(1, msg.encode())
            except OSError:
                pass

    def requested(self) -> int:
        """The signal number every rank agrees on (0: keep training). Collective when distributed."""
        if not self.installed:
            return 0
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([self.received], dtype=torch.int64, device=self._device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            self.agreed = int(flag.item())
        else:
            self.agreed = self.received
        return self.agreed

    def stop_after(self, step: int, *, last: bool = False) -> str | None:
        """Why the run stops after global step ``step`` (an agreed signal or ``exit_after_step``),
        None to go on; ``last``: no step follows anyway. Collective when distributed."""
        signum = self.requested()
        if signum:
            return f"received {signal.Signals(signum).name}: stopped after step {step}"
        if self.exit_after_step and step == self.exit_after_step and not last:
            self.agreed = signal.SIGTERM  # a planned stop exits 0
            return f"checkpoint.exit_after_step = {step} reached"
        return None

    def agree(self) -> None:
        """Some rank got a signal (agreed through the step's statistics): every rank stops. A rank
        that got none reports SIGTERM's exit code (0)."""
        self.agreed = self.received or signal.SIGTERM

    def exit_code(self) -> int:
        """The exit code of a run stopped by the agreed signal: 130 for SIGINT, else 0."""
        return exit_codes.INTERRUPTED if self.agreed == signal.SIGINT else exit_codes.OK

    def close(self) -> None:
        """Put back the handlers that were there before."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
