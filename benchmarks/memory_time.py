"""Step time and peak memory of the segmented step: K ∈ {0, 3} × activation checkpointing ∈ {none,
block, loop, segment}, side by side in one run; and (--reshard) FSDP2's reshard_after_forward
options × parallelism.fsdp_sync on 2 gloo ranks, several micro-batches per rank: collectives per
step (counted on the torch.distributed ops FSDP2 dispatches), step time, peak memory.

Every cell runs in a fresh process, so its peak is its own: on CUDA torch's peak allocated bytes,
on CPU the peak resident set over the steps (VmHWM, reset just before them) minus the resident set
before the first step, with glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_) so freed
tensors leave the resident set (optimizer states, allocated at the first step, are in every CPU cell alike). Time: the mean of
the timed steps after one warm-up step.

    python benchmarks/memory_time.py --steps 3                 # the K x AC table (with the dry run's estimate)
    python benchmarks/memory_time.py --reshard --steps 3       # reshard x fsdp_sync on 2 ranks, 4 micro-batches

Arguments after the options are config overrides for every cell (default: the debug flavor at
H = 9, seq_len 256, 8 rows per step in one micro-batch, fp32, the bundled corpus).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BASE = [
    "--model.flavor",
    "debug",
    "--model.num_loops",
    "9",
    "--training.seq_len",
    "256",
    "--training.global_batch_size",
    "8",
    "--training.micro_batch_size",
    "8",
    "--training.mixed_precision_param",
    "float32",
    "--metrics.enable_tensorboard",
    "false",
    "--eval.interval",
    "0",
    "--spike_guard.enable",
    "false",
]
AC_MODES = ("none", "block", "loop", "segment")
_MIB = float(1 << 20)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> bool:
    """Start the peak resident set (VmHWM) afresh at the current one, so what the process did
    before the steps (imports, building the Trainer) cannot set the peak. False where the kernel
    does not allow it (then ru_maxrss, the peak over the process's life, is used)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes(reset: bool) -> int:
    if reset:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_cell(argv: list[str], steps: int, rank: int = 0, world: int = 1) -> dict:
    """Build the Trainer for `argv` in this process, time `steps` steps after one warm-up step."""
    import tempfile

    import torch

    from torchtitan_loom.config import load_config
    from torchtitan_loom.config.validate import resolve
    from torchtitan_loom.distributed.comm_count import CollectiveCounter
    from torchtitan_loom.distributed.utils import DistInfo, pick_device
    from torchtitan_loom.trainer import Trainer

    if not any(a.startswith("--job.dump_folder") for a in argv):  # leave nothing behind
        argv = argv + ["--job.dump_folder", tempfile.mkdtemp(prefix="memory_time_")]
    cfg = load_config(argv)
    device = pick_device(cfg.training.device)
    trainer = Trainer(cfg, resolve(cfg, world), DistInfo(rank, world, device))
    data = iter(trainer.dataloader)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    reset = device.type != "cuda" and _reset_peak_rss()
    base = _rss_bytes()
    trainer.train_step(next(data))  # warm-up
    counter = CollectiveCounter()
    with counter:
        trainer.train_step(next(data))
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step(next(data))
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = _peak_rss_bytes(reset) - base
    return {
        "step_s": (time.perf_counter() - start) / steps,
        "peak_mib": peak / _MIB,
        "collectives_per_step": dict(counter.counts),
    }


def estimated_mib(argv: list[str]) -> float:
    """The dry run's estimate of what a cell measures: everything but the parameters (allocated
    before the measurement starts), i.e. gradients, AdamW moments, activations, logits, carries."""
    from torchtitan_loom.config import load_config
    from torchtitan_loom.config.validate import resolve
    from torchtitan_loom.distributed.estimate import estimate

    cfg = load_config(argv + ["--training.device", "cpu", "--parallelism.dry_run"])
    est = estimate(cfg, *resolve(cfg, 1))
    return (est.memory["total"] - est.memory["parameters (fp32)"]) / _MIB


def _child_env() -> dict:
    return {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "PYTHONPATH": str(ROOT),
    }


def kxac_table(steps: int, overrides: list[str]) -> str:
    rows = [
        "| K | activation_checkpoint | step time (s) | peak memory (MiB) | vs K=0, none | "
        "dry-run estimate (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    base_peak = None
    for k in (0, 3):
        for mode in AC_MODES:
            argv = (
                BASE
                + ["--training.bp_segment_len", str(k), "--activation_checkpoint.mode", mode]
                + overrides
            )
            out = subprocess.run(
                [sys.executable, __file__, "--cell", json.dumps(argv), "--steps", str(steps)],
                capture_output=True,
                text=True,
                env=_child_env(),
                timeout=1800,
            )
            if out.returncode != 0:
                rows.append(
                    f"| {k} | {mode} | error | {out.stderr.strip().splitlines()[-1][:80]} | |"
                )
                continue
            cell = json.loads(out.stdout.strip().splitlines()[-1])
            base_peak = base_peak or cell["peak_mib"]
            estimate = estimated_mib(argv)
            rows.append(
                f"| {k} | {mode} | {cell['step_s']:.2f} | {cell['peak_mib']:.0f} | "
                f"{cell['peak_mib'] / base_peak:.2f}× | {estimate:.0f} ({estimate / cell['peak_mib'] - 1:+.0%}) |"
            )
            print(rows[-1], flush=True)
    return "\n".join(rows)


def _reshard_rank(rank: int, world: int, store: str, argv: list[str], steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, world),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    try:
        result = run_cell(argv, steps, rank, world)
        with open(f"{out}.{rank}", "w") as fh:
            json.dump(result, fh)
    finally:
        dist.destroy_process_group()


RESHARD_CELLS = (
    ("never", "segment"),
    ("never", "micro_batch"),
    ("always", "segment"),
    ("always", "micro_batch"),
)


def reshard_table(steps: int, overrides: list[str], micro_batch_size: int = 1) -> str:
    """FSDP2 on 2 gloo ranks: reshard_after_forward × fsdp_sync, 4 rows per rank in micro-batches of
    `micro_batch_size` (default 1: 4 micro-batches per rank per segment)."""
    import tempfile

    import torch.multiprocessing as mp

    rows = [
        "| reshard_after_forward | fsdp_sync | all-gathers / step | reduce-scatters / step | step time (s) | "
        "peak memory per rank (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for policy, sync in RESHARD_CELLS:
        argv = (
            BASE
            + [
                "--training.bp_segment_len",
                "3",
                "--parallelism.fsdp_reshard_after_forward",
                policy,
                "--parallelism.fsdp_sync",
                sync,
                "--training.micro_batch_size",
                str(micro_batch_size),
            ]
            + overrides
        )
        with tempfile.TemporaryDirectory() as tmp:
            os.environ.update(MALLOC_MMAP_THRESHOLD_="65536")
            mp.start_processes(
                _reshard_rank,
                args=(2, f"{tmp}/store", argv, steps, f"{tmp}/out"),
                nprocs=2,
                start_method="spawn",
            )
            cells = [json.loads(Path(f"{tmp}/out.{r}").read_text()) for r in range(2)]
        c = cells[0]["collectives_per_step"]
        rows.append(
            f"| {policy} | {sync} | {c.get('_allgather_base_', 0)} | {c.get('_reduce_scatter_base_', 0)} | "
            f"{max(x['step_s'] for x in cells):.2f} | {max(x['peak_mib'] for x in cells):.0f} |"
        )
        print(rows[-1], flush=True)
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--steps", type=int, default=3, help="timed steps per cell (after one warm-up step)"
    )
    parser.add_argument(
        "--reshard",
        action="store_true",
        help="FSDP2 reshard_after_forward x fsdp_sync on 2 gloo ranks, collectives per step",
    )
    parser.add_argument(
        "--micro-batch-size",
        type=int,
        default=1,
        help="--reshard: rows per micro-batch (4 rows per rank: 1 gives 4 micro-batches)",
    )
    parser.add_argument("--cell", help=argparse.SUPPRESS)  # internal: one cell, JSON argv
    args, overrides = parser.parse_known_args(argv)
    if args.cell:
        print(json.dumps(run_cell(json.loads(args.cell), args.steps)))
        return 0
    print(
        reshard_table(args.steps, overrides, args.micro_batch_size)
        if args.reshard
        else kxac_table(args.steps, overrides)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
