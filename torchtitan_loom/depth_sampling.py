"""Depth training: each step runs only the first D of the H loops, D drawn per step
(training.sample_depth_min; Huginn samples its recurrence count per step, which is what lets it
run deeper at inference than the mean it trained at).

D is drawn uniformly from the ends of the backprop segments that are ≥ the minimum, so a step
runs whole segments: every segment keeps its loops (the spike guard's per-segment statistics
compare like with like) and the last loop of every step is one the model can exit at. The draw
is a pure function of (training.seed, step): every rank draws the same D with no collective, and
a resumed run draws the depths the uninterrupted run would have. The expected loops and head
calls per step feed the FLOPs per token of the log line and the dry run's estimate.

No torch, and below every layer that uses it (config checks, the estimate, the step).
"""

from __future__ import annotations

import random
from typing import Any

from torchtitan_loom.protocols import segments as segment_ranges


def depth_sampling_errors(minimum: int, seg_len: int, args: Any) -> list[str]:
    """training.sample_depth_min against the model's H (args None: the model check failed)."""
    if minimum == 0:
        return []
    if minimum < 0:
        return [
            f"training.sample_depth_min = {minimum}: must be ≥ 0 (0 = every step runs all H loops)"
        ]
    H = getattr(args, "num_loops", None)
    if H is None:
        return []
    ends = [b for _, b in segment_ranges(H, seg_len)]
    if minimum > H:
        return [
            f"training.sample_depth_min = {minimum}: at most H = {H} (model.num_loops); "
            f"a step ends at a segment end ({', '.join(map(str, ends))})"
        ]
    if len(ends) == 1 or minimum > ends[-2]:  # one choice left: nothing is sampled
        return [
            f"training.sample_depth_min = {minimum}: only one depth is ≥ it ({H}, the segment ends "
            f"are {', '.join(map(str, ends))} with bp_segment_len = {seg_len}): set it to 0, or "
            f"lower, to sample"
        ]
    return []


class DepthSampler:
    """The number of backprop segments step ``s`` runs (``segments_at(s)``)."""

    def __init__(self, segments: list[tuple[int, int]], minimum: int, seed: int) -> None:
        # Choices: a count of leading segments whose last loop is ≥ minimum.
        self.choices = [j + 1 for j, (_, b) in enumerate(segments) if b >= minimum]
        self.segments, self.seed = segments, seed

    def segments_at(self, step: int) -> int:
        """Segments of global step ``step`` (1-based): the same on every rank and every resume."""
        return random.Random(f"depth:{self.seed}:{step}").choice(self.choices)

    def depths(self) -> str:
        """The loop counts a step may run, as a reader says them: "1, 2 or 3"."""
        ends = [str(self.segments[n - 1][1]) for n in self.choices]
        return ends[0] if len(ends) == 1 else f"{', '.join(ends[:-1])} or {ends[-1]}"

    def mean_loops(self) -> float:
        return sum(self.segments[n - 1][1] for n in self.choices) / len(self.choices)

    def mean_segments(self) -> float:
        return sum(self.choices) / len(self.choices)

    def segment_weights(self) -> list[float]:
        """The probability that a step runs segment j, for each j."""
        return [
            sum(n > j for n in self.choices) / len(self.choices) for j in range(len(self.segments))
        ]


def sampler_of(segments: list[tuple[int, int]], minimum: int, seed: int) -> DepthSampler | None:
    """The run's sampler, or None when every step runs all loops."""
    return DepthSampler(segments, minimum, seed) if minimum > 0 else None


def flops_per_token(
    model: Any, seq_len: int, segments: list[tuple[int, int]], sampler: Any
) -> float:
    """Training FLOPs per token of a step, expected over the sampled depths (all H loops without
    a sampler): the loops' share scales with the mean depth, the head with the mean segments."""
    if sampler is None:
        return float(model.flops_per_token(seq_len, head_calls=len(segments)))
    no_head = model.flops_per_token(seq_len, head_calls=0)
    head = model.flops_per_token(seq_len, head_calls=1) - no_head
    return no_head * sampler.mean_loops() / model.num_loops + head * sampler.mean_segments()
