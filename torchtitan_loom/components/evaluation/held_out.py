"""HeldOutEval: the held-out loss after every loop, and the routing statistics of the same forwards
(the loop-by-loop evaluation of loop_by_loop.py), on the trainer's schedule and over its ranks.
A stop signal drops the eval at the next micro-batch.

Legend: B rows, S sequence length, H loops, L layers, T loops of a call, K top-k.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from torchtitan_loom.components.data import build_eval_loader
from torchtitan_loom.components.evaluation.loop_by_loop import LoopByLoop
from torchtitan_loom.components.observability.routing_stats import RoutingStats
from torchtitan_loom.components.runtime.messages import count
from torchtitan_loom.distributed import utils as dist_utils


class HeldOutEval:
    """Built once by the trainer; ``validate(step)`` after the steps the ``[eval]`` section asks for.

    Args:
        cfg: the ``[eval]`` config section (``interval``, ``tokens``, ``batch_size``).
        model: the training model (ModelProtocol); put in eval mode for the pass, then back.
        data_path, val_path: the training pack (its holdout epoch) or a separate validation pack.
        micro_batches: batch → the step's micro-batches on the device.
        autocast: the step's autocast context (the same numerics as training).
        stop_requested: polled per micro-batch; truthy drops the eval.
    """

    def __init__(
        self,
        cfg: Any,
        *,
        model: Any,
        data_path: str,
        val_path: str | None,
        seq_len: int,
        vocab_size: int,
        batch_rows: int,
        dp_rank: int,
        dp_world: int,
        tokenizer_name: str | None,
        device: torch.device,
        micro_batches: Callable[[dict], list[dict]],
        autocast: Callable[[], Any],
        stop_requested: Callable[[], int],
        log: Callable[[str], None],
    ) -> None:
        self.cfg, self.model, self.device, self.log = cfg, model, device, log
        self._loader_args = dict(
            path=data_path,
            seq_len=seq_len,
            vocab_size=vocab_size,
            batch_rows=cfg.batch_size or batch_rows,
            dp_rank=dp_rank,
            dp_world=dp_world,
            val_path=val_path,
            max_tokens=cfg.tokens,
            tokenizer_name=tokenizer_name,
        )
        self._micro_batches, self._autocast, self._stop_requested = (
            micro_batches,
            autocast,
            stop_requested,
        )
        self.last: tuple[int, list[float]] | None = None
        """(step, loss after every loop) of the newest finished eval."""

    def due(self, step: int, last_step: int) -> bool:
        """Whether an eval follows global step ``step`` (every ``interval`` steps and the last one)."""
        return bool(self.cfg.interval) and (step % self.cfg.interval == 0 or step == last_step)

    def _micro(self, loader: Any) -> Iterator[dict[str, torch.Tensor]]:
        for batch in loader:
            yield from self._micro_batches(batch)

    @torch.no_grad()
    def validate(self, step: int) -> tuple[dict[str, float] | None, RoutingStats | None]:
        """The eval scalars (``eval_loss``, ``eval_tokens``, ``eval_loss_loop_t`` and the routing
        summary) and the routing sums; (None, None) when a stop signal interrupted it."""
        model, num_loops = self.model, self.model.num_loops
        started = time.perf_counter()
        loader = build_eval_loader(**self._loader_args)
        read = (
            loader.num_label_tokens
        )  # what this pass reads, which a small holdout keeps below eval.tokens
        short = (
            f" (the holdout holds fewer than eval.tokens = {self.cfg.tokens:,})"
            if read < self.cfg.tokens
            else ""
        )
        self.log(
            f"eval at step {step}: {read:,} holdout tokens{short}, {count(num_loops, 'loop')} ..."
        )
        model.eval()
        try:
            sums = self._run(model, num_loops, loader)
        finally:
            model.train()
        if sums is None:
            return None, None
        ce_H, n_tok, routing = sums
        dist_utils.all_reduce(ce_H)
        dist_utils.all_reduce(n_tok)
        if routing is not None:
            routing.all_reduce(dist_utils.all_reduce)
        losses = (ce_H / n_tok.clamp(min=1)).tolist()
        result = {"eval_loss": losses[-1], "eval_tokens": int(n_tok.item())}
        result.update({f"eval_loss_loop_{i + 1}": v for i, v in enumerate(losses)})
        took = time.perf_counter() - started
        self.log(
            f"eval done in {took:.1f} s ({n_tok.item() / max(took, 1e-9):,.0f} tokens/s): loss after loop "
            + " / ".join(f"{v:.4f}" for v in losses)
        )
        self.last = (step, losses)
        if routing is not None:
            result.update(routing.summary())
        return result, routing

    def _run(
        self, model: Any, num_loops: int, loader: Any
    ) -> tuple[torch.Tensor, torch.Tensor, RoutingStats | None] | None:
        sums = LoopByLoop(model, self.device, self._autocast)
        for mb in self._micro(loader):
            if self._stop_requested():  # a stop signal: drop this eval
                return None
            sums.add(mb)
        return sums.ce_H, sums.n_tok, sums.routing
