"""The measured cost of one multi-process launch, which the multi-process tests' time limits are
multiples of: spawn ``world`` interpreters, import torch, join a gloo group, pass a barrier, exit.

On a loaded machine every launch slows down by about the same factor as this one, so a limit of
``n`` launch costs holds under load where a fixed number of seconds does not. The fixture in
tests/conftest.py measures it once per session, and only when a test asks for it.
"""

import datetime
import os
import socket
import time

import torch.multiprocessing as mp

MEASURE_LIMIT_S = (
    600.0  # a machine where even a bare launch takes longer is not one to run these tests on
)
FLOOR_S = (
    5.0  # the cost assumed at least, so a lucky fast measurement does not make every limit tight
)


def _bare_rank(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=MEASURE_LIMIT_S),
    )
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(world: int = 2) -> float:
    """Seconds one bare launch of ``world`` spawned ranks takes right now (at least FLOOR_S)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    started = time.monotonic()
    ctx = mp.start_processes(
        _bare_rank, args=(world, _free_port()), nprocs=world, join=False, start_method="spawn"
    )
    try:
        while not ctx.join(timeout=max(0.1, started + MEASURE_LIMIT_S - time.monotonic())):
            if time.monotonic() - started > MEASURE_LIMIT_S:
                raise RuntimeError(
                    f"a bare launch of {world} ranks took over {MEASURE_LIMIT_S:.0f} s"
                )
    finally:
        for process in ctx.processes:
            if process.is_alive():
                process.kill()
    return max(FLOOR_S, time.monotonic() - started)
