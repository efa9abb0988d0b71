"""Fixtures shared by the package tests."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one thread is as fast, and does not stall on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
