"""Runs a documented command the way a reader would type it, and reports what a reader would see.

Commands are written as the docs show them, with their outputs under /tmp/<name>; the runner
executes them with /tmp/ replaced by its own work folder (so nothing of another run on the same
machine is touched) and writes the output back with the documented paths. The bundled corpus is
built into the work folder on first use, as on a fresh machine, and shown as ~/.cache/torchtitan_loom.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHOWN_TMP = "/tmp/"
SHOWN_CACHE = "~/.cache/torchtitan_loom"


class CommandFailed(RuntimeError):
    """A documented command exited non-zero: the docs would describe something that does not work."""


@dataclass(frozen=True)
class Result:
    command: str  # as the docs show it
    stdout: str  # documented paths
    stderr: str
    wall_s: float
    cpu_s: float  # user + system time of the command and every process it waited for

    @property
    def console(self) -> str:
        return self.stdout + self.stderr


class Runner:
    def __init__(self, work: Path, log=print):
        self.work = work
        self.cache = work / "cache"
        self.log = log
        work.mkdir(parents=True, exist_ok=True)

    def real(self, shown: str) -> str:
        return shown.replace(SHOWN_TMP, f"{self.work}/")

    def shown(self, real: str) -> str:
        return real.replace(str(self.cache), SHOWN_CACHE).replace(f"{self.work}/", SHOWN_TMP)

    def env(self) -> dict[str, str]:
        return {
            # One intra-op thread unless told otherwise: the figures of a run depend on the thread
            # count (another reduction order), and the README tour's check reruns it with the
            # count its excerpt shows.
            "OMP_NUM_THREADS": "1",
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "TORCHTITAN_LOOM_CACHE": str(self.cache),
            "PYTHONUNBUFFERED": "1",
        }

    def run(self, command: str, timeout_s: float = 1800) -> Result:
        """Run a documented shell command from the repo root; raise CommandFailed on a non-zero exit."""
        self.log(f"$ {command}")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.monotonic()
        proc = subprocess.run(
            ["bash", "-c", self.real(command)],
            cwd=ROOT,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        wall = time.monotonic() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        result = Result(command, self.shown(proc.stdout), self.shown(proc.stderr), wall, cpu)
        self.log(f"  exit {proc.returncode} after {duration(wall)} wall, {duration(cpu)} CPU")
        if proc.returncode != 0:
            tail = "\n".join(result.console.strip().splitlines()[-15:])
            raise CommandFailed(
                f"documented command failed (exit {proc.returncode}): {command}\n{tail}"
            )
        return result

    def python(self, code: str, timeout_s: float = 1800) -> str:
        """Run a measurement snippet (not a documented command) with this tree's package; return stdout."""
        proc = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if proc.returncode != 0:
            raise CommandFailed(
                f"measurement failed (exit {proc.returncode}):\n{proc.stderr.strip()[-2000:]}"
            )
        return self.shown(proc.stdout)


def duration(seconds: float) -> str:
    """Seconds as a reader says them: '48 s', '2 min 10 s', '1 h 05 min'."""
    s = round(seconds)
    if s < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def machine() -> str:
    threads = os.environ.get("OMP_NUM_THREADS")
    return f"{os.cpu_count()} cores" + (f", OMP_NUM_THREADS={threads}" if threads else "")
