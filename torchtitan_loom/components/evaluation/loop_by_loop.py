"""The one loop-by-loop evaluation: the held-out loss after every loop and the routing statistics
of the same forwards, accumulated one micro-batch at a time. The trainer's eval (held_out.py)
and ``tools.analyze`` (tools/analyze_run.py) both run it.

Every loop is run one at a time with the carry, which equals the full forward (tested by the
model), so one pass gives the loss after each loop. A model with routed experts also returns the
expert ids it chose; they are summed into RoutingStats (valid tokens only).

Legend: B rows, S sequence length, H loops, L layers, K top-k.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from torchtitan_loom.components.loss import count_valid, token_ce_sum
from torchtitan_loom.components.observability.routing_stats import RoutingStats
from torchtitan_loom.data_contract import real_tokens
from torchtitan_loom.loop_request import LoopRequest
from torchtitan_loom.protocols import ModelProtocol


def each_loop(
    model: ModelProtocol,
    mb: dict[str, torch.Tensor],
    loops: range,
    carry: Any = None,
    request: LoopRequest | None = None,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> Iterator[tuple[int, Any]]:
    """The one loop-by-loop driver: each loop of ``loops`` run alone on micro-batch ``mb``,
    continuing ``carry`` (None: from the embedding, loops from 1); yields (loop, its output), whose
    ``carry`` the next loop continues. The eval, analyze and the depth tool run loops through it."""
    for loop in loops:
        with autocast():
            out = model(
                mb["input_ids"],
                mb["positions"],
                mb["doc_ids"],
                loop_start=loop,
                loop_end=loop,
                carry=carry,
                request=request,
            )
        carry = out.carry
        yield loop, out


class LoopByLoop:
    """Sums over the micro-batches ``add`` sees: token CE after each loop ``ce_H`` (fp64),
    valid tokens ``n_tok`` (fp64, shape [1]), and the routing statistics (None for a model
    without routed experts). All on ``device``; the caller reduces them over ranks if it must."""

    def __init__(
        self,
        model: ModelProtocol,
        device: torch.device,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ) -> None:
        self.model, self.device, self.autocast = model, device, autocast
        self.num_loops: int = model.num_loops
        self.ce_H = torch.zeros(self.num_loops, dtype=torch.float64, device=device)
        self.n_tok = torch.zeros(1, dtype=torch.float64, device=device)
        self.routing: RoutingStats | None = None

    def add(self, mb: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """One micro-batch (on the device), loops 1..H; returns its expert ids [L, H, B, S, K] (None
        for a model without routed experts)."""
        model = self.model
        n_layers, n_experts = model.routing or (0, 0)
        # The expert ids are asked of routed models only (protocols.ModelProtocol.__call__).
        request = LoopRequest(return_topk=n_experts > 0)
        ids_per_loop = []
        for loop, out in each_loop(
            model, mb, range(1, self.num_loops + 1), request=request, autocast=self.autocast
        ):
            carry = out.carry
            if out.topk_LTBSK is not None:
                if self.routing is None:  # top-k from the ids' own shape, no model field read
                    k = out.topk_LTBSK.shape[-1]
                    self.routing = RoutingStats(n_layers, self.num_loops, n_experts, k, self.device)
                if loop == 1:
                    self.routing.start_batch(real_tokens(mb["doc_ids"]))
                ids_LBSK = out.topk_LTBSK[:, 0]
                self.routing.add_loop(ids_LBSK, model.carry_stream(carry), model.stream_rms(carry))
                ids_per_loop.append(ids_LBSK)
            self.ce_H[loop - 1] += token_ce_sum(out.logits_BSV, mb["labels"]).double()
        self.n_tok += count_valid(mb["labels"])
        return torch.stack(ids_per_loop, dim=1) if ids_per_loop else None
