"""Per-token adaptive depth: the exit criteria, and one pass of a batch under one of them.

A token exits after the first loop where its criterion falls below the threshold; the deepest
loop allowed ends every token still running. Each criterion is a distance that shrinks as the
token's prediction settles, so a threshold of 0 never exits early (fixed depth, exactly):

    "kl"          KL(p_t || p_{t-1}) between successive loops' next-token distributions
                  (Huginn's zero-shot exit); defined from loop 2
    "confidence"  1 - max_v p_t(v): the top token's probability reached 1 - threshold; from loop 1
    "learned"     the drop of the token's loss (nats) the model's trained exit head predicts
                  for the next loops (model.exit_head, models/loom/exit_head.py; below 0 read as
                  0); only after the loops the head was trained to decide at, the run's backprop
                  segment ends, from loop 2 (decision_loops)

An exited token's keys and values in deeper loops are its exit loop's (models/loom/kv_hold.py),
so tokens still looping read what a real early-exit run would give them. The pass below still
computes every loop for every token (it measures, it does not save compute); the loops a token
used are counted and reported.

Legend: B rows, S positions, V vocab, T loops.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from torchtitan_loom.components.evaluation.loop_by_loop import each_loop
from torchtitan_loom.data_contract import IGNORE_INDEX
from torchtitan_loom.depth_sampling import step_segments
from torchtitan_loom.loop_request import LoopRequest
from torchtitan_loom.protocols import ExitsPerToken

# The criteria, implemented by exit_score below.
CRITERIA = ("kl", "confidence", "learned")


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


# The first loop after which the learned head may stop a token. A token stopped after loop 1
# shows every deeper loop its loop-1 keys and values, far from what those loops were trained to
# attend to: on the H = 6 study's seed-0 run (benchmarks/exit_probe.py --causal-first-loop), with
# loop 1 allowed the head's exits needed up to 91% more loops than fixed depth for their loss; from
# loop 2 on, 20% fewer at 2.09 loops (docs/studying_depth.md). KL starts at loop 2 by definition.
FIRST_LEARNED_EXIT = 2


def decision_loops(criterion: str, num_loops: int, training: Any) -> frozenset[int] | None:
    """The loops after which `criterion` may exit a token; None: after any. The learned head
    was trained to decide at the run's segment ends only (components/exit_training.py), so it
    is asked there only, from FIRST_LEARNED_EXIT on: ``training`` is the run's [training]
    section (bp_segment_len, sample_depth_max), None when the checkpoint has no config
    (ValueError for learned)."""
    if criterion != "learned":
        return None
    if training is None:
        raise ValueError(
            "exit criterion learned: the checkpoint has no config.toml, so the loops its exit "
            "head was trained to decide at (the backprop segment ends) are unknown"
        )
    ends = [
        b for _, b in step_segments(num_loops, training.bp_segment_len, training.sample_depth_max)
    ]
    return frozenset(e for e in ends[:-1] if e >= FIRST_LEARNED_EXIT)


def model_problem(criterion: str, model: Any) -> str | None:
    """What stops `model` from exiting by `criterion`, or None (learned needs the exit head)."""
    if criterion == "learned" and not (
        isinstance(model, ExitsPerToken) and model.exit_parameters()
    ):
        return (
            "exit criterion learned: this checkpoint has no exit head (train it with "
            "model.exit_head = true); valid here: kl, confidence"
        )
    return None


def exit_score(
    criterion: str,
    model: Any,
    carry: Any,
    loop: int,
    logp_BSV: torch.Tensor,
    prev_logp_BSV: torch.Tensor | None,
    decide_at: frozenset[int] | None = None,
) -> torch.Tensor:
    """[B, S] fp32 score of loop `loop` for `criterion` (exit where it is below the threshold):
    the model's predicted drop, floored at 0, for learned, else settle_score; +inf after a loop
    not in `decide_at` (None: every loop decides)."""
    if decide_at is not None and loop not in decide_at:
        return torch.full(logp_BSV.shape[:2], math.inf, device=logp_BSV.device)
    if criterion == "learned":
        return model.exit_gain(carry, loop).clamp_min(0.0)
    return settle_score(criterion, logp_BSV, prev_logp_BSV)


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


class ExitRule(NamedTuple):
    """A per-token exit: the criterion, its threshold, the deepest loop and the loops after which
    a token may exit (None: any; decision_loops)."""

    criterion: str
    threshold: float
    max_loops: int
    decide_at: frozenset[int] | None = None


class LoopExits(NamedTuple):
    """One loop of an exit run: the loop, its output, its log-probabilities [B, S, V] and the
    tokens that exit after it [B, S]."""

    loop: int
    out: Any
    logp_BSV: torch.Tensor
    new_BS: torch.Tensor


def exit_run(
    model: Any, batch: dict[str, torch.Tensor], rule: ExitRule, needed_BS: torch.Tensor
) -> Iterator[LoopExits]:
    """Run ``batch`` loop by loop up to ``rule.max_loops``, each token stopping after the first
    loop where its criterion is below the threshold (the deepest ends the rest); stops once every
    token of ``needed_BS`` has exited (deeper loops change none of them). ValueError (one line)
    when the model cannot exit by the criterion. The one loop of adaptive_pass and adaptive_logits."""
    problem = model_problem(rule.criterion, model)
    if problem:
        raise ValueError(problem)
    hold = model.new_exit_hold()
    exited_BS = torch.zeros_like(needed_BS)
    prev_logp = None
    loops = range(1, rule.max_loops + 1)
    for t, out in each_loop(model, batch, loops, request=LoopRequest(hold=hold)):
        logp_BSV = F.log_softmax(out.logits_BSV.float(), dim=-1)
        score_BS = exit_score(
            rule.criterion, model, out.carry, t, logp_BSV, prev_logp, rule.decide_at
        )
        new_BS = ~exited_BS & ((score_BS < rule.threshold) | (t == rule.max_loops))
        hold.exit(new_BS)
        exited_BS |= new_BS
        prev_logp = logp_BSV
        yield LoopExits(t, out, logp_BSV, new_BS)
        if bool((exited_BS | ~needed_BS).all()):
            return


@torch.no_grad()
def adaptive_pass(
    model: Any,
    batch: dict[str, torch.Tensor],
    criterion: str,
    threshold: float,
    max_loops: int,
    decide_at: frozenset[int] | None = None,
) -> ExitPass:
    """The sums of ExitPass over ``batch``'s valid targets under per-token exit (exit_run;
    exits only after the loops of ``decide_at``, None: any)."""
    labels_BS = batch["labels"]
    valid_BS = labels_BS != IGNORE_INDEX
    targets_BS1 = labels_BS.clamp_min(0)[..., None]
    exit_ce_BS = torch.zeros(labels_BS.shape, dtype=torch.float64, device=labels_BS.device)
    exit_loop_BS = torch.zeros(labels_BS.shape, dtype=torch.int64, device=labels_BS.device)
    rule = ExitRule(criterion, threshold, max_loops, decide_at)
    for step in exit_run(model, batch, rule, valid_BS):
        ce_BS = -step.logp_BSV.gather(-1, targets_BS1)[..., 0]
        exit_ce_BS = torch.where(step.new_BS, ce_BS.double(), exit_ce_BS)
        exit_loop_BS = torch.where(step.new_BS, step.loop, exit_loop_BS)
    loops_V = exit_loop_BS[valid_BS]
    return ExitPass(
        float(exit_ce_BS[valid_BS].sum()),
        float(loops_V.sum()),
        int(valid_BS.sum()),
        torch.bincount(loops_V - 1, minlength=max_loops).tolist(),
    )


@torch.no_grad()
def adaptive_logits(
    model: Any, batch: dict[str, torch.Tensor], rule: ExitRule
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 log-probabilities [B, S, V] of each token at its exit loop, its exit loop [B, S]) of
    ``batch`` (input_ids, positions, doc_ids; doc -1 = padding) under ``rule``: what lm_eval
    scores. Padding that never exited keeps loop 1's (no real token reads it: causal)."""
    needed_BS = batch["doc_ids"] >= 0
    logp_BSV: torch.Tensor | None = None
    loop_BS = torch.zeros(needed_BS.shape, dtype=torch.int64, device=needed_BS.device)
    for step in exit_run(model, batch, rule, needed_BS):
        new_BS1 = step.new_BS[..., None]
        logp_BSV = (
            step.logp_BSV if logp_BSV is None else torch.where(new_BS1, step.logp_BSV, logp_BSV)
        )
        loop_BS = torch.where(step.new_BS, step.loop, loop_BS)
    assert logp_BSV is not None  # max_loops >= 1
    return logp_BSV, loop_BS
