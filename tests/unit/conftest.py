"""Unit tests use tiny tensors: one intra-op thread is fastest and avoids OpenMP
oversubscription when CI's two cores are shared with subprocess tests.

Session scope, so module- and session-scoped fixtures (a reference run built once per module) run
with the same one thread as the tests that compare against them: a different thread count changes
the reduction order, and bit-for-bit comparisons of two runs would then fail for no real reason."""

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
