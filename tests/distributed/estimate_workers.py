"""Rank side of test_estimate_comm.py: count every collective one training step makes.

Each case builds the real Trainer on the gloo group and records its first step (FSDP's lazy
initialisation makes no collective) under a dispatch mode that sees every c10d and functional collective, as
FSDP2, expert parallelism and the trainer issue them. Every rank writes its own record:
kind -> [calls, bytes] (bytes of the tensors passed, as distributed/comm_plan.py defines them).
"""

from __future__ import annotations

import json
import os

import torch
from gloo_rank import case_trainers, gloo_rank, load_spec  # next to this file
from torch.utils._python_dispatch import TorchDispatchMode

# (namespace, op) -> (kind, index of the argument whose bytes count)
_COLLECTIVES = {
    ("c10d", "_allgather_base_"): ("all_gather", 0),
    ("c10d", "_reduce_scatter_base_"): ("reduce_scatter", 1),
    ("c10d", "allreduce_"): ("all_reduce", 0),
    ("_c10d_functional", "all_to_all_single"): ("all_to_all", 0),
}
_NOT_COLLECTIVES = {"wait_tensor", "_wrap_tensor_autograd"}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(_nbytes(t) for t in x)


class CountCollectives(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.totals: dict[str, list[int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional", "_c10d_functional_autograd"):
            op = func.__name__.split(".")[0]
            if op not in _NOT_COLLECTIVES:
                kind, index = _COLLECTIVES.get(
                    (func.namespace, op), (f"other:{func.namespace}.{op}", 0)
                )
                entry = self.totals.setdefault(kind, [0, 0])
                entry[0] += 1
                entry[1] += _nbytes(args[index])
        return func(*args, **(kwargs or {}))


def run(rank: int, world: int, store_path: str, spec_path: str) -> None:
    with gloo_rank(rank, world, store_path) as info:
        spec = load_spec(spec_path)
        for case, trainer in case_trainers(spec, world, info):
            counter = CountCollectives()
            with counter:
                trainer.train_step(next(iter(trainer.dataloader)))
            with open(os.path.join(spec["out"], f"{case['name']}.{rank}.json"), "w") as fh:
                json.dump(counter.totals, fh)
