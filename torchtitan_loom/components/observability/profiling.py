"""[profiling]: torch.profiler traces every profile_freq steps, CUDA memory snapshots (TorchTitan style).

Traces: in every window of ``profile_freq`` steps the profiler waits, records ``profiler_warmup``
steps without keeping them, then keeps ``profiler_active`` steps and writes them as Chrome-trace
JSON to ``<dump_folder>/<save_traces_folder>/iteration_<step>/rank<r>_trace.json`` (open it in
Perfetto or chrome://tracing). Memory snapshots (CUDA only): the allocator's history is recorded
from the start and dumped every ``profile_freq`` steps to
``<dump_folder>/<save_memory_snapshot_folder>/iteration_<step>/rank<r>_memory_snapshot.pickle``
(open it at pytorch.org/memory_viz).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from torchtitan_loom.components.runtime import safe_files
from torchtitan_loom.components.runtime.stderr_filter import dropping_stderr_lines

MEMORY_HISTORY_ENTRIES = 100_000  # allocator events kept for a snapshot
# Lines the profiler's native side (kineto) writes straight to stderr at every start and stop of a
# recording, with no switch to turn them off: dropped; the trace line says what was recorded.
_NATIVE_NOISE = ("USDT:", "STAGE:")


def _without_native_noise(fn: Callable[[], Any]) -> Any:
    with dropping_stderr_lines(lambda line: line.startswith(_NATIVE_NOISE)):
        return fn()


class _QuietProfiler:
    """The profiler as the trainer steps it (``step``), without its native start/stop lines."""

    def __init__(self, prof: torch.profiler.profile) -> None:
        self.prof = prof

    def step(self) -> None:
        _without_native_noise(self.prof.step)


def profile_schedule_problems(freq: int, warmup: int, active: int) -> list[str]:
    """Messages for a profiler schedule that cannot work (empty when it is fine)."""
    errors = []
    if freq < 1:
        errors.append(f"profiling.profile_freq = {freq}: must be ≥ 1")
    if warmup < 0:
        errors.append(f"profiling.profiler_warmup = {warmup}: must be ≥ 0")
    if active < 1:
        errors.append(f"profiling.profiler_active = {active}: must be ≥ 1")
    if not errors and warmup + active > freq:
        errors.append(
            f"profiling.profiler_warmup + profiler_active = {warmup + active}: must be ≤ "
            f"profile_freq = {freq} (one trace per window of profile_freq steps)"
        )
    return errors


@contextlib.contextmanager
def maybe_profile(
    cfg: Any, dump_folder: str, rank: int, log: Callable[[str], None], step_offset: int = 0
) -> Iterator[Any]:
    """Yield a torch.profiler.profile (call .step() after every train step) or None when off.

    ``step_offset`` = the step the run resumes from, so the folder names are global steps.
    """
    if not cfg.enable_profiling:
        yield None
        return
    folder = os.path.join(dump_folder, cfg.save_traces_folder)
    wait = cfg.profile_freq - cfg.profiler_warmup - cfg.profiler_active

    def write_trace(prof: torch.profiler.profile) -> None:
        out = os.path.join(folder, f"iteration_{prof.step_num + step_offset}")
        path = os.path.join(out, f"rank{rank}_trace.json")
        try:  # never through a link planted on the way (safe_files.py)
            safe_files.make_dirs(out, dump_folder)
            safe_files.check_inside(path, dump_folder)
        except OSError as exc:
            log(f"warning: profiler trace not written: {exc}")
            return
        prof.export_chrome_trace(path)
        log(f"profiler trace written: {path}")

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    schedule = torch.profiler.schedule(
        wait=wait, warmup=cfg.profiler_warmup, active=cfg.profiler_active
    )
    prof = torch.profiler.profile(
        activities=activities, schedule=schedule, on_trace_ready=write_trace, record_shapes=True
    )
    # Each trace window starts a new cycle by design (one trace per profile_freq steps): torch's
    # warning that a cycle's events are cleared says what this schedule means to do.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each")
        _without_native_noise(prof.__enter__)
        try:
            yield _QuietProfiler(prof)
        finally:
            _without_native_noise(lambda: prof.__exit__(None, None, None))


class MemorySnapshotter:
    """Records the CUDA allocator history and dumps it every profile_freq steps; on a CPU device it
    only says (once) that there is nothing to record."""

    def __init__(
        self,
        cfg: Any,
        dump_folder: str,
        rank: int,
        device: torch.device,
        log: Callable[[str], None],
    ) -> None:
        self.enabled = bool(cfg.enable_memory_snapshot) and torch.device(device).type == "cuda"
        self.freq = cfg.profile_freq
        self.dump_folder = dump_folder
        self.folder = os.path.join(dump_folder, cfg.save_memory_snapshot_folder)
        self.rank, self.log = rank, log
        if cfg.enable_memory_snapshot and not self.enabled:
            log(
                f"profiling.enable_memory_snapshot: memory snapshots record the CUDA caching allocator; "
                f"this run is on {torch.device(device).type}, so none are written"
            )
        if self.enabled:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)

    def step(self, step: int) -> None:
        if not self.enabled or step % self.freq:
            return
        out = os.path.join(self.folder, f"iteration_{step}")
        path = os.path.join(out, f"rank{self.rank}_memory_snapshot.pickle")
        try:  # never through a link planted on the way (safe_files.py)
            safe_files.make_dirs(out, self.dump_folder)
            safe_files.check_inside(path, self.dump_folder)
        except OSError as exc:
            self.log(f"warning: memory snapshot not written: {exc}")
            return
        torch.cuda.memory._dump_snapshot(path)
        self.log(f"memory snapshot written: {path}")

    def close(self) -> None:
        if self.enabled:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.enabled = False
