"""Host syncs and step time of a distributed train step: 2 gloo ranks, the debug model with expert
parallel (dp_shard 2, ep 2), capacity on (the default factor) and off, side by side.

It imports `torchtitan_loom` from PYTHONPATH, so the same script measures another tree too:

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/host_syncs.py --steps 3
    OMP_NUM_THREADS=1 PYTHONPATH=/tmp/base python benchmarks/host_syncs.py --steps 3   # an older tree

Host syncs are the `.item()` / `.tolist()` / `.cpu()` / `Tensor.__bool__` calls of
tests/unit/host_syncs.HostSyncCounter during `Trainer.train_step` (AdamW's host-side step counters
excluded); on a CPU they cost nothing, on a GPU each one stalls the host's launch-ahead. Any
further argument is a config override for every cell.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = [
    "--model.flavor",
    "debug",
    "--model.num_loops",
    "3",
    "--training.bp_segment_len",
    "1",
    "--training.seq_len",
    "256",
    "--training.global_batch_size",
    "8",
    "--training.micro_batch_size",
    "2",
    "--parallelism.dp_shard",
    "2",
    "--parallelism.ep",
    "2",
    "--training.mixed_precision_param",
    "float32",
    "--metrics.enable_tensorboard",
    "false",
    "--eval.interval",
    "0",
    "--spike_guard.enable",
    "false",
]
CELLS = {"capacity on (1.5)": [], "capacity off": ["--model.capacity_factor", "0"]}


def _rank(rank: int, world: int, store: str, argv: list[str], steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "tests" / "unit"))
    from host_syncs import HostSyncCounter

    from torchtitan_loom.config import load_config
    from torchtitan_loom.config.validate import resolve
    from torchtitan_loom.distributed.utils import DistInfo
    from torchtitan_loom.trainer import Trainer

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, world),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    try:
        cfg = load_config(argv)
        trainer = Trainer(cfg, resolve(cfg, world), DistInfo(rank, world, torch.device("cpu")))
        data = iter(trainer.dataloader)
        trainer.train_step(next(data))  # warm-up: lazy init, optimizer state
        ignore = tuple(
            s["step"] for s in trainer.optimizer.state.values() if torch.is_tensor(s.get("step"))
        )
        start = time.perf_counter()
        with HostSyncCounter(ignore=ignore) as counter:
            for _ in range(steps):
                trainer.train_step(next(data))
        elapsed = time.perf_counter() - start
        with open(f"{out}.{rank}", "w") as fh:
            json.dump(
                {
                    "syncs_per_step": len(counter.calls) / steps,
                    "step_s": elapsed / steps,
                    "segments": len(trainer.segments),
                },
                fh,
            )
    finally:
        dist.destroy_process_group()


def main(argv: list[str]) -> int:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--steps", type=int, default=3, help="counted steps per cell (after one warm-up step)"
    )
    args, overrides = parser.parse_known_args(argv)
    print("| EP cell | host syncs / step | segments / step | step time (s) |\n|---|---:|---:|---:|")
    for name, extra in CELLS.items():
        with tempfile.TemporaryDirectory() as tmp:
            cell_argv = BASE + extra + overrides + ["--job.dump_folder", f"{tmp}/run"]
            mp.start_processes(
                _rank,
                args=(2, f"{tmp}/store", cell_argv, args.steps, f"{tmp}/out"),
                nprocs=2,
                start_method="spawn",
            )
            cells = [json.loads(Path(f"{tmp}/out.{r}").read_text()) for r in range(2)]
        print(
            f"| {name} | {cells[0]['syncs_per_step']:g} | {cells[0]['segments']} | "
            f"{max(c['step_s'] for c in cells):.2f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
