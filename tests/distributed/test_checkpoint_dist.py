"""Checkpointing on 2 gloo processes (one launch, checks in checkpoint_workers.py): async save
over its own group racing neither the training collectives nor the next updates; a preemption
signal seen by one rank stops all of them after the same step."""

import os
import sys
import time

import pytest
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
import checkpoint_workers  # noqa: E402  (next to this file; the spawned ranks import it by name)

LAUNCH_TIMEOUT_S = 120.0


def test_async_save_and_preemption_on_2_gloo_ranks(tmp_path):
    world = 2
    ctx = mp.start_processes(checkpoint_workers.run, args=(world, str(tmp_path / "store"), str(tmp_path / "run")),
                             nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail(f"checkpoint ranks did not finish within {LAUNCH_TIMEOUT_S:.0f} s")
    finally:
        for process in ctx.processes:
            if process.is_alive():
                process.kill()
