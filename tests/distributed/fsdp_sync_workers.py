"""Rank side of test_fsdp_sync.py: the collectives FSDP2 issues per train step, per case.

Each case trains the debug model with the real Trainer on the existing gloo group: one untimed
step (FSDP's lazy init), then `steps` steps under a CollectiveCounter. Rank 0 writes the counts and
the per-segment losses of the counted steps.
"""

from __future__ import annotations

import datetime
import json
import os

import torch
import torch.distributed as dist

from torchtitan_loom.config import load_config
from torchtitan_loom.config.validate import resolve
from torchtitan_loom.distributed.comm_count import CollectiveCounter
from torchtitan_loom.distributed.utils import DistInfo
from torchtitan_loom.train import Trainer


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
            cfg = load_config(spec["base"] + case["argv"] + ["--job.dump_folder", os.path.join(spec["out"], case["name"])])
            trainer = Trainer(cfg, resolve(cfg, world), info)
            data = iter(trainer.dataloader)
            trainer.train_step(next(data))
            losses = []
            with CollectiveCounter() as counter:
                for _ in range(spec["steps"]):
                    losses.append(trainer.train_step(next(data)).seg_losses)
            if rank == 0:
                with open(os.path.join(spec["out"], case["name"] + ".json"), "w") as fh:
                    json.dump({"counts": dict(counter.counts), "seg_losses": losses}, fh)
            dist.barrier()
    finally:
        dist.destroy_process_group()
