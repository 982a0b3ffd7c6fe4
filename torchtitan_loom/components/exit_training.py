"""The learned exit's loss in the segmented step (issue 46 item 1; the head: models/loom/exit_head.py).

At segment j (loops a..b) the model's head reads the detached stream after loop a - 1 (the carry
the segment starts from) and is trained with binary cross-entropy toward the target "loops a..b
lower this token's CE": CE after loop b < CE after loop a - 1, both detached. The head's input and
target are values, so its loss trains only the head, adds nothing to the LM parameters' gradients
and never spans a carry boundary: it composes with segmented backprop. With bp_segment_len K > 1
the decision points are the segment ends only (the head then predicts the gain of K loops);
segment 1 has no decision (every token runs loop 1). The loss is a token mean over the global
batch, like the CE.

Legend: B rows, S positions, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchtitan_loom.data_contract import IGNORE_INDEX


class ExitTraining:
    """Per micro-batch, the per-token CE [B, S] after the previous segment (detached), and the
    step's sums of the head's loss and correct decisions over the tokens it was trained on."""

    def __init__(self, n_micro: int, device: torch.device) -> None:
        self.prev_ce_BS: list[torch.Tensor | None] = [None] * n_micro
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.correct = torch.zeros((), dtype=torch.float64, device=device)
        self.tokens = torch.zeros((), dtype=torch.float64, device=device)

    def loss(
        self,
        m: int,
        logits_BSV: torch.Tensor,
        labels_BS: torch.Tensor,
        exit_logit_BS: torch.Tensor | None,
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
        if exit_logit_BS is None or prev_BS is None:
            return None
        valid_BS = labels_BS != IGNORE_INDEX
        target_BS = (ce_BS < prev_BS).float()
        bce_BS = F.binary_cross_entropy_with_logits(exit_logit_BS, target_BS, reduction="none")
        bce_sum = (bce_BS * valid_BS).sum()
        with torch.no_grad():
            self.loss_sum += bce_sum.double()
            hit_BS = (exit_logit_BS > 0) == (target_BS > 0.5)
            self.correct += (hit_BS & valid_BS).sum().double()
            self.tokens += valid_BS.sum().double()
        return bce_sum / denom_t.to(bce_sum.dtype).reshape(())

    def scalars(self) -> dict[str, torch.Tensor]:
        """exit_head_loss (token-mean BCE over this rank's decisions of the step: not reduced over
        ranks) and exit_head_accuracy, on the device (read when the metrics are written)."""
        n = self.tokens.clamp_min(1.0)
        return {"exit_head_loss": self.loss_sum / n, "exit_head_accuracy": self.correct / n}
