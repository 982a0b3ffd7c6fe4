"""Activation checkpointing per block, per loop or per segment (``activation_checkpoint.mode``).

Applied through the model's one seam, ``LoomTransformer.region_wrappers`` (scope -> wrapper), so no
module is swapped and parameter names stay as they are:

  none     nothing is recomputed
  block    every block call (each of the L blocks in each loop) is a checkpoint region
  loop     every loop (its L blocks and the closing RMSNorm) is a region: memory ~ one state per loop
  segment  the loops of one forward call (one backprop segment of K loops) form one region

Recompute never routes differently from the forward: eager regions record the outputs of ``topk``
(expert choice) and of ``sort`` (the capacity order) in the forward and the recompute replays
them instead of recomputing them (two small dispatch modes passed as the checkpoint's context_fn).
Compiled blocks are opaque to dispatch modes (torch.compile refuses to trace under one), so with
``compile.enable`` the regions recompute everything: the same compiled kernels on the same inputs
(checked against no AC by tests). The record/replay costs a Python dispatch per op inside eager
regions. Expert counts are outputs of the region; the recompute's outputs are discarded, so nothing
is counted twice.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import checkpoint

from torchtitan_loom.distributed.choices import AC_MODES  # re-exported

# Routing decisions: top-k expert choice and the stable sorts of the capacity plan (argsort
# dispatches to sort.stable). Saving them costs [N, K] values and indices per MoE call.
_ROUTING_OPS = frozenset(
    {
        torch.ops.aten.topk.default,
        torch.ops.aten.sort.default,
        torch.ops.aten.sort.stable,
    }
)


class _RecordRouting(TorchDispatchMode):
    """Forward of a region: run every op, keep the outputs of the routing ops in call order."""

    def __init__(self, saved: dict[Any, list[Any]]):
        super().__init__()
        self.saved = saved

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ROUTING_OPS:
            self.saved.setdefault(func, []).append(tree_map(_detached, out))
        return out


class _ReplayRouting(TorchDispatchMode):
    """Recompute of a region: routing ops return what the forward computed, the rest runs again.

    Unlike torch's selective checkpointing this matches only the routing ops, so FSDP doing
    different bookkeeping (unshards, profiler ranges) in the recompute is fine.
    """

    def __init__(self, saved: dict[Any, list[Any]]):
        super().__init__()
        self.saved = saved
        self.used: dict[Any, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in _ROUTING_OPS:
            return func(*args, **(kwargs or {}))
        i = self.used.get(func, 0)
        self.used[func] = i + 1
        outputs = self.saved.get(func, [])
        if i >= len(outputs):
            raise RuntimeError(
                f"activation checkpoint: the recompute called {func} more often ({i + 1}) than "
                f"the forward ({len(outputs)}); the region is not replayable"
            )
        return outputs[i]


def _detached(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x


def _routing_replay_contexts() -> tuple[Any, Any]:
    saved: dict[Any, list[Any]] = {}
    return _RecordRouting(saved), _ReplayRouting(saved)


def checkpoint_region(fn: Callable[..., Any], *args: Any, save_routing: bool = True) -> Any:
    """fn(*args) under non-reentrant activation checkpointing (routing replayed when save_routing)."""
    if save_routing:
        return checkpoint(fn, *args, use_reentrant=False, context_fn=_routing_replay_contexts)
    return checkpoint(fn, *args, use_reentrant=False)


def apply_activation_checkpointing(
    model: torch.nn.Module, mode: str, *, save_routing: bool = True
) -> None:
    """Register the checkpoint wrapper of `mode` on the model's region seam (in place).

    ``save_routing=False`` (compiled blocks) recomputes the routing instead of saving it.
    """
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpoint.mode = {mode!r}: valid: {', '.join(AC_MODES)}")
    wrappers = getattr(model, "region_wrappers", None)
    if wrappers is None:
        raise TypeError(
            f"{type(model).__name__} has no region_wrappers seam; activation checkpointing "
            f"needs the LOOM model"
        )
    wrappers.clear()
    if mode != "none":
        wrappers[mode] = partial(checkpoint_region, save_routing=save_routing)
