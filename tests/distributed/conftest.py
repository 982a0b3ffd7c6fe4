"""The one launcher of the multi-process tests: spawn `world` ranks of a worker function, wait for
all of them under a deadline of a number of measured launch costs, and kill whatever is still alive when the test ends (a hung gloo rank
must never outlive its test). Worker modules live next to this file; the spawned ranks import them
by name, so this folder is put on sys.path."""

import os
import sys
import time

import pytest
import torch.multiprocessing as mp

from tests.rank_exit import run_then_exit

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def launch_ranks(launch_cost_s):
    def launch(fn, world: int, args: tuple, launches: float, what: str) -> None:
        """Run fn(rank, *args) on `world` spawned processes (each leaving without the interpreter's
        finalization once fn returns: tests/rank_exit.py says why); fail the test past `launches` times the
        measured cost of a bare launch (tests/launch_cost.py), so the limit grows with the load."""
        timeout_s = launches * launch_cost_s
        ctx = mp.start_processes(
            run_then_exit, args=(fn, *args), nprocs=world, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    pytest.fail(
                        f"{what}: {world} ranks did not finish within {timeout_s:.0f} s "
                        f"({launches:g} × the {launch_cost_s:.1f} s a bare launch took)"
                    )
        finally:
            for process in ctx.processes:
                if process.is_alive():
                    process.kill()

    return launch
