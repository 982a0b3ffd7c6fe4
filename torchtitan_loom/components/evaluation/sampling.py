"""Token sampling from a model of the protocol, with incremental decoding when it has it.

`generate` prefills the prompt once, then feeds one token per step; for a model with a decode cache
(protocols.DecodesIncrementally, LOOM's KVCache through its one forward) each step runs loops
[1, loops] over the new position only, its attention reading the cached K/V of every (layer, loop).
A model without one recomputes the whole sequence per token (the same tokens, more FLOPs). LOOM
needs capacity dropping off for that (the caller builds the model with capacity_factor=0): with
capacity on, a token's experts would depend on how many tokens share the call, and a cached step
would differ from recomputing the prefix.

Legend: B rows, S positions, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchtitan_loom.protocols import DecodesIncrementally


@dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 = greedy; top_k 0 and top_p 1 = no truncation."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

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
        return out


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
) -> torch.Tensor:
    """The new tokens [B, <= max_new_tokens] after `prompt_BS` (all rows the same length).

    Stops early when every row has produced `eos_id`; later tokens of a finished row repeat eos.
    `loops` = H' runs loops [1, H'] only (early exit); None = all H loops.
    """
    # Incremental decoding when the model offers it (protocols.DecodesIncrementally; it refuses a
    # setup that cannot decode so), else every step recomputes the whole sequence: same tokens.
    cache = model.new_decode_cache() if isinstance(model, DecodesIncrementally) else None
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
            out = model(tokens_BS, positions_BS, doc_ids_BS, loop_end=loops)
        else:
            out = model(tokens_BS, positions_BS, doc_ids_BS, loop_end=loops, cache=cache)
        tok_B = next_token(out.logits_BSV[:, -1], cfg, generator)
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
