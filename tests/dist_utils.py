"""Harnesses for multi-rank tests.

* :func:`run_threaded` simulates ``world_size`` ranks in one process, one thread per rank, over
  torch's in-process "threaded" process group. Collectives really move data, so our code runs
  unmodified on every rank. Fast enough for hypothesis property tests.
* :func:`run_gloo` spawns ``world_size`` real processes over gloo (integration tests).

Both call ``fn(rank, world_size, *args)`` on every rank and return the per-rank results in rank
order; an exception on any rank is re-raised in the caller. Process groups are always destroyed.
"""

from __future__ import annotations

import os
import queue
import socket
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_threaded", "run_gloo", "free_port"]

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_worker(rank: int, fn, world_size: int, port: int, args: tuple, out_dir: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_gloo(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned gloo processes.

    ``fn`` must be importable (a module-level function); results must be ``torch.save``-able.
    """
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    if tests_dir not in sys.path:
        sys.path.insert(0, tests_dir)
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _gloo_worker,
            args=(fn, world_size, free_port(), args, out_dir),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        import time

        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"gloo run of {fn.__name__} exceeded {timeout}s")
        return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(world_size)]
