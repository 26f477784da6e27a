"""Fixtures shared by several test modules."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_torch_thread():
    """Tiny matrices gain nothing from intra-op threads, and on a busy 2-core machine their spin
    waits cost 10-100x (measured: 10 s vs 0.1 s for one test)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
