"""Run a function on several local ranks over a CPU gloo process group.

The examples, benchmarks and multi-process tests all launch ranks the same way:

    results = run_gloo(fn, world_size, *args)   # fn(rank, world_size, *args) on every rank

Each rank is a spawned process with one intra-op thread, a gloo process group over a free
loopback port, and the group destroyed at the end; ``fn``'s return values come back in rank
order. ``fn`` must be importable (a module-level function) and its results ``torch.save``-able.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "run_gloo"]


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, fn, world_size: int, port: int, args: tuple, out_dir: str, threads: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_gloo(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float | None = None,
    threads_per_rank: int = 1,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; return the
    results in rank order. An exception on any rank is raised here; ``timeout`` (seconds) kills
    the ranks and raises ``TimeoutError``."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _rank_main,
            args=(fn, world_size, free_port(), args, out_dir, threads_per_rank),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = None if timeout is None else time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if deadline is not None and time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"run_gloo({getattr(fn, '__name__', fn)!s}) exceeded {timeout}s")
        return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(world_size)]
