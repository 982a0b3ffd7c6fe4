"""Counting device-to-host transfers: a TorchFunctionMode that records every `.item()`,
`.tolist()`, `.cpu()` and `Tensor.__bool__` call on a tensor while it is active.

On a GPU each of them blocks the host until the device has caught up; on the CPU they cost
nothing, which is why the budget is enforced by counting calls rather than by timing.
"""

from __future__ import annotations

import traceback

import torch
from torch.overrides import TorchFunctionMode

HOST_TRANSFERS = ("item", "tolist", "cpu", "__bool__")


class HostSyncCounter(TorchFunctionMode):
    """`with HostSyncCounter() as c: ...` then `c.calls`: [(method name, 'file:line' of the caller)].

    `ignore`: tensors not to count (by identity), e.g. optimizer step counters that live on the
    host by design (AdamW keeps `state["step"]` on the CPU unless capturable/fused).
    """

    def __init__(self, ignore: tuple[torch.Tensor, ...] = ()):
        super().__init__()
        self.calls: list[tuple[str, str]] = []
        self._ignore = {id(t) for t in ignore}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if (
            name in HOST_TRANSFERS
            and args
            and isinstance(args[0], torch.Tensor)
            and id(args[0]) not in self._ignore
        ):
            caller = traceback.extract_stack(limit=2)[0]
            self.calls.append((name, f"{caller.filename.rsplit('/', 1)[-1]}:{caller.lineno}"))
        return func(*args, **(kwargs or {}))
