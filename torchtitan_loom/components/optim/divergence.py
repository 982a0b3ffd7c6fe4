"""When a run stops because it diverged: a non-finite loss or gradient (always), a spike with
``abort_on_spike``, too many consecutive skipped steps, or a non-finite weight after a step. Only
finite spikes are ever skipped and trained past. Each stop exits 2 and writes
SPIKE_ABORT.txt; the step it stopped at is never saved (its update may already hold the
diverged segments), and the newest checkpoint saved before the first skipped step of a streak
is marked KEEP so pruning never removes it.
"""

from __future__ import annotations

import os
import sys

from torchtitan_loom.components.runtime import safe_files

ABORT_FILE = "SPIKE_ABORT.txt"


class DivergenceMonitor:
    """Counts consecutive skipped steps; ``after_step`` returns the reason to stop, or None.

    Args:
        abort_on_spike: stop at the first skipped step (spike_guard.abort_on_spike).
        max_consecutive_skips: stop after this many skipped steps in a row (0: never).
    """

    def __init__(self, abort_on_spike: bool, max_consecutive_skips: int) -> None:
        self.abort_on_spike = abort_on_spike
        self.max_consecutive_skips = max_consecutive_skips
        self.consecutive = 0

    def after_step(
        self,
        step: int,
        skip_reason: str | None,
        nonfinite: list[str],
        nonfinite_stat: str | None = None,
    ) -> str | None:
        """Update the streak with this step's outcome; a message when the run must stop.
        ``nonfinite``: parameters holding a non-finite value; ``nonfinite_stat``: the step's
        non-finite loss or gradient (StepResult.non_finite), None when they were finite."""
        if nonfinite:
            return (
                f"non-finite weights after step {step} ({', '.join(nonfinite)}); stopping, the last "
                f"checkpoint before this step is kept. Lower optimizer.lr or resume from an earlier step"
            )
        if (
            nonfinite_stat
        ):  # the weights before this step already produce it: skipping would only repeat it
            return (
                f"{nonfinite_stat} at step {step}; stopping without saving this step (its update was not "
                f"applied). Lower optimizer.lr and resume from an earlier checkpoint (checkpoint.load_step)"
            )
        if skip_reason is None:
            self.consecutive = 0
            return None
        self.consecutive += 1
        if self.abort_on_spike:
            return (
                f"loss spike at step {step}: {skip_reason}; stopping (spike_guard.abort_on_spike=true). "
                f"Set --spike_guard.abort_on_spike false to skip spikes and continue."
            )
        if self.max_consecutive_skips and self.consecutive >= self.max_consecutive_skips:
            return (
                f"{self.consecutive} consecutive skipped steps (spike_guard.max_consecutive_skips = "
                f"{self.max_consecutive_skips}), the last at step {step}: {skip_reason}; the run diverged, "
                f"stopping without saving this step"
            )
        return None

    @property
    def streak_started(self) -> bool:
        """True right after the first skipped step of a streak."""
        return self.consecutive == 1


def write_abort(dump_folder: str, msg: str) -> None:
    """SPIKE_ABORT.txt in the run folder (rank 0 only calls this), never through a link; one that
    cannot be written is a warning: the stop itself goes on."""
    try:
        safe_files.atomic_write(os.path.join(dump_folder, ABORT_FILE), msg + "\n")
    except OSError as exc:
        print(f"warning: {ABORT_FILE} not written: {exc}", file=sys.stderr, flush=True)
