"""LOOM's segmented step (LOOM_SPEC §6 with the §14 decisions) as an object built from its parts.

``SegmentedStep(parts)(batch)`` runs ⌈H/K⌉ backprop segments (the first few of them when the depth is
sampled per step: depth_sampling.py), each in three pieces:
``_backward_segment`` (forward/backward of every micro-batch), ``_finish_segment`` (the gradients
reduced, the segment's one all-reduce of statistics with every rank's stop flag) and ``_update``
(the decision order non-finite → spike → clip → step, in one place). ``StepParts`` names all it
reads, so a test builds a step without a Trainer (tests/unit/test_step_alone.py); build.py builds
one from the Trainer's parts and the Trainer (loop.py) calls it once per step. The model is reached
only through ``protocols.ModelProtocol``.

Legend (the package's, see protocols.py): B rows, S sequence length, L layers, H loops, T loops of a
segment, E routed experts.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from torchtitan_loom.components.exit_training import ExitTraining
from torchtitan_loom.components.loss import count_valid, token_ce_sum
from torchtitan_loom.components.optim.divergence import non_finite_statistic
from torchtitan_loom.components.runtime.train_state import StepAbandoned, StepResult, TrainState
from torchtitan_loom.data_contract import real_tokens
from torchtitan_loom.depth_sampling import DepthSampler
from torchtitan_loom.distributed import utils as dist_utils
from torchtitan_loom.loop_request import LoopRequest
from torchtitan_loom.protocols import ModelProtocol, UpdatesAfterStep

Batch = dict[str, torch.Tensor]


@dataclass
class StepParts:
    """Everything one step reads or changes, each a part the Trainer built (build.py)."""

    model: ModelProtocol
    params: list[torch.Tensor]
    """The trainable parameters the clip, the statistics and the diagnostics read (all but a
    learned exit head's, which the optimizer steps unclipped: components/exit_training.py)."""
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    """Stepped once per global step (torch.optim.lr_scheduler.LRScheduler)."""
    finish_gradients: Callable[[], None]
    """Parallelized.finish_gradients: sums what the parallel wrappers did not reduce."""
    before_micro_batch: Callable[[bool], None]
    """Parallelized.before_micro_batch: last=True before a segment's final micro-batch."""
    spike_guard: Any
    """components/optim/spike_guard.SpikeGuard: check, breach, accept per segment."""
    state: TrainState
    segments: list[tuple[int, int]]
    """The backprop segments' loop ranges (protocols.segments)."""
    stop_signals: Any
    """components/runtime/preemption.PreemptionWatcher: flag_tensor() and observe(flag)."""
    diagnostics: Any
    """components/observability/diagnostics: begin(step) -> a recorder or None."""
    micro_batches: Callable[[Batch], list[Batch]]
    """The global batch rows of this rank -> micro-batches on the device."""
    autocast: Callable[[], contextlib.AbstractContextManager]
    max_norm: float
    """training.max_norm: the clip of the global gradient norm."""
    dp_degree: int
    """Data-parallel ranks: the aux loss is averaged over micro-batches × ranks."""
    device: torch.device
    after_optimizer_step: Callable[[], None] | None = None
    """Called after each optimizer step (float8: the tensorwise scales' precompute)."""
    depth: DepthSampler | None = None
    """training.sample_depth_min / _max: how many of the segments step s runs (None: all of them;
    with sample_depth_max, ``segments`` go on past the model's H)."""
    learned_exit: bool = False
    """The model has a learned exit head (protocols.ExitsPerToken.exit_parameters): its loss
    joins each segment's (components/exit_training.py)."""


class SegmentedStep:
    """One global step of segmented backprop over ``parts`` (called once per training step)."""

    def __init__(self, parts: StepParts) -> None:
        self.parts = parts
        self.exit: ExitTraining | None = None  # the learned exit head's loss of this step

    def __call__(self, batch: Batch) -> StepResult:
        """One global step: ⌈H/K⌉ segments, each _backward_segment → _finish_segment → _update,
        then the expert-bias update and the schedule."""
        p = self.parts
        micro = p.micro_batches(batch)
        # The divisor of every micro-batch loss: valid targets of the whole GLOBAL batch, so the
        # summed gradient is the token mean whatever the world size and micro-batching (§14).
        # Kept on the device (read with segment 1's statistics, no sync of its own); an integer
        # < 2^24 is exact in fp32, so ce_sum / denom_t equals the division by the Python count.
        n_valid_t = dist_utils.all_reduce(
            torch.stack([count_valid(m["labels"]) for m in micro])
            .sum()
            .to(torch.float64)
            .reshape(1)
        )
        n_layers, n_experts = p.model.routing or (0, 0)
        # One column per loop a step may run (past H with training.sample_depth_max).
        n_loops = p.segments[-1][1]
        out = StepResult(
            counts_LHE=torch.zeros(
                n_layers, n_loops, n_experts, dtype=torch.int64, device=p.device
            ),
            lr=p.optimizer.param_groups[0]["lr"],
        )
        carries: list[Any] = [None] * len(micro)
        self.exit = ExitTraining(len(micro), p.device) if p.learned_exit else None
        diag = p.diagnostics.begin(p.state.step + 1)  # None on most steps: nothing extra
        # Depth training: the first n segments only (a pure function of the step: every rank and
        # every resume runs the same ones); the loops after them neither run nor count.
        n_run = len(p.segments) if p.depth is None else p.depth.segments_at(p.state.step + 1)
        for j in range(n_run):
            ce_total = self._backward_segment(j, micro, carries, n_valid_t, out.counts_LHE, diag)
            stats = self._finish_segment(j, ce_total, n_valid_t, diag)
            out.n_valid = stats.n_valid
            if not self._update(j, stats, out):
                break
        # The model's after-step update (LOOM: expert bias, §5.2) once per global step, from the
        # counts summed over loops, micro-batches and ranks; none when a segment was skipped. A
        # model without routed experts has no counts to sum (no collective).
        if p.model.routing is not None:
            out.counts_LHE = dist_utils.all_reduce(out.counts_LHE)
        if out.skip_reason is None and isinstance(p.model, UpdatesAfterStep):
            p.model.after_step(out.counts_LHE.sum(1))
        p.lr_scheduler.step()
        p.state.step += 1
        p.state.tokens_seen += int(out.n_valid)
        out.diag = None if diag is None else diag.finish()
        out.exit_scores = None if self.exit is None else self.exit.scalars(dist_utils.all_reduce)
        return out

    def _backward_segment(
        self,
        j: int,
        micro: list[dict[str, torch.Tensor]],
        carries: list[Any],
        n_valid_t: torch.Tensor,
        counts_LHE: torch.Tensor,
        diag: Any,
    ) -> torch.Tensor:
        """Piece 1: zero_grad, then forward/backward of every micro-batch over segment j's loops,
        each starting from its carry; returns the segment's summed token CE (fp64, on the device)."""
        p = self.parts
        a, b = p.segments[j]
        p.optimizer.zero_grad(set_to_none=True)
        denom_t = n_valid_t.clamp_min(1.0)
        aux_divisor = len(micro) * p.dp_degree
        ce_total = torch.zeros((), dtype=torch.float64, device=p.device)
        for m, mb in enumerate(micro):
            p.before_micro_batch(m == len(micro) - 1)  # FSDP reduces after the last one
            with p.autocast():
                observe = None if diag is None else diag.observer(m, real_tokens(mb["doc_ids"]))
                out = p.model(
                    mb["input_ids"],
                    mb["positions"],
                    mb["doc_ids"],
                    loop_start=a,
                    loop_end=b,
                    carry=carries[m],
                    request=LoopRequest(observe=observe),
                )
            ce_sum = token_ce_sum(out.logits_BSV, mb["labels"])
            loss = ce_sum / denom_t.to(ce_sum.dtype).reshape(()) + out.aux_loss / aux_divisor
            if self.exit is not None:
                exit_loss = self.exit.loss(
                    m, out.logits_BSV, mb["labels"], out.exit_gain_BS, denom_t
                )
                loss = loss if exit_loss is None else loss + exit_loss
            loss.backward()
            carries[m] = out.carry.detach()  # truncated BPTT: the next segment starts from values
            ce_total += ce_sum.detach().double()
            if out.counts_LTE is not None:
                counts_LHE[:, a - 1 : b] += out.counts_LTE
            if diag is not None:
                diag.add_forward(a, out.observed_LTNK)
        return ce_total

    def _finish_segment(
        self, j: int, ce_total: torch.Tensor, n_valid_t: torch.Tensor, diag: Any
    ) -> dist_utils.StepStatistics:
        """Piece 2: sum what the parallel wrappers did not reduce (the parallelize seam knows
        which), then the segment's one all-reduce and host sync (loss, gradient norm², non-finite
        count, every rank's stop flag), which the decision and the clip both read. A stop agreed
        at segment 1 abandons the step: no update has happened yet."""
        p = self.parts
        p.finish_gradients()
        if diag is not None:
            diag.add_gradients(j, p.params)
        stats = dist_utils.step_statistics(
            p.params, ce_total, p.stop_signals.flag_tensor(), n_valid_t
        )
        if p.stop_signals.observe(stats.stop_flag) and j == 0:
            raise StepAbandoned
        return stats

    def _update(self, j: int, stats: dist_utils.StepStatistics, out: StepResult) -> bool:
        """Piece 3, the decision order in one place: non-finite → spike → clip → step. Records the
        segment in ``out``; False when it is skipped (the rest of the step with it)."""
        p = self.parts
        a, b = p.segments[j]
        seg_loss = stats.loss_sum / max(stats.n_valid, 1.0)
        out.seg_losses.append(seg_loss)
        # Never stepped on, whatever the guard says; the run then stops (components/optim/divergence.py).
        bad = non_finite_statistic(seg_loss, stats.non_finite)
        if bad:
            out.non_finite = f"{bad} in segment {j + 1} (loops {a}-{b})"
        # Only finite spikes are skipped and trained past.
        skip = bad or p.spike_guard.check(j, seg_loss, p.state.step + 1)
        if skip:
            p.optimizer.zero_grad(set_to_none=True)
            p.state.skipped_segments += 1
            out.skip_reason, out.healthy = f"segment {j + 1} (loops {a}-{b}): {skip}", False
            return False
        out.healthy = out.healthy and p.spike_guard.breach(j, seg_loss) is None  # warm-up too
        dist_utils.clip_grads_with_total_norm(p.params, stats.grad_norm_sq_t, p.max_norm)
        norm_sq = stats.grad_norm_sq  # pre-clip; finite pieces can still overflow their sum
        out.grad_norm = math.sqrt(norm_sq) if math.isfinite(norm_sq) else float("nan")
        p.optimizer.step()
        if p.after_optimizer_step is not None:
            p.after_optimizer_step()
        p.spike_guard.accept(j, seg_loss)
        return True
