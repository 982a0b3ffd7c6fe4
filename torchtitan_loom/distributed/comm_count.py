"""Count the collectives a piece of code issues, by op name, as torch.distributed dispatches them.

    with CollectiveCounter() as counter:
        trainer.train_step(batch)
    counter.counts["_reduce_scatter_base_"], counter.counts["_allgather_base_"]

Every c10d op (``dist.all_gather_into_tensor`` -> ``_allgather_base_``, ``dist.reduce_scatter_tensor``
-> ``_reduce_scatter_base_``, ``allreduce_``, ``alltoall_base_``, ...) and every functional
collective (``_c10d_functional``: ``all_to_all_single``, ...) counts once per call on this rank. For
benchmarks and tests (what FSDP2 actually sends); training never runs under it.
"""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")


class CollectiveCounter(TorchDispatchMode):
    """A dispatch mode that counts collective ops by name (``counts``: op name -> calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in COLLECTIVE_NAMESPACES:
            self.counts[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))
