"""The learned exit (issue 46 item 1): per token, the predicted drop of its loss over the next
loops, read after a loop.

Its features are what a loop leaves behind: the normed stream z, the entropy of the loop's
next-token prediction, and how deep the loop is (loop / H); a small MLP maps them to nats. An
offline probe on a trained H = 6 debug model chose this over a linear map of z trained on the sign
of the gain (the first version): at equal mean loops the sign classifier lay above the
fixed-depth line, the gain regression on z alone below it, and the MLP with entropy and depth
furthest below (docs/studying_depth.md, "The learned exit").

Every input is read detached, so the head's loss trains only its own parameters and never spans a
carry boundary: it composes with segmented backprop (the trainer: components/exit_training.py).
The output layer starts at zero: every token's predicted gain is 0 until trained.

Legend: B rows, S positions, D model dim, F features (D + 2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Hidden width: small next to D (~64 D parameters), wide enough for the offline screen of
# benchmarks/exit_probe.py.
HIDDEN = 64


def prediction_entropy(logits_BSV: torch.Tensor) -> torch.Tensor:
    """fp32 [B, S] entropy (nats) of the next-token distribution, no gradient."""
    with torch.no_grad():
        logp_BSV = F.log_softmax(logits_BSV.detach().float(), dim=-1)
        return -(logp_BSV.exp() * logp_BSV).sum(dim=-1)


class ExitHead(nn.Module):
    """MLP [z, entropy, loop / H] -> the next loops' predicted loss drop, in nats."""

    def __init__(self, dim: int, num_loops: int) -> None:
        super().__init__()
        self.num_loops = num_loops
        self.w_in = nn.Linear(dim + 2, HIDDEN)
        self.w_out = nn.Linear(HIDDEN, 1)

    def forward(self, z_BSD: torch.Tensor, entropy_BS: torch.Tensor, loop: int) -> torch.Tensor:
        """fp32 [B, S] predicted drop of the token's CE if it runs the loops after ``loop``."""
        z_BSD = z_BSD.detach()
        depth_BS1 = torch.full_like(entropy_BS, loop / self.num_loops)[..., None]
        f_BSF = torch.cat(
            [z_BSD, entropy_BS.detach()[..., None].to(z_BSD.dtype), depth_BS1.to(z_BSD.dtype)], -1
        )
        return self.w_out(F.gelu(self.w_in(f_BSF)))[..., 0].float()
