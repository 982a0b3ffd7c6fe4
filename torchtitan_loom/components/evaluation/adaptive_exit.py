"""Per-token adaptive depth: the exit criteria, and one pass of a batch under one of them.

A token exits after the first loop where its criterion falls below the threshold; the deepest
loop allowed ends every token still running. Each criterion is a distance that shrinks as the
token's prediction settles, so a threshold of 0 never exits early (fixed depth, exactly):

    "kl"          KL(p_t || p_{t-1}) between successive loops' next-token distributions
                  (Huginn's zero-shot exit); defined from loop 2
    "confidence"  1 - max_v p_t(v): the top token's probability reached 1 - threshold; from loop 1

An exited token's keys and values in deeper loops are its exit loop's (models/loom/kv_hold.py),
so tokens still looping read what a real early-exit run would give them. The pass below still
computes every loop for every token (it measures, it does not save compute); the loops a token
used are counted and reported.

Legend: B rows, S positions, V vocab, T loops.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from torchtitan_loom.data_contract import IGNORE_INDEX
from torchtitan_loom.loop_request import LoopRequest

# The criteria, implemented by settle_score below.
CRITERIA = ("kl", "confidence")


def threshold_problem(criterion: str, threshold: float) -> str | None:
    """What is wrong with (criterion, threshold), or None."""
    if criterion not in CRITERIA:
        return f"exit criterion {criterion!r}: valid {', '.join(CRITERIA)}"
    if not math.isfinite(threshold) or threshold < 0:
        return f"{criterion} threshold {threshold}: must be a finite number ≥ 0 (0 = fixed depth)"
    if criterion == "confidence" and threshold > 1:
        return (
            f"confidence threshold {threshold}: must be in [0, 1] (it bounds 1 - max probability)"
        )
    return None


def settle_score(
    criterion: str, logp_BSV: torch.Tensor, prev_logp_BSV: torch.Tensor | None
) -> torch.Tensor:
    """[B, S] fp32 distance of loop t's prediction from settled (log-probabilities in); +inf where
    the criterion is not defined yet (KL at loop 1)."""
    if criterion == "confidence":
        return 1.0 - logp_BSV.max(dim=-1).values.exp()
    if prev_logp_BSV is None:
        return torch.full(logp_BSV.shape[:2], math.inf, device=logp_BSV.device)
    # KL(p_t || p_{t-1}) = sum p_t (log p_t - log p_{t-1}); clamped: rounding can make it -0.
    kl_BS = (logp_BSV.exp() * (logp_BSV - prev_logp_BSV)).sum(dim=-1)
    return kl_BS.clamp_min(0.0)


class ExitPass(NamedTuple):
    """Sums over the valid tokens of one batch: CE at each token's exit loop, loops used, the
    number of tokens, and how many exited after each loop [T]."""

    ce_sum: float
    loops_sum: float
    tokens: int
    exits_T: list[int]


@torch.no_grad()
def adaptive_pass(
    model: Any,
    batch: dict[str, torch.Tensor],
    criterion: str,
    threshold: float,
    max_loops: int,
) -> ExitPass:
    """Run ``batch`` loop by loop up to ``max_loops`` with per-token exit (see the module doc)."""
    tokens_BS, labels_BS = batch["input_ids"], batch["labels"]
    valid_BS = labels_BS != IGNORE_INDEX
    targets_BS1 = labels_BS.clamp_min(0)[..., None]
    hold = model.new_exit_hold()
    exited_BS = torch.zeros_like(valid_BS)
    exit_ce_BS = torch.zeros(labels_BS.shape, dtype=torch.float64, device=labels_BS.device)
    exit_loop_BS = torch.zeros(labels_BS.shape, dtype=torch.int64, device=labels_BS.device)
    carry, prev_logp = None, None
    for t in range(1, max_loops + 1):
        out = model(
            tokens_BS,
            batch["positions"],
            batch["doc_ids"],
            loop_start=t,
            loop_end=t,
            carry=carry,
            request=LoopRequest(hold=hold),
        )
        carry = out.carry
        logp_BSV = F.log_softmax(out.logits_BSV.float(), dim=-1)
        ce_BS = -logp_BSV.gather(-1, targets_BS1)[..., 0]
        settled_BS = settle_score(criterion, logp_BSV, prev_logp) < threshold
        new_BS = ~exited_BS & (settled_BS | (t == max_loops))
        exit_ce_BS = torch.where(new_BS, ce_BS.double(), exit_ce_BS)
        exit_loop_BS = torch.where(new_BS, t, exit_loop_BS)
        hold.exit(new_BS)
        exited_BS |= new_BS
        prev_logp = logp_BSV
        if bool(
            (exited_BS | ~valid_BS).all()
        ):  # every target has its answer: deeper loops change none
            break
    exit_loop_BS = torch.where(exited_BS, exit_loop_BS, t)  # padding that never exited
    loops_V = exit_loop_BS[valid_BS]
    return ExitPass(
        float(exit_ce_BS[valid_BS].sum()),
        float(loops_V.sum()),
        int(valid_BS.sum()),
        torch.bincount(loops_V - 1, minlength=max_loops).tolist(),
    )
