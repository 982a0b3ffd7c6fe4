"""A short trained run with checkpoints and eval losses, shared by the inference-tool tests."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "unit"))
from test_checkpoint import make_trainer, run

TASKS_DIR = os.path.join(os.path.dirname(__file__), "tiny_tasks")


@pytest.fixture(scope="session", autouse=True)
def _one_thread_inference():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def trained_run(tiny_pack, tmp_path_factory):
    """40 steps of the debug model (H = 3) on the tiny pack; checkpoints and eval at 20 and 40."""
    dump = tmp_path_factory.mktemp("inference_run")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run(
            make_trainer(
                tiny_pack,
                dump,
                "--training.steps",
                "40",
                "--checkpoint.interval",
                "20",
                "--eval.interval",
                "20",
                "--eval.tokens",
                "1500",
                "--optimizer.lr",
                "3e-3",
                "--checkpoint.keep_latest_k",
                "0",
                "--spike_guard.enable",
                "false",
            )
        )
    finally:
        torch.set_num_threads(threads)
    return dump
