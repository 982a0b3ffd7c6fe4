"""Rank-side checks of test_comm_timeouts.py (2 gloo processes, one launch): init_distributed gives
the world group comm.init_timeout_seconds; set_pg_timeouts (the trainer's call after step 1) moves
the world and mesh groups to comm.train_timeout_seconds, and a collective that a rank never joins
then fails after that time, not the init timeout."""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist

from torchtitan_loom.distributed import utils as dist_utils
from torchtitan_loom.distributed.parallel_dims import ParallelDims

INIT_S, TRAIN_S = 37, 3


def run(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    dist_utils.init_distributed("cpu", timeout_s=INIT_S)
    init_s = dist_utils.group_timeout_s()
    dims = ParallelDims.create(dp_shard=world, world_size=world)
    dims.build_meshes("cpu")
    groups = dist_utils.mesh_groups(dims)
    after = dist_utils.set_pg_timeouts(TRAIN_S, groups)
    result = {"init_s": init_s, "after_s": after, "mesh_groups": len(groups)}
    if rank == 0:  # rank 1 never joins this all-reduce
        started = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1))
            result["failed_after_s"] = None
        except RuntimeError:
            result["failed_after_s"] = time.monotonic() - started
    else:
        time.sleep(TRAIN_S + 8)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    os._exit(0)  # the world group is broken on purpose: no teardown collective
