"""The learned exit's loss in the segmented step (issue 46 item 1; the head: models/loom/exit_head.py).

At segment j (loops a..b) the model's head reads the detached state after loop a - 1 (the carry the
segment starts from: its stream and its prediction's entropy) and predicts how much loops a..b
lower each token's CE; the target is that drop, CE after loop a - 1 minus CE after loop b, both
detached, and the loss a Huber loss (delta 1 nat: a few tokens' drops of several nats would
otherwise steer a squared loss). The head's inputs and target are values, so its loss trains only
the head, adds nothing to the LM parameters' gradients and never spans a carry boundary: it
composes with segmented backprop. With bp_segment_len K > 1 the decision points are the segment
ends only (the head learns the drop of the next K loops, and the tools let it exit there only:
adaptive_exit.decision_loops); segment 1 has no decision (every token runs it). The loss is a token
mean over the global batch, like the CE.

Legend: B rows, S positions, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from torchtitan_loom.data_contract import IGNORE_INDEX

HUBER_DELTA = 1.0  # nats


class ExitTraining:
    """Per micro-batch, the per-token CE [B, S] after the previous segment (detached), and the
    step's sums of the head's loss and sign-correct predictions over the tokens it was trained on."""

    def __init__(self, n_micro: int, device: torch.device) -> None:
        self.prev_ce_BS: list[torch.Tensor | None] = [None] * n_micro
        # loss sum, predictions whose sign is the drop's, tokens: one all-reduce at the step's end
        self.sums_3 = torch.zeros(3, dtype=torch.float64, device=device)

    def loss(
        self,
        m: int,
        logits_BSV: torch.Tensor,
        labels_BS: torch.Tensor,
        gain_BS: torch.Tensor | None,
        denom_t: torch.Tensor,
    ) -> torch.Tensor | None:
        """The head's loss of micro-batch m in this segment (None before a decision point), and
        this segment's per-token CE kept for the next one."""
        with torch.no_grad():
            ce_BS = F.cross_entropy(
                logits_BSV.detach().float().transpose(1, 2),
                labels_BS,
                ignore_index=IGNORE_INDEX,
                reduction="none",
            )
        prev_BS, self.prev_ce_BS[m] = self.prev_ce_BS[m], ce_BS
        if gain_BS is None or prev_BS is None:
            return None
        valid_BS = labels_BS != IGNORE_INDEX
        drop_BS = prev_BS - ce_BS
        loss_BS = F.huber_loss(gain_BS, drop_BS, reduction="none", delta=HUBER_DELTA)
        loss_sum = (loss_BS * valid_BS).sum()
        with torch.no_grad():
            hit_BS = (gain_BS > 0) == (drop_BS > 0)
            self.sums_3 += torch.stack(
                [loss_sum.double(), (hit_BS & valid_BS).sum().double(), valid_BS.sum().double()]
            )
        return loss_sum / denom_t.to(loss_sum.dtype).reshape(())

    def scalars(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
        """exit_head_loss (token-mean Huber loss over the step's decisions, every rank's) and
        exit_head_accuracy (share whose predicted drop has the sign of the drop), on the device
        (read when the metrics are written); ``reduce`` sums over the data-parallel ranks."""
        loss_sum, hits, n = reduce(self.sums_3.clone()).unbind()
        n = n.clamp_min(1.0)
        return {"exit_head_loss": loss_sum / n, "exit_head_accuracy": hits / n}
