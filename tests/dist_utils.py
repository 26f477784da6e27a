"""Harnesses for multi-rank tests.

* :func:`run_threaded` simulates ``world_size`` ranks in one process, one thread per rank, over
  torch's in-process "threaded" process group. Collectives really move data, so our code runs
  unmodified on every rank. Fast enough for hypothesis property tests.
* :func:`run_gloo` spawns ``world_size`` real processes over gloo (integration tests), through
  :func:`ragged_placement.launch.run_gloo`.
* :func:`recording_collectives` records which rank called which c10d collective (threaded ranks
  share the patched module), for tests that assert what a step communicates.

Both call ``fn(rank, world_size, *args)`` on every rank and return the per-rank results in rank
order; an exception on any rank is re-raised in the caller. Process groups are always destroyed.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

from ragged_placement import launch

__all__ = ["CollectiveCalls", "recording_collectives", "run_gloo", "run_threaded"]

COLLECTIVES = (
    "all_to_all_single",
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
    "all_reduce",
    "scatter",
    "gather",
)


@dataclass
class CollectiveCalls:
    """``calls[name]``: the rank of every call of c10d ``name``; ``all_to_all_bytes[rank]``: the
    input bytes that rank passed to ``all_to_all_single``."""

    calls: dict[str, list[int]] = field(default_factory=dict)
    all_to_all_bytes: collections.Counter[int] = field(default_factory=collections.Counter)


@contextlib.contextmanager
def recording_collectives(names: tuple[str, ...] = COLLECTIVES) -> Iterator[CollectiveCalls]:
    """Patch ``torch.distributed.<name>`` for every ``name`` to record its calls (see
    :class:`CollectiveCalls`) while the block runs."""
    record = CollectiveCalls()
    lock = threading.Lock()

    def recording(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with lock:
                rank = dist.get_rank()
                record.calls.setdefault(name, []).append(rank)
                if name == "all_to_all_single":
                    record.all_to_all_bytes[rank] += args[1].numel() * args[1].element_size()
            return fn(*args, **kwargs)

        return wrapper

    with contextlib.ExitStack() as stack:
        for n in names:
            stack.enter_context(mock.patch.object(dist, n, recording(n, getattr(dist, n))))
        yield record

_THREADED_LOCK = threading.Lock()


def run_threaded(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` threads sharing a threaded PG."""
    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup,
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )

    with _THREADED_LOCK:
        results: list[Any] = [None] * world_size
        errors: queue.Queue = queue.Queue()
        torch._C._distributed_c10d._set_thread_isolation_mode(True)
        world = _install_threaded_pg()
        store = dist.HashStore()

        def worker(rank: int) -> None:
            dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
            try:
                results[rank] = fn(rank, world_size, *args)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                errors.put((rank, exc, traceback.format_exc()))
                ProcessLocalGroup.exception_handle(exc)
            finally:
                if world == dist.distributed_c10d._world:
                    dist.destroy_process_group()

        threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(world_size)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout)
                if t.is_alive():
                    raise TimeoutError(f"a rank did not finish within {timeout}s")
        finally:
            ProcessLocalGroup.reset()
            _uninstall_threaded_pg()
            torch._C._distributed_c10d._set_thread_isolation_mode(False)
        if not errors.empty():
            rank, exc, tb = errors.get()
            raise AssertionError(f"rank {rank} failed:\n{tb}") from exc
        return results


def run_gloo(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """:func:`ragged_placement.launch.run_gloo` with tests/ importable in the spawned ranks (``fn``
    is a module-level function of a test module)."""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    if tests_dir not in sys.path:
        sys.path.insert(0, tests_dir)
    return launch.run_gloo(fn, world_size, *args, timeout=timeout)
