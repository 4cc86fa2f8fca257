"""Fixtures of the decode tests."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny models run ~8x faster on one thread than on two contended ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
