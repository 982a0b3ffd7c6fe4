"""The one owner of stop signals: SIGTERM / SIGUSR1 / SIGINT and ``checkpoint.exit_after_step`` ask
the trainer to stop after a step, save and exit (0; 130 for SIGINT). The checkpoint manager only
saves what the trainer asks for.

The handler records the signal and acknowledges it at once with a line written straight to the
stdout file descriptor (no buffered print, which the interrupted code may be inside). A second
SIGINT raises KeyboardInterrupt (stop without saving).

Agreement (ranks receive a scheduler's signal at slightly different moments): every rank's flag
rides in each segment's step statistics, the step's one all-reduce (``flag_tensor`` in,
``observe`` out), for any world size. Seen at segment 1, before the step's first optimizer
update, the step is abandoned and leaves no trace; seen later, the step finishes and the run stops
after it (``stop_after``, no collective of its own). Every rank stops after the same step, and a
rank that got no signal stops too. The held-out eval, between steps, polls ``requested()`` per
micro-batch (an all-reduce when distributed) so a long eval stops early.

A rank started by torchrun also watches its launcher (LauncherWatch): when the agent dies (its
parent pid changes, or the agent's store stops accepting connections) the rank sends itself
SIGTERM, so it stops, and saves when checkpoints are on, exactly as if the agent had sent it,
instead of training unattended to the end.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from torchtitan_loom.components.runtime import exit_codes

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class PreemptionWatcher:
    """Installs handlers for SIGTERM, SIGUSR1 and SIGINT (main thread only); ``close()`` restores
    the old ones."""

    def __init__(
        self, enabled: bool = True, device: torch.device | str = "cpu", exit_after_step: int = 0
    ) -> None:
        self.exit_after_step = exit_after_step  # 0: never
        self.received = 0
        self.agreed = 0  # the signal every rank agreed on (set by requested())
        self._device = torch.device(device)
        self._previous: dict[int, Any] = {}
        if enabled and threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        # Also without handlers (checkpoints off): the SIGTERM then ends the process as torchrun's would.
        self.launcher = LauncherWatch.start() if LauncherWatch.applies(os.environ) else None

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
            msg = (
                f"[torchtitan_loom] received {name}: stopping after the step in progress (dropped "
                f"if it has not updated yet), then saving"
                f"{' (SIGINT again: stop without saving)' if signum == signal.SIGINT else ''}\n"
            )
            try:
                os.write(1, msg.encode())
            except OSError:
                pass

    def flag_tensor(self) -> torch.Tensor:
        """This rank's stop flag (1.0: a signal arrived) for the step statistics' all-reduce."""
        return torch.tensor([float(self.received > 0)], dtype=torch.float64, device=self._device)

    def observe(self, ranks_flagged: float) -> bool:
        """The all-reduced flag of the step statistics (ranks that received a signal): True when
        the run stops. A rank that got none takes SIGTERM's exit code (0)."""
        if ranks_flagged > 0 and not self.agreed:
            self.agreed = self.received or signal.SIGTERM
        return bool(self.agreed)

    def requested(self) -> int:
        """The signal number every rank agrees on (0: keep training); the held-out eval polls it
        between steps. Collective when distributed."""
        if not self.installed:
            return 0
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([self.received], dtype=torch.int64, device=self._device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            self.agreed = max(self.agreed, int(flag.item()))
        else:
            self.agreed = self.agreed or self.received
        return self.agreed

    def stop_after(self, step: int, *, last: bool = False) -> str | None:
        """Why the run stops after global step ``step`` (a signal agreed during the step or the
        eval after it, or ``exit_after_step``), None to go on; ``last``: no step follows anyway.
        No collective: the agreement already happened."""
        if self.agreed:
            return f"received {signal.Signals(self.agreed).name}: stopped after step {step}"
        if self.exit_after_step and step == self.exit_after_step and not last:
            self.agreed = signal.SIGTERM  # a planned stop exits 0
            return f"checkpoint.exit_after_step = {step} reached"
        return None

    def exit_code(self) -> int:
        """The exit code of a run stopped by the agreed signal: 130 for SIGINT, else 0."""
        return exit_codes.INTERRUPTED if self.agreed == signal.SIGINT else exit_codes.OK

    def close(self) -> None:
        """Stop watching the launcher and put back the handlers that were there before."""
        if self.launcher is not None:
            self.launcher.close()
            self.launcher = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def _sigterm_self(reason: str) -> None:
    try:
        os.write(1, f"[torchtitan_loom] {reason}: stopping as on SIGTERM\n".encode())
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGTERM)


class LauncherWatch:
    """A daemon thread that notices the death of the torchrun agent that started this rank.

    Every ``poll_s`` it compares the parent pid with the one at start (the agent is the parent of
    its workers); local rank 0 also opens a TCP connection to the agent's store (MASTER_ADDR:
    MASTER_PORT, when TORCHELASTIC_USE_AGENT_STORE says the agent hosts it) every other poll, and
    ``STORE_FAILURES`` refusals in a row count as the agent gone (a remote node's agent included).
    One rank noticing is enough: the trainer's stop flag is agreed by every rank. ``on_gone(reason)``
    runs once, in the thread (default: a line on stdout, then SIGTERM to this process).
    """

    STORE_FAILURES = 3

    def __init__(
        self,
        env: Mapping[str, str],
        poll_s: float = 1.0,
        on_gone: Callable[[str], None] = _sigterm_self,
    ) -> None:
        self.parent = os.getppid()
        self.poll_s, self.on_gone = poll_s, on_gone
        self.store = None
        if (
            env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
            and env.get("LOCAL_RANK", "0") == "0"
        ):
            if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
                self.store = (env["MASTER_ADDR"], int(env["MASTER_PORT"]))
        self.gone: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loom-launcher-watch", daemon=True)

    @staticmethod
    def applies(env: Mapping[str, str]) -> bool:
        """True for a rank started by torchrun's elastic agent (a directly started process has a
        shell or a scheduler as its parent, whose exit must not stop it: nohup, srun)."""
        return bool(env.get("TORCHELASTIC_RUN_ID"))

    @classmethod
    def start(cls, env: Mapping[str, str] | None = None, **kwargs: Any) -> LauncherWatch:
        watch = cls(os.environ if env is None else env, **kwargs)
        watch._thread.start()
        return watch

    def _store_reachable(self) -> bool:
        try:
            socket.create_connection(self.store, timeout=max(self.poll_s, 1.0)).close()
            return True
        except OSError:
            return False

    def _run(self) -> None:
        failures, n = 0, 0
        while not self._stop.wait(self.poll_s):
            n += 1
            if os.getppid() != self.parent:
                self.gone = f"the launcher (parent pid {self.parent}) is gone"
            elif self.store is not None and n % 2 == 0:
                failures = 0 if self._store_reachable() else failures + 1
                if failures >= self.STORE_FAILURES:
                    self.gone = (
                        f"the launcher's store {self.store[0]}:{self.store[1]} is unreachable"
                    )
            if self.gone:
                self.on_gone(self.gone)
                return

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self.poll_s + 2)
