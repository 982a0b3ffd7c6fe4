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
parent pid changes, or the agent's store stops accepting connections) the rank asks for a stop as
if the agent had sent SIGTERM, so every rank stops after the same step (and saves when checkpoints
are on) instead of training unattended to the end, or dying mid-collective under its peers.

Under torchrun's elastic agent (``TORCHELASTIC_MAX_RESTARTS`` > ``TORCHELASTIC_RESTART_COUNT``)
the exit code is what the agent acts on: 0 makes it wait at its exit barrier for the other nodes,
anything else makes it restart the group at whatever world size the next rendezvous finds. A
preemption signals every rank (the scheduler signals the agents, which signal their workers), so a
rank that received a signal itself exits 0 as documented. A rank that stops only because a peer
asked (a peer's launcher died, or one node was preempted) received nothing: it exits
``exit_codes.RESTART`` so its live agent restarts without the lost node.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

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
        self.agreed = 0  # the signal every rank agreed on (set by observe() or requested())
        self.planned = False  # exit_after_step reached (agreed without a signal)
        self.launcher_gone: str | None = None  # why this rank's launcher counts as gone
        self.elastic = ElasticRestarts.from_env(os.environ)
        self._device = torch.device(device)
        self._previous: dict[int, Any] = {}
        if enabled and threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        # Also without handlers (checkpoints off): every rank still stops after the same step.
        self.launcher = (
            LauncherWatch.start(on_gone=self._launcher_lost)
            if LauncherWatch.applies(os.environ)
            else None
        )

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
            again = " (SIGINT again: stop without saving)" if signum == signal.SIGINT else ""
            _say(
                f"received {name}: stopping after the step in progress (dropped if it has not "
                f"updated yet), then saving{again}"
            )

    def _launcher_lost(self, reason: str) -> None:
        """LauncherWatch's callback (its thread): a stop request as if the agent had sent SIGTERM."""
        self.launcher_gone = reason
        if not self.received:
            self.received = signal.SIGTERM
            _say(f"{reason}: stopping after this step as on SIGTERM")

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
        if not (self.installed or self.launcher is not None):
            return 0
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([self.received], dtype=torch.int64, device=self._device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            self.agreed = max(self.agreed, int(flag.item()))
        else:
            self.agreed = self.agreed or self.received
        return self.agreed

    def stop_after(self, step: int, *, last: bool = False) -> str | None:
        """Why the run stops after global step ``step`` (a stop agreed during the step or the
        eval after it, or ``exit_after_step``), None to go on; ``last``: no step follows anyway.
        No collective: the agreement already happened."""
        if self.agreed:
            return f"{self.why()}: stopped after step {step}"
        if self.exit_after_step and step == self.exit_after_step and not last:
            self.agreed, self.planned = signal.SIGTERM, True  # a planned stop exits 0
            return f"checkpoint.exit_after_step = {step} reached"
        return None

    def why(self) -> str:
        """What stopped this rank: its own signal, its launcher's death, or a peer's request."""
        if self.launcher_gone:
            return self.launcher_gone
        if self.received:
            return f"received {signal.Signals(self.received).name}"
        return "a peer rank was stopped (a signal, or its launcher is gone)"

    def exit_code(self) -> int:
        """The exit code of a run stopped by the agreed signal: 130 for SIGINT; RESTART for a rank
        that only followed a peer's request under an elastic agent with restarts left (read at
        exit: a preemption's own signal usually arrives during the save); else 0."""
        if self.agreed == signal.SIGINT:
            return exit_codes.INTERRUPTED
        if self.elastic.restarts_left and not (self.received or self.planned):
            return exit_codes.RESTART
        return exit_codes.OK

    def exit_note(self, saved: bool = True) -> str:
        """How the stop line ends: the exit code and what follows it (``saved``: this stop saved
        a checkpoint to resume from)."""
        code = self.exit_code()
        if code == exit_codes.RESTART:
            return f"exiting {code}: {self.elastic.describe()} restarts the workers"
        if not saved:
            return f"exiting {code}"
        if self.elastic.restarts_left:
            return (
                f"exiting {code}; an elastic restart or a relaunch of the same command resumes here"
            )
        return f"exiting {code}, relaunch the same command to resume"

    def close(self) -> None:
        """Stop watching the launcher and put back the handlers that were there before."""
        if self.launcher is not None:
            self.launcher.close()
            self.launcher = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def _say(line: str) -> None:
    """One line straight to the stdout descriptor (safe inside a signal handler or a thread)."""
    try:
        os.write(1, f"[torchtitan_loom] {line}\n".encode())
    except OSError:
        pass


class ElasticRestarts(NamedTuple):
    """What torchrun's agent told this worker about its restarts (its TORCHELASTIC_* variables)."""

    run_id: str
    restart_count: int
    max_restarts: int

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ElasticRestarts:
        def number(key: str) -> int:
            try:
                return int(env.get(key, "0"))
            except ValueError:
                return 0

        return cls(
            env.get("TORCHELASTIC_RUN_ID", ""),
            number("TORCHELASTIC_RESTART_COUNT"),
            number("TORCHELASTIC_MAX_RESTARTS"),
        )

    @property
    def restarts_left(self) -> bool:
        """A non-zero exit makes the agent restart the group (rather than fail the job)."""
        return bool(self.run_id) and self.restart_count < self.max_restarts

    @property
    def elastic_run(self) -> str:
        """The run id of an elastic launch (restarts configured and a real ``--rdzv-id``), else ""."""
        elastic = self.max_restarts > 0 and self.run_id not in ("", "none")
        return self.run_id if elastic else ""

    def describe(self) -> str:
        return (
            f"torchrun's elastic agent (run {self.run_id}, "
            f"{self.max_restarts - self.restart_count} of {self.max_restarts} restarts left)"
        )


class LauncherWatch:
    """A daemon thread that notices the death of the torchrun agent that started this rank.

    Every ``poll_s`` it compares the parent pid with the one at start (the agent is the parent of
    its workers); local rank 0 also opens a TCP connection to the agent's store (MASTER_ADDR:
    MASTER_PORT, when TORCHELASTIC_USE_AGENT_STORE says the agent hosts it) every other poll, and
    ``STORE_FAILURES`` refusals in a row count as the agent gone (a remote node's agent included).
    One rank noticing is enough: the trainer's stop flag is agreed by every rank. ``on_gone(reason)``
    runs once, in the thread (PreemptionWatcher's asks for a stop as on SIGTERM).
    """

    STORE_FAILURES = 3

    def __init__(
        self,
        env: Mapping[str, str],
        on_gone: Callable[[str], None],
        poll_s: float = 1.0,
    ) -> None:
        self.parent = os.getppid()
        self.poll_s, self.on_gone = poll_s, on_gone
        self.store: tuple[str, int] | None = None
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
    def start(
        cls, env: Mapping[str, str] | None = None, *, on_gone: Callable[[str], None], **kwargs: Any
    ) -> LauncherWatch:
        watch = cls(os.environ if env is None else env, on_gone=on_gone, **kwargs)
        watch._thread.start()
        return watch

    def _store_reachable(self, store: tuple[str, int]) -> bool:
        try:
            socket.create_connection(store, timeout=max(self.poll_s, 1.0)).close()
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
                failures = 0 if self._store_reachable(self.store) else failures + 1
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
