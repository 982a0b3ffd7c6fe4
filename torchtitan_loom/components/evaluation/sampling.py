"""Token sampling from a model of the protocol, with incremental decoding when it has it.

`generate` prefills the prompt once, then feeds one token per step; for a model with a decode cache
(protocols.DecodesIncrementally, LOOM's KVCache through its one forward) each step runs loops
[1, loops] over the new position only, its attention reading the cached K/V of every (layer, loop).
A model without one recomputes the whole sequence per token (the same tokens, more FLOPs). LOOM
needs capacity dropping off for that (the caller builds the model with capacity_factor=0): with
capacity on, a token's experts would depend on how many tokens share the call, and a cached step
would differ from recomputing the prefix.

Adaptive depth (``exit_criterion``, components/evaluation/adaptive_exit.py): the prompt runs every
loop up to ``loops``; each new token then runs loop by loop until its criterion falls below the
threshold, and its keys and values in the loops it skipped are its exit loop's (the model's hold,
models/loom/kv_hold.py), so later tokens attend to what it showed last. ``DepthUsed`` counts the
loops. A threshold of 0 never exits early: the same tokens as fixed depth, exactly.

Legend: B rows, S positions, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from torchtitan_loom.components.evaluation.adaptive_exit import (
    exit_score,
    model_problem,
    threshold_problem,
)
from torchtitan_loom.loop_request import DecodeCache, LoopRequest
from torchtitan_loom.protocols import DecodesIncrementally, ExitsPerToken


@dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 = greedy; top_k 0 and top_p 1 = no truncation."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    exit_criterion: str | None = None
    """None: every token runs the same loops; else adaptive_exit.CRITERIA (per-token exit)."""
    exit_threshold: float = 0.0
    exit_loops: frozenset[int] | None = None
    """The loops after which a token may exit (adaptive_exit.decision_loops); None: any."""

    def problems(self) -> list[str]:
        """One line per invalid field (empty when valid)."""
        out = []
        if self.max_new_tokens < 0:
            out.append(f"--max-new-tokens {self.max_new_tokens}: must be >= 0")
        if self.temperature < 0:
            out.append(f"--temperature {self.temperature}: must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            out.append(f"--top-k {self.top_k}: must be >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            out.append(f"--top-p {self.top_p}: must be in (0, 1] (1 = off)")
        if self.exit_criterion is not None:
            problem = threshold_problem(self.exit_criterion, self.exit_threshold)
            if problem:
                out.append(f"--exit {problem}")
        return out


@dataclass
class DepthUsed:
    """Loops run for each token fed after the prompt (``generate(depth_used=...)``)."""

    loops_per_token: list[int] = field(default_factory=list)

    def mean(self) -> float:
        return sum(self.loops_per_token) / max(len(self.loops_per_token), 1)


def next_token(
    logits_BV: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None
) -> torch.Tensor:
    """[B] ids drawn from fp32 logits after temperature, top-k and top-p (nucleus) filtering."""
    if cfg.temperature == 0:
        return logits_BV.argmax(dim=-1)
    logits_BV = logits_BV.float() / cfg.temperature
    if cfg.top_k > 0:
        kth_B1 = logits_BV.topk(min(cfg.top_k, logits_BV.shape[-1]), dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    if cfg.top_p < 1:
        sorted_BV, order_BV = logits_BV.sort(dim=-1, descending=True)
        probs_BV = sorted_BV.softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop_BV = probs_BV.cumsum(dim=-1) - probs_BV >= cfg.top_p
        sorted_BV = sorted_BV.masked_fill(drop_BV, float("-inf"))
        logits_BV = torch.full_like(logits_BV, float("-inf")).scatter(-1, order_BV, sorted_BV)
    probs_BV = logits_BV.softmax(dim=-1)
    return (
        torch.multinomial(probs_BV.cpu(), 1, generator=generator).squeeze(-1).to(logits_BV.device)
    )


@torch.no_grad()
def generate(
    model,
    prompt_BS: torch.Tensor,
    cfg: SamplingConfig,
    loops: int | None = None,
    eos_id: int | None = None,
    depth_used: DepthUsed | None = None,
) -> torch.Tensor:
    """The new tokens [B, <= max_new_tokens] after `prompt_BS` (all rows the same length).

    Stops early when every row has produced `eos_id`; later tokens of a finished row repeat eos.
    `loops` = H' runs loops [1, H'] (fewer than H: early exit; more: the model's beyond policy);
    None = all H loops. With ``cfg.exit_criterion`` each new token stops at its own loop (module
    doc), ``depth_used`` receives how many it ran.
    """
    # Incremental decoding when the model offers it (protocols.DecodesIncrementally; it refuses a
    # setup that cannot decode so), else every step recomputes the whole sequence: same tokens.
    cache = model.new_decode_cache() if isinstance(model, DecodesIncrementally) else None
    adaptive = cfg.exit_criterion is not None
    if adaptive and (cache is None or not isinstance(model, ExitsPerToken)):
        raise ValueError("adaptive depth needs a model with a decode cache and per-token exit")
    problem = None if cfg.exit_criterion is None else model_problem(cfg.exit_criterion, model)
    if problem:
        raise ValueError(problem)
    max_loops = model.num_loops if loops is None else loops
    B, S = prompt_BS.shape
    device = prompt_BS.device
    max_new = min(cfg.max_new_tokens, model.args.max_seq_len - S)
    generator = torch.Generator().manual_seed(cfg.seed) if cfg.temperature > 0 else None
    new_tokens: list[torch.Tensor] = []
    tokens_BS, start = prompt_BS, 0
    done_B = torch.zeros(B, dtype=torch.bool, device=device)
    for _ in range(max_new):
        positions_BS = torch.arange(start, start + tokens_BS.shape[1], device=device).expand_as(
            tokens_BS
        )
        doc_ids_BS = torch.zeros_like(tokens_BS)
        if cache is None:
            logits_BV = model(tokens_BS, positions_BS, doc_ids_BS, loop_end=loops).logits_BSV[:, -1]
        elif adaptive and start > 0:  # the prompt (start 0) runs every loop: its K/V fill each
            logits_BV, used_B = _adaptive_step(
                model, tokens_BS, positions_BS, cache, cfg, max_loops
            )
            if depth_used is not None:
                depth_used.loops_per_token += used_B.tolist()
        else:
            out = model(
                tokens_BS,
                positions_BS,
                doc_ids_BS,
                loop_end=loops,
                request=LoopRequest(cache=cache),
            )
            logits_BV = out.logits_BSV[:, -1]
        tok_B = next_token(logits_BV, cfg, generator)
        if eos_id is not None:
            tok_B = torch.where(done_B, torch.full_like(tok_B, eos_id), tok_B)
            done_B |= tok_B == eos_id
        new_tokens.append(tok_B)
        if cache is None:  # the next call runs the prompt and every new token again
            tokens_BS = torch.cat([tokens_BS, tok_B[:, None]], dim=1)
        else:
            start += tokens_BS.shape[1]
            tokens_BS = tok_B[:, None]
        if eos_id is not None and bool(done_B.all()):
            break
    if not new_tokens:
        return prompt_BS.new_zeros(B, 0)
    return torch.stack(new_tokens, dim=1)


def _adaptive_step(
    model: Any,
    tokens_B1: torch.Tensor,
    positions_B1: torch.Tensor,
    cache: DecodeCache,
    cfg: SamplingConfig,
    max_loops: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new position per row, loop by loop until every row exited: (the logits [B, V] of each
    row's exit loop, the loops each row used [B])."""
    assert cfg.exit_criterion is not None
    hold = model.new_exit_hold(cache)
    doc_ids_B1 = torch.zeros_like(tokens_B1)
    B = tokens_B1.shape[0]
    exited_B = torch.zeros(B, dtype=torch.bool, device=tokens_B1.device)
    used_B = torch.full((B,), max_loops, dtype=torch.int64, device=tokens_B1.device)
    logits_BV: torch.Tensor | None = None
    carry, prev_logp = None, None
    for t in range(1, max_loops + 1):
        out = model(
            tokens_B1,
            positions_B1,
            doc_ids_B1,
            loop_start=t,
            loop_end=t,
            carry=carry,
            request=LoopRequest(cache=cache, hold=hold),
        )
        carry = out.carry
        logp_B1V = F.log_softmax(out.logits_BSV.float(), dim=-1)
        new_B = ~exited_B & (
            exit_score(cfg.exit_criterion, model, carry, t, logp_B1V, prev_logp, cfg.exit_loops)[
                :, 0
            ]
            < cfg.exit_threshold
        )
        if t == max_loops:
            new_B = ~exited_B
        step_BV = out.logits_BSV[:, -1]
        logits_BV = (
            step_BV if logits_BV is None else torch.where(new_B[:, None], step_BV, logits_BV)
        )
        used_B = torch.where(new_B, t, used_B)
        hold.exit(new_B[:, None])
        exited_B |= new_B
        prev_logp = logp_B1V
        if t < max_loops and bool(exited_B.all()):
            for skipped in range(t + 1, max_loops + 1):  # not run: their K/V are the held ones
                hold.fill(skipped)
            break
    # Every cache slot grew by one position (an exited row's K/V held at its exit loop's), so the
    # next token's loops all continue from the same length.
    assert logits_BV is not None
    return logits_BV, used_B
