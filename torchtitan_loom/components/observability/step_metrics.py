"""What the trainer reports after a global step, through the MetricsLogger and one console line.

A log step (every ``metrics.log_freq`` steps, the last step and every skipped one) writes the loss of
the last segment and of each segment, the lr, the pre-clip gradient norm, tokens/s, TFLOP/s and MFU
over the steps since the previous log line (eval time excluded), memory, and the eval scalars when
an eval ran; diagnostic steps add the ``diag/…`` keys and downstream steps ``downstream/…``. The expert load per layer, loop and expert rides along every ``expert_load_every``
steps (0: with each eval); eval steps also write the routing images when enabled.

Legend: L layers, H loops, E routed experts.
"""

from __future__ import annotations

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


class StepMetrics:
    """Args:
    cfg: the ``[metrics]`` config section.
    logger: where the records go.
    tokens_per_step: global batch rows × sequence length.
    flops_per_token, peak_flops: for TFLOP/s and MFU (``metrics.throughput``).
    first_step: the step counter when the loop starts (the rate's origin).
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
    ) -> None:
        self.cfg, self.logger, self.device, self.log = cfg, logger, device, log
        self.tokens_per_step, self.flops_per_token, self.peak_flops = (
            tokens_per_step,
            flops_per_token,
            peak_flops,
        )
        self._since, self._since_step = time.perf_counter(), first_step

    def is_log_step(self, step: int, last_step: int, skipped: bool) -> bool:
        return step % self.cfg.log_freq == 0 or step == last_step or skipped

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside (an eval) does not count towards tokens/s."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self._since += time.perf_counter() - started

    def train_scalars(self, step: int, result: Any, tokens_seen: int) -> dict[str, Any]:
        """The step's training scalars (``result``: the trainer's StepResult); resets the rate window."""
        now = time.perf_counter()
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
            self.log(format_console_line(step, scalars))

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
