"""What every spawned gloo rank of these tests does first and last: one thread, the rank's
environment, a process group with a timeout (a hung peer fails the test instead of hanging it), and
one real Trainer per case of a spec file ({"base": argv, "out": folder, "cases": [{"name", "argv"}]})."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist

from torchtitan_loom.config import load_config
from torchtitan_loom.config.validate import resolve
from torchtitan_loom.distributed.utils import DistInfo, destroy_distributed
from torchtitan_loom.trainer import Trainer


@contextlib.contextmanager
def gloo_rank(rank: int, world: int, store_path: str) -> Iterator[DistInfo]:
    """The rank's process group for the body of the `with`, destroyed whatever happens."""
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store_path, world),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    finished = False
    try:
        yield DistInfo(rank=rank, world_size=world, device=torch.device("cpu"))
        finished = True
    finally:  # the trainer's teardown: after a body that finished, every rank waits for the others
        destroy_distributed(wait_for_all=finished)


def build_trainer(argv: list[str], world: int, info: DistInfo) -> Trainer:
    cfg = load_config(argv)
    return Trainer(cfg, resolve(cfg, world), info)


def load_spec(spec_path: str) -> dict:
    with open(spec_path) as fh:
        return json.load(fh)


def case_trainers(spec: dict, world: int, info: DistInfo) -> Iterator[tuple[dict, Trainer]]:
    """(case, its Trainer) for each case, each dumping into its own folder under spec["out"]."""
    for case in spec["cases"]:
        argv = (
            spec["base"]
            + case["argv"]
            + ["--job.dump_folder", os.path.join(spec["out"], case["name"])]
        )
        yield case, build_trainer(argv, world, info)
