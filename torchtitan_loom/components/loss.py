"""Token cross-entropy pieces for the token-normalised loss (LOOM_SPEC §14).

The trainer computes loss = Σ token CE over the global batch ÷ the global count of valid
tokens (all-reduced), so gradients are the mean gradient whatever the world size and the
micro-batching. This module provides the two local pieces: the CE sum and the valid count.

Legend: B batch rows, S sequence length, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchtitan_loom.data_contract import IGNORE_INDEX


def token_ce_sum(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """Sum of fp32 cross-entropy over positions whose label is not IGNORE_INDEX (0-d tensor).

    Logits are upcast to float32 before the softmax; a batch with no valid label gives 0.
    """
    if logits_BSV.dim() != 3 or labels_BS.shape != logits_BSV.shape[:2]:
        raise ValueError(
            f"token_ce_sum: expected logits [B, S, V] and labels [B, S], got "
            f"{tuple(logits_BSV.shape)} and {tuple(labels_BS.shape)}"
        )
    return F.cross_entropy(
        logits_BSV.flatten(0, 1).float(),
        labels_BS.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def count_valid(labels_BS: torch.Tensor) -> torch.Tensor:
    """Number of positions with a label other than IGNORE_INDEX (0-d int64 tensor, on the labels' device)."""
    return (labels_BS != IGNORE_INDEX).sum(dtype=torch.int64)
