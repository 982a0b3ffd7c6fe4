"""How a launch ended, as a value: the one input of run.json's final status, the exit code and the
last line. The trainer builds it for the ends it decides (finished, stopped, diverged) and
``launch.outcome_of`` for an exception; ``Trainer.train`` is the one place that acts on it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Status(enum.Enum):
    """run.json's ``status`` at the end of a launch (``running`` while it lives)."""

    FINISHED = "finished"
    """Every step of training.steps ran."""
    STOPPED = "stopped"
    """A signal, checkpoint.exit_after_step or Ctrl-C twice: resumable by relaunching."""
    DIVERGED = "diverged"
    """A divergence abort (SPIKE_ABORT.txt): the config needs changing."""
    FAILED = "failed"
    """An error: a checkpoint, pack or disk that could not serve the run."""


@dataclass(frozen=True)
class Outcome:
    status: Status
    exit_code: int
    message: str
    """Why it ended: a logged line for a stop or an abort, the stderr lines of an error."""
    error: bool = False
    """``message`` goes to stderr (every rank), and no "done:" line follows it."""
    commit_pending: bool = True
    """Finish and commit a save still in flight; False discards it (nothing is committed after a
    divergence, a failed save or a second Ctrl-C)."""
