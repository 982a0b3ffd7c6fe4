"""Unit tests use tiny tensors: one intra-op thread is fastest and avoids OpenMP
oversubscription when CI's two cores are shared with subprocess tests."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
