"""Depth training: each step runs only the first D of the H loops, D drawn per step
(training.sample_depth_min; Huginn samples its recurrence count per step, which is what lets it
run deeper at inference than the mean it trained at).

D is drawn uniformly from the ends of the backprop segments that are ≥ the minimum, so a step
runs whole segments: every segment keeps its loops (the spike guard's per-segment statistics
compare like with like) and the last loop of every step is one the model can exit at. The draw
is a pure function of (training.seed, step): every rank draws the same D with no collective, and
a resumed run draws the depths the uninterrupted run would have. The expected loops and head
calls per step feed the FLOPs per token of the log line and the dry run's estimate.

Depth past H (training.sample_depth_max > H): the step's segments go on past the model's H
loops, the segments of H followed by those of the loops H + 1 .. max (so H stays a segment end and
the first segments are the fixed-H run's), and D is drawn from the ends in [min, max] (min 0
meaning H: every step trains the full depth, some steps more). Loops past H run under the "last"
beyond-H policy (router H; BEYOND_POLICY), the tools' default, so the depth report, generate and
lm_eval read such a model as trained. Huginn draws from a heavy-tailed distribution with a cap;
uniform over the segment ends is the plainest distribution whose support reaches the cap.

No torch, and below every layer that uses it (config checks, the estimate, the step).
"""

from __future__ import annotations

import random
from typing import Any

from torchtitan_loom.protocols import segments as segment_ranges

# The router policy of the loops past H that training.sample_depth_max trains (models/loom/depth.py
# names what it means; the tools default to it too).
BEYOND_POLICY = "last"


def step_segments(num_loops: int, seg_len: int, maximum: int) -> list[tuple[int, int]]:
    """The backprop segments a step may run: those of the H loops, then (maximum > H) those of
    loops H + 1 .. maximum, cut the same way."""
    extra = maximum - num_loops
    more = [] if extra <= 0 else segment_ranges(extra, seg_len)
    return segment_ranges(num_loops, seg_len) + [(a + num_loops, b + num_loops) for a, b in more]


def depth_sampling_errors(minimum: int, maximum: int, seg_len: int, args: Any) -> list[str]:
    """training.sample_depth_min / _max against the model's H (args None: the model check failed)."""
    errors = []
    if minimum < 0:
        errors.append(
            f"training.sample_depth_min = {minimum}: must be ≥ 0 (0 = every step runs all H loops)"
        )
    if maximum < 0:
        errors.append(
            f"training.sample_depth_max = {maximum}: must be ≥ 0 (0 = H, no loop past the model's H)"
        )
    H = getattr(args, "num_loops", None)
    if errors or H is None or (minimum == 0 and maximum == 0):
        return errors
    if 0 < maximum < H:
        return [
            f"training.sample_depth_max = {maximum}: 0 or ≥ H = {H} (model.num_loops); it is the "
            f"deepest loop a step may run (fewer loops: training.sample_depth_min)"
        ]
    top = max(H, maximum)
    ends = [b for _, b in step_segments(H, seg_len, maximum)]
    key = "training.sample_depth_min"
    if minimum > top:
        return [
            f"{key} = {minimum}: at most {top} (model.num_loops or training.sample_depth_max); "
            f"a step ends at a segment end ({', '.join(map(str, ends))})"
        ]
    # One choice left: nothing is sampled (a maximum past H leaves H and more: minimum 0 is fine;
    # minimum = maximum > H is no draw but a recipe: every step trains its loops past H).
    if minimum > 0 and len([b for b in ends if b >= minimum]) < 2 and top == H:
        return [
            f"{key} = {minimum}: only one depth is in [{minimum}, {top}] (the segment ends are "
            f"{', '.join(map(str, ends))} with bp_segment_len = {seg_len}): set it to 0, or "
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


def sampler_of(
    segments: list[tuple[int, int]], minimum: int, seed: int, num_loops: int
) -> DepthSampler | None:
    """The run's sampler over its step_segments, or None when every step runs all of them (the
    minimum 0 is H: with no segment past H, one choice)."""
    sampler = DepthSampler(segments, minimum or num_loops, seed)
    return sampler if len(sampler.choices) > 1 else None


def training_depth(t: Any, num_loops: int) -> tuple[list[tuple[int, int]], DepthSampler | None]:
    """A run's segments and sampler from its [training] section (the trainer, the start report
    and the estimate read the same)."""
    segs = step_segments(num_loops, t.bp_segment_len, t.sample_depth_max)
    return segs, sampler_of(segs, t.sample_depth_min, t.seed, num_loops)


def depth_key(t: Any) -> str:
    """The keys a depth-sampling line names, as set."""
    keys = [f"training.sample_depth_min = {t.sample_depth_min}"] if t.sample_depth_min else []
    if t.sample_depth_max:
        keys.append(f"training.sample_depth_max = {t.sample_depth_max}")
    return ", ".join(keys)


def flops_per_token(
    model: Any, seq_len: int, segments: list[tuple[int, int]], sampler: Any
) -> float:
    """Training FLOPs per token of a step, expected over the sampled depths (every segment without
    a sampler): the loops' share scales with the mean depth, the head with the mean segments."""
    no_head = model.flops_per_token(seq_len, head_calls=0)
    head = model.flops_per_token(seq_len, head_calls=1) - no_head
    if sampler is None:
        return no_head * segments[-1][1] / model.num_loops + head * len(segments)
    return no_head * sampler.mean_loops() / model.num_loops + head * sampler.mean_segments()
