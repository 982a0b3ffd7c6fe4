"""Rank side of test_estimate_comm.py: count every collective one training step makes.

Each case builds the real Trainer on the gloo group and records its first step (FSDP's lazy
initialisation makes no collective) under a dispatch mode that sees every c10d and functional collective, as
FSDP2, expert parallelism and the trainer issue them. Every rank writes its own record:
kind -> [calls, bytes] (bytes of the tensors passed, as distributed/comm_plan.py defines them).
"""

from __future__ import annotations

import datetime
import json
import os

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan_loom.config import load_config
from torchtitan_loom.config.validate import resolve
from torchtitan_loom.distributed.utils import DistInfo
from torchtitan_loom.train import Trainer

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
                kind, index = _COLLECTIVES.get((func.namespace, op), (f"other:{func.namespace}.{op}", 0))
                entry = self.totals.setdefault(kind, [0, 0])
                entry[0] += 1
                entry[1] += _nbytes(args[index])
        return func(*args, **(kwargs or {}))


def run(rank: int, world: int, store_path: str, spec_path: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        with open(spec_path) as fh:
            spec = json.load(fh)
        info = DistInfo(rank=rank, world_size=world, device=torch.device("cpu"))
        for case in spec["cases"]:
            argv = spec["base"] + case["argv"] + ["--job.dump_folder", os.path.join(spec["out"], case["name"])]
            cfg = load_config(argv)
            trainer = Trainer(cfg, resolve(cfg, world), info)
            counter = CountCollectives()
            with counter:
                trainer.train_step(next(iter(trainer.dataloader)))
            with open(os.path.join(spec["out"], f"{case['name']}.{rank}.json"), "w") as fh:
                json.dump(counter.totals, fh)
    finally:
        dist.destroy_process_group()
