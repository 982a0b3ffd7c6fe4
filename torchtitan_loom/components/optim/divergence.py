"""When a run stops because it diverged: a non-finite loss or gradient (always), a spike with
``abort_on_spike``, too many consecutive skipped steps, or a non-finite weight after a step. Only
finite spikes are ever skipped and trained past. Each stop exits 2 and writes SPIKE_ABORT.txt;
after it nothing is saved, committed or pruned (the step's update may already hold the diverged
segments; a save still in flight is discarded), and pruning only ever removes checkpoints older
than one proven by healthy steps (components/checkpoint/proof.py), so the last good checkpoint
is on disk.

The non-finite rule lives here alone (``non_finite_statistic``): the trainer asks it before the
spike guard, which only ever sees finite losses.
"""

from __future__ import annotations

import math
import os
import sys

from torchtitan_loom.components.runtime import safe_files

ABORT_FILE = "SPIKE_ABORT.txt"


def non_finite_statistic(seg_loss: float, non_finite_pieces: float) -> str | None:
    """ "non-finite loss" / "non-finite gradient" when a segment's all-reduced statistics hold an inf
    or a NaN (never stepped on, whatever the guard says: the run stops), else None."""
    if not math.isfinite(seg_loss):
        return "non-finite loss"
    return "non-finite gradient" if non_finite_pieces else None


class DivergenceMonitor:
    """Counts consecutive skipped steps; ``after_step`` returns the reason to stop, or None.

    The streak lives in ``state`` (the TrainState, saved in every checkpoint), so a run resumed in
    the middle of a streak still reaches its abort.

    Args:
        abort_on_spike: stop at the first skipped step (spike_guard.abort_on_spike).
        max_consecutive_skips: stop after this many skipped steps in a row (0: never).
        state: the TrainState holding ``consecutive_skips``.
    """

    def __init__(self, abort_on_spike: bool, max_consecutive_skips: int, state) -> None:
        self.abort_on_spike = abort_on_spike
        self.max_consecutive_skips = max_consecutive_skips
        self.state = state

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
                f"non-finite weights after step {step} ({', '.join(nonfinite)}); stopping without "
                f"saving. Lower optimizer.lr or resume from an earlier step"
            )
        if (
            nonfinite_stat
        ):  # the weights before this step already produce it: a skip would repeat it
            return (
                f"{nonfinite_stat} at step {step}; stopping without saving this step (its update was "
                f"not applied). Lower optimizer.lr and resume from an earlier checkpoint "
                f"(checkpoint.load_step)"
            )
        if skip_reason is None:
            self.state.consecutive_skips = 0
            return None
        self.state.consecutive_skips += 1
        n = self.state.consecutive_skips
        if self.abort_on_spike:
            return (
                f"loss spike at step {step}: {skip_reason}; stopping (spike_guard.abort_on_spike="
                f"true). Set --spike_guard.abort_on_spike false to skip spikes and continue."
            )
        if self.max_consecutive_skips and n >= self.max_consecutive_skips:
            return (
                f"{n} consecutive skipped steps (spike_guard.max_consecutive_skips = "
                f"{self.max_consecutive_skips}), the last at step {step}: {skip_reason}; the run "
                f"diverged, stopping without saving this step"
            )
        return None


def write_abort(dump_folder: str, msg: str) -> None:
    """SPIKE_ABORT.txt in the run folder (rank 0 only calls this), never through a link; one that
    cannot be written is a warning: the stop itself goes on."""
    try:
        safe_files.atomic_write(os.path.join(dump_folder, ABORT_FILE), msg + "\n", dump_folder)
    except OSError as exc:
        print(f"warning: {ABORT_FILE} not written: {exc}", file=sys.stderr, flush=True)
