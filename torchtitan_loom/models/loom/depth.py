"""Loops past the trained depth H, and the range check of a forward (LOOM_SPEC §14, depth).

Routers exist for loops 1..H only (one per loop). A loop t > H needs a policy for which router it
uses; everything else a loop reads is defined for any t (gamma is the trained H's, g_t is the
formula of model.inject_gain, the expert bias is per layer). The policies:

    "last"   router H for every loop past H (the deepest trained router keeps refining)
    "cycle"  router ((t - 1) mod H) + 1 (the trained sequence of routers again)

The depth report (tools/depth.py) measures both; "last" is the default (docs/studying_depth.md has
the numbers), and the policy a trainer sets when training.sample_depth_max trains loops past H
(depth_sampling.BEYOND_POLICY). Without a policy a forward past H is refused.
"""

from __future__ import annotations

import torch

# The beyond-H policies are named in the protocol (every tool offers them); their meaning for LOOM
# is router_index below.
from torchtitan_loom.protocols import BEYOND_POLICIES


def router_index(t: int, num_loops: int, per_loop: bool, beyond: str | None) -> int:
    """0-based index of loop t's router (1-based t): t - 1 within H, the policy's past H."""
    if not per_loop:
        return 0
    if t <= num_loops:
        return t - 1
    if beyond == "cycle":
        return (t - 1) % num_loops
    return num_loops - 1  # "last"


def check_beyond(policy: str | None) -> None:
    if policy is not None and policy not in BEYOND_POLICIES:
        raise ValueError(
            f"beyond-H policy {policy!r}: valid {', '.join(BEYOND_POLICIES)} (or None: refuse)"
        )


def check_inputs(
    tokens_BS: torch.Tensor,
    positions_BS: torch.Tensor,
    doc_ids_BS: torch.Tensor,
    loop_start: int,
    loop_end: int,
    *,
    carry_z_BSD: torch.Tensor | None,
    max_seq_len: int,
    num_loops: int,
    beyond: str | None,
) -> None:
    """Shape and range checks of a forward (value checks would need a host sync)."""
    H = num_loops
    if tokens_BS.dim() != 2:
        raise ValueError(f"tokens_BS must be [B, S], got shape {tuple(tokens_BS.shape)}")
    if positions_BS.shape != tokens_BS.shape or doc_ids_BS.shape != tokens_BS.shape:
        raise ValueError(
            f"positions_BS {tuple(positions_BS.shape)} and doc_ids_BS {tuple(doc_ids_BS.shape)} "
            f"must have the shape of tokens_BS {tuple(tokens_BS.shape)}"
        )
    if tokens_BS.shape[1] > max_seq_len:
        raise ValueError(f"sequence length {tokens_BS.shape[1]} exceeds max_seq_len={max_seq_len}")
    if not 1 <= loop_start <= loop_end:
        raise ValueError(
            f"loop range [{loop_start}, {loop_end}] invalid: need 1 <= loop_start <= loop_end"
        )
    if loop_end > H and beyond is None:
        raise ValueError(
            f"loop range [{loop_start}, {loop_end}] invalid: loops past the trained H={H} need a "
            f"policy for their routers first (set_beyond_policy: {', '.join(BEYOND_POLICIES)})"
        )
    if loop_start == 1 and carry_z_BSD is not None:
        raise ValueError("loop_start=1 starts from the embedding: pass carry=None")
    if loop_start > 1 and carry_z_BSD is None:
        raise ValueError(
            f"loop_start={loop_start} continues a forward: pass the carry of loops [1, {loop_start - 1}]"
        )
    if carry_z_BSD is not None and carry_z_BSD.shape[:2] != tokens_BS.shape:
        raise ValueError(
            f"carry.z_BSD shape {tuple(carry_z_BSD.shape)} does not match tokens {tuple(tokens_BS.shape)}"
        )
