"""GPU-only tests: marked `gpu`, skipped on machines without CUDA (run by benchmarks/gpu_check.sh).

Each test is cut by its own alarm after GPU_TEST_S seconds (default 60): it fails with a
TimeoutError and the next test runs. A hang inside a CUDA call that never returns to Python is
beyond an alarm; the GPU check's stage timeout ends that one (and `pytest -v` names the test).
"""

import os
import signal

import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped without one")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker, not the folder's name
            item.add_marker(skip)


def _timed_out(signum, frame):
    raise TimeoutError(f"test ran past GPU_TEST_S={os.environ.get('GPU_TEST_S', '60')} s")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    seconds = int(os.environ.get("GPU_TEST_S", "60"))
    previous = signal.signal(signal.SIGALRM, _timed_out)
    signal.alarm(seconds)
    try:
        return (yield)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
