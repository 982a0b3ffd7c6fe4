"""What a forward is asked for beyond its logits and carry (``LoopRequest``: one typed value in
place of four keyword flags), and the protocols its K/V stores share: the decoding cache and the
per-token exit hold both hand each (layer, loop) attention call a slot to append its keys and
values to (LOOM: models/loom/attention.py KVCache, models/loom/kv_hold.py KVHold).

Generic (protocols.ModelProtocol takes the request); the HF export stitches this file into its
modeling file, so it imports nothing from the package.

Legend: B batch rows, S positions of the call, D model dim, K kv heads, d head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch


class KVAppender(Protocol):
    """One attention call's K/V slot (one layer, one loop)."""

    def append(
        self, k_BSKd: torch.Tensor, v_BSKd: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Take this call's K/V; return the K/V the call attends to (cached positions first)."""
        ...


class KVStore(Protocol):
    """Where every attention call of a forward puts its K/V: a decoding cache or an exit hold."""

    def slot(self, layer: int, loop: int) -> KVAppender:
        """The slot of ``layer`` in loop ``loop`` (1-based)."""
        ...


class DecodeCache(KVStore, Protocol):
    """A KVStore that keeps every call's K/V for the next (incremental decoding)."""

    def past_len(self, loop: int = 1) -> int:
        """Positions cached before this call, as loop ``loop`` (the call's first) sees them."""
        ...


class ExitHold(KVStore, Protocol):
    """A KVStore that replaces the K/V of exited tokens by their exit loop's, over ``cache``
    when decoding (None for a whole-sequence call)."""

    @property
    def cache(self) -> DecodeCache | None:
        """The decoding cache it stands over (its slots get the substituted K/V), or None."""
        ...

    def exit(self, new_BS: torch.Tensor) -> None:
        """The tokens of ``new_BS`` (bool [B, S]) exit after the loop just run."""
        ...

    def fill(self, loop: int) -> None:
        """Every token of the call has exited: append their held K/V to the cache's slots of
        ``loop`` without running it."""
        ...


@dataclass(frozen=True)
class LoopRequest:
    """The optional modes of one forward; the default asks for none (training's plain call)."""

    return_topk: bool = False
    """Also fill ModelOutput.topk_LTBSK (ask a model with ``routing`` only; analysis)."""
    observe: Callable[[torch.Tensor], torch.Tensor] | None = None
    """A pure function of one branch output [B, S, D] returning a 1-D tensor, the same length
    every call: fills ModelOutput.observed_LTNK (protocols.ModelProtocol.observed_branches)."""
    cache: DecodeCache | None = None
    """The tokens continue the cached positions of every row (one document per row, doc_ids
    ignored); their K/V are appended (protocols.DecodesIncrementally.new_decode_cache)."""
    hold: ExitHold | None = None
    """The K/V of the tokens it marks exited are held at their exit loop's; ``hold.cache`` must
    be ``cache`` (protocols.ExitsPerToken.new_exit_hold)."""
