"""What an exited token shows deeper loops: per-token adaptive depth (LOOM_SPEC §14, depth).

A token that exits after loop e stops changing. Tokens still looping attend to it in every later
(layer, loop), so its keys and values there must be defined: they are a copy of its own K/V of
loop e in the same layer (as recurrent-depth models with early exit do: Huginn's K/V reuse,
Mixture-of-Recursions' recursion-wise cache). ``KVHold`` is the one place that substitutes them:
it stands in every attention call's K/V slot (over a decoding cache or alone: it and the cache are
both a loop_request.KVStore, it an ExitHold, the cache a DecodeCache), keeps the K/V of
the latest loop per layer, and after each loop the caller marks the tokens that exit there.

Its own stream, memory and experts still run (the math of the other tokens does not read them:
the Looping-Residual memories are per position, capacity dropping is off for inference); the
caller takes an exited token's output from its exit loop.

Legend: B rows, S positions of the call, K kv heads, d head dim.
"""

from __future__ import annotations

import torch

from torchtitan_loom.loop_request import DecodeCache


class KVHold:
    """Held K/V of the tokens that exited (``exit``), per layer, for the positions of one call."""

    def __init__(self, cache: DecodeCache | None = None) -> None:
        self.cache = cache
        self.exited_BS: torch.Tensor | None = None
        self.latest: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def slot(self, layer: int, loop: int) -> HeldSlot:
        return HeldSlot(self, layer, loop)

    def exit(self, new_BS: torch.Tensor) -> None:
        """The tokens ``new_BS`` (bool [B, S]) exit after the loop just run: from the next loop on,
        their K/V in each layer are the ones that loop computed."""
        new_BS11 = new_BS[:, :, None, None]
        for layer, (k, v) in self.latest.items():
            old = self.held.get(layer)
            self.held[layer] = (
                (k, v)
                if old is None
                else (torch.where(new_BS11, k, old[0]), torch.where(new_BS11, v, old[1]))
            )
        self.exited_BS = new_BS if self.exited_BS is None else self.exited_BS | new_BS

    def fill(self, loop: int) -> None:
        """Every token of the call has exited: append their held K/V to the decoding cache's slots
        of ``loop`` in every layer, without running the loop (the compute adaptive depth saves)."""
        if self.cache is None or self.exited_BS is None or not bool(self.exited_BS.all()):
            raise ValueError("fill needs a decoding cache and every token of the call exited")
        for layer, (k, v) in self.held.items():
            self.cache.slot(layer, loop).append(k, v)


class HeldSlot:
    """One attention call's slot: the exited tokens' K/V replaced by their held ones, then the
    decoding cache's slot (when there is one) appends them and returns every position's."""

    def __init__(self, hold: KVHold, layer: int, loop: int) -> None:
        self.hold, self.layer, self.loop = hold, layer, loop

    def append(
        self, k_BSKd: torch.Tensor, v_BSKd: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hold = self.hold
        hold.latest[self.layer] = (k_BSKd, v_BSKd)
        held = hold.held.get(self.layer)
        if held is not None and hold.exited_BS is not None:
            out_BS11 = hold.exited_BS[:, :, None, None]
            k_BSKd = torch.where(out_BS11, held[0], k_BSKd)
            v_BSKd = torch.where(out_BS11, held[1], v_BSKd)
        if hold.cache is None:
            return k_BSKd, v_BSKd
        return hold.cache.slot(self.layer, self.loop).append(k_BSKd, v_BSKd)
