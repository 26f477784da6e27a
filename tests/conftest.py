"""Fixtures shared by several test modules."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def one_torch_thread():
    """Tiny matrices gain nothing from intra-op threads, and on a busy 2-core machine their spin
    waits cost 10-100x (measured: 10 s vs 0.1 s for one test)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def no_leaked_ranks():
    """Fail the test that leaves a default process group or running rank threads behind (the
    harnesses in dist_utils tear their worlds down; this names a test that bypassed them)."""
    yield
    threads = threading.enumerate()
    leaked = [t.name for t in threads if t.name.startswith("run_threaded:") and t.is_alive()]
    initialized = dist.is_available() and dist.is_initialized()
    if initialized:
        dist.destroy_process_group()
    assert not leaked and not initialized, (
        f"the test left rank threads {leaked} or a default process group "
        f"(initialized: {initialized}) behind; use dist_utils.run_threaded / run_gloo"
    )
