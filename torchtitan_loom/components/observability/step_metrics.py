"""What the trainer reports after a global step, through the MetricsLogger and one console line.

A log step (every ``metrics.log_freq`` steps, the last step and every skipped one) writes the loss of
the last segment and of each segment, the lr, the pre-clip gradient norm, tokens/s, TFLOP/s and MFU
over the steps since the previous log line (eval time excluded), memory, and the eval scalars when
an eval ran; the console line also shows ``step N/TOTAL`` and an ETA: the wall time per step over
the last ``ETA_WINDOW`` steps (eval, checkpoint saves and everything else between steps included;
the first step, which compiles, is not), times the steps left; diagnostic steps add the ``diag/…`` keys and downstream steps ``downstream/…``. The expert load per layer, loop and expert rides along every ``expert_load_every``
steps (0: with each eval); eval steps also write the routing images when enabled.

Legend: L layers, H loops, E routed experts.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from torchtitan_loom.components.observability.metrics import (
    MetricsLogger,
    format_console_line,
    memory_stats,
    throughput,
)
from torchtitan_loom.components.runtime.messages import count

# Steps whose wall time the ETA averages: long enough to hold two evals of the presets (every 60
# or 500 steps), short against their 10,000 to 57,000 steps, so it follows a change of pace.
ETA_WINDOW = 1000


class StepMetrics:
    """Args:
    cfg: the ``[metrics]`` config section.
    logger: where the records go.
    tokens_per_step: global batch rows × sequence length.
    flops_per_token, peak_flops: for TFLOP/s and MFU (``metrics.throughput``).
    first_step: the step counter when the loop starts (the rate's origin).
    total_steps: training.steps (the ``step N/TOTAL`` and the ETA).
    compiling: how many modules torch.compile compiles (0: off); the first step compiles them,
        said before and after.
    clock: seconds, for the rates and the ETA (a test passes its own).

    Constructed just before the first step of a launch.
    """

    def __init__(
        self,
        cfg: Any,
        logger: MetricsLogger,
        *,
        tokens_per_step: int,
        flops_per_token: float,
        peak_flops: float | None,
        device: torch.device,
        first_step: int,
        log: Callable[[str], None],
        total_steps: int | None = None,
        compiling: int = 0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.cfg, self.logger, self.device, self.log, self.clock = cfg, logger, device, log, clock
        self.tokens_per_step, self.flops_per_token, self.peak_flops = (
            tokens_per_step,
            flops_per_token,
            peak_flops,
        )
        self._since, self._since_step = self.clock(), first_step
        self.total_steps, self._compiling, self._started = total_steps, compiling, self._since
        self._done: collections.deque[tuple[int, float]] = collections.deque(maxlen=ETA_WINDOW + 1)
        if compiling:
            self.log(f"compiling {count(compiling, 'module')} (first step) ...")
        else:  # the first step line may be a minute away: say what the silence is
            self.log(self._first_line(first_step))

    def _first_line(self, done: int) -> str:
        """What runs until the first step line, after ``done`` steps."""
        every = self.cfg.log_freq
        first_log = (done // every + 1) * every
        if self.total_steps is not None:
            first_log = min(first_log, max(self.total_steps, done + 1))
        upto = "" if self.total_steps is None else f" to {self.total_steps}"
        return (
            f"training from step {done + 1}{upto}: a step line every "
            f"{count(every, 'step')} (metrics.log_freq), the first after step {first_log} ..."
        )

    def step_done(self, step: int) -> None:
        """The training part of ``step`` finished (called before its eval and save)."""
        now = self.clock()
        if not self._done and self._compiling:
            self.log(f"first step done in {now - self._started:.1f} s (compiling included)")
        self._done.append((step, now))

    def eta_seconds(self, step: int) -> float | None:
        """Seconds until training.steps at the recent pace; None before two steps are timed."""
        if self.total_steps is None or len(self._done) < 2 or step >= self.total_steps:
            return None
        (s0, t0), (s1, t1) = self._done[0], self._done[-1]
        return (t1 - t0) / (s1 - s0) * (self.total_steps - step)

    def is_log_step(self, step: int, last_step: int, skipped: bool) -> bool:
        return step % self.cfg.log_freq == 0 or step == last_step or skipped

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside (an eval) does not count towards tokens/s."""
        started = self.clock()
        try:
            yield
        finally:
            self._since += self.clock() - started

    def train_scalars(self, step: int, result: Any, tokens_seen: int) -> dict[str, Any]:
        """The step's training scalars (``result``: the trainer's StepResult); resets the rate window."""
        now = self.clock()
        rate = throughput(
            self.tokens_per_step * (step - self._since_step),
            now - self._since,
            self.flops_per_token,
            self.peak_flops,
        )
        self._since, self._since_step = now, step
        scalars = {
            "loss": result.seg_losses[-1],
            "lr": result.lr,
            "grad_norm": result.grad_norm,
            **rate,
            "skipped": int(result.skip_reason is not None),
            "tokens_seen": tokens_seen,
        }
        scalars.update({f"loss_segment_{j + 1}": v for j, v in enumerate(result.seg_losses)})
        if result.exit_scores is not None:  # the learned exit (components/exit_training.py)
            scalars.update({k: float(v) for k, v in result.exit_scores.items()})
        scalars.update(memory_stats(self.device))
        return scalars

    def write(
        self, step: int, scalars: dict[str, Any], result: Any, routing: Any, console: bool = True
    ) -> None:
        """One record (JSONL, TensorBoard, wandb), the routing images of an eval, the console line
        (``console``: False when the record only carries diagnostics or downstream scores)."""
        every = self.cfg.expert_load_every
        with_load = routing is not None if every == 0 else step % every == 0
        extra: dict[str, Any] = {"expert_load": result.counts_LHE.tolist()} if with_load else {}
        if result.skip_reason:
            extra["skip_reason"] = result.skip_reason
        self.logger.log(step, scalars, extra)
        if routing is not None:
            self.routing_images(step, scalars, routing)
        if console:
            self.log(format_console_line(step, scalars, self.total_steps, self.eta_seconds(step)))

    def routing_images(self, step: int, scalars: dict[str, Any], routing: Any) -> None:
        """TensorBoard images of an eval: one loop × expert load heatmap per layer, the loss per loop."""
        if not (self.cfg.routing_images and self.logger.writes_images):
            return
        from torchtitan_loom.components.observability.routing_plots import (
            heatmap_image,
            loss_curve_image,
        )

        share_LHE = routing.load_share_LHE().cpu().numpy()
        for layer, share_HE in enumerate(share_LHE):
            self.logger.log_image(
                f"routing/load_layer_{layer}",
                heatmap_image(share_HE, f"expert load, layer {layer}, step {step} (eval tokens)"),
                step,
            )
        losses = [scalars[f"eval_loss_loop_{t}"] for t in range(1, share_LHE.shape[1] + 1)]
        self.logger.log_image(
            "eval/loss_per_loop",
            loss_curve_image(losses, f"held-out loss after each loop, step {step}"),
            step,
        )
