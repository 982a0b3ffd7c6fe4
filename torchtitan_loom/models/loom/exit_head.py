"""The learned exit (issue 46 item 1): a per-token linear score of the loop's normed stream, the
logit of P(the next loops lower this token's loss).

It reads the stream detached, so its loss trains only its own D + 1 parameters and never spans a
carry boundary: it composes with segmented backprop (the trainer: components/exit_training.py). Zero init:
P = 1/2 everywhere until trained, whatever the layout.

Legend: B rows, S positions, D model dim.
"""

from __future__ import annotations

import torch
from torch import nn


class ExitHead(nn.Module):
    """Linear D -> 1 on the stream after a loop's closing RMSNorm."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 1)

    def forward(self, z_BSD: torch.Tensor) -> torch.Tensor:
        """fp32 logits [B, S] of P(next loops help), from the detached stream."""
        return self.proj(z_BSD.detach())[..., 0].float()
