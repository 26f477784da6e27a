"""Run a function on several local ranks over a CPU gloo process group.

The examples, benchmarks and multi-process tests all launch ranks the same way:

    results = run_gloo(fn, world_size, *args)   # fn(rank, world_size, *args) on every rank

Each rank is a fresh process with one intra-op thread, a gloo process group rendezvousing on
a TCP store the caller's process hosts (:func:`host_store`: the operating system picks its
loopback port as the server binds it, so two launches at once can never be handed the same
port), and the group destroyed at the end; ``fn``'s return values come back in rank
order. ``fn`` must be importable (a module-level function) and its results ``torch.save``-able.
The ranks are forked by multiprocessing's fork server, which imports torch and DTensor once per
parent process (:data:`PRELOAD`), so a rank starts in a fraction of a second instead of
importing torch itself (seconds each); where the fork server is unavailable they are spawned.
Nothing else is preloaded: each rank imports ``fn``'s module, and so this package, itself.

``timeout`` is a hang guard. When it expires, every rank still running dumps its Python stack
(``faulthandler`` on ``SIGUSR1``) before it is killed, and the ``TimeoutError`` names each such
rank, the c10d call it is blocked in (the innermost ``torch.distributed.distributed_c10d``
frame, e.g. ``all_reduce``) or else the line it is at, and its stack.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ragged_placement._gloo import exit_without_finalization, one_worker_gloo

__all__ = ["exit_without_finalization", "host_store", "in_flight_call", "run_gloo"]

# What the fork server imports once for every rank it forks: torch alone, never this package
# (a rank imports that with ``fn``'s module, so a function can run on stock torch).
PRELOAD = ("torch", "torch.distributed.tensor", "torch.distributed.checkpoint")
# Seconds a hung rank is given to write its stack after SIGUSR1.
_STACK_DUMP_WAIT = 5.0
# Kept open for faulthandler in a spawned rank (it writes to the file descriptor on SIGUSR1).
_stack_file = None


@contextlib.contextmanager
def host_store():
    """A ``TCPStore`` server on a loopback port the operating system picks as it binds it (no
    window in which another process can take the port, as there is between asking for a free
    port and a rank 0 binding it), hosted by this process for the ``with`` block; yields the port.
    Ranks connect to it as clients (``TCPStore("127.0.0.1", port, is_master=False)``)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        yield store.port
    finally:
        del store


def in_flight_call(frames: list[tuple[str, int, str]]) -> str:
    """Name what a stuck rank is blocked in, from its stack ``frames`` as ``(file, line,
    function)``, outermost first: the innermost ``torch.distributed.distributed_c10d`` function
    (the c10d collective, e.g. ``all_reduce``), else the innermost frame as ``file:line in fn``."""
    for filename, _, func in reversed(frames):
        if filename.replace(os.sep, "/").endswith("torch/distributed/distributed_c10d.py"):
            return f"c10d {func}"
    if not frames:
        return "no Python frame"
    filename, line, func = frames[-1]
    return f"{filename}:{line} in {func}"


_FAULTHANDLER_FRAME = re.compile(r'^\s*File "(?P<file>.+)", line (?P<line>\d+) in (?P<func>\S+)')
_FAULTHANDLER_THREAD = re.compile(
    r"(?:Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\)"
)


def _parse_faulthandler(text: str, thread_id: int) -> list[tuple[str, int, str]]:
    """Thread ``thread_id``'s frames, outermost first, from a ``faulthandler`` dump of all
    threads (one block per thread, most recent call first)."""
    for block in text.split("\n\n"):
        header = _FAULTHANDLER_THREAD.search(block)
        if header and int(header[1], 16) == thread_id:
            matches = map(_FAULTHANDLER_FRAME.match, block.splitlines())
            return [(m["file"], int(m["line"]), m["func"]) for m in matches if m][::-1]
    return []


def _hang_report(ctx, out_dir: str, fn_name: str, timeout: float) -> str:
    """Ask every live rank for its stack (SIGUSR1), wait for the dumps, and describe each."""
    alive = {r: p for r, p in enumerate(ctx.processes) if p.is_alive()}
    for p in alive.values():
        os.kill(p.pid, signal.SIGUSR1)
    paths = {r: os.path.join(out_dir, f"{r}.stack") for r in alive}
    deadline = time.monotonic() + _STACK_DUMP_WAIT
    while time.monotonic() < deadline and not all(
        os.path.exists(p) and "most recent call first" in open(p).read() for p in paths.values()
    ):
        time.sleep(0.1)
    time.sleep(0.2)  # let a dump that has started finish
    lines = [f"run_gloo({fn_name}) exceeded its {timeout}s hang guard; ranks still running:"]
    for r in alive:
        if not os.path.exists(paths[r]):
            lines.append(f"rank {r}: still starting (it had not reached its rank entry point)")
            continue
        first, _, dump = open(paths[r]).read().partition("\n")  # main thread id, then the dump
        frames = _parse_faulthandler(dump, int(first)) if first.isdigit() else []
        here = os.path.join("ragged_placement", "testing", "launch.py")
        entry = [i for i, (f, _, n) in enumerate(frames) if f.endswith(here) and n == "_rank_main"]
        frames = frames[entry[-1] :] if entry else frames  # drop the spawn machinery above it
        where = in_flight_call(frames) if frames else f"no stack {_STACK_DUMP_WAIT}s after SIGUSR1"
        lines.append(f"rank {r}: blocked in {where}")
        lines.extend(f"    {f}:{n} in {fn}" for f, n, fn in frames)
    done = [r for r in range(len(ctx.processes)) if r not in alive]
    if done:
        lines.append(f"ranks that had exited: {done}")
    return "\n".join(lines)


def _rank_main(
    rank: int, fn, world_size: int, port: int, args: tuple, out_dir: str, threads: int,
    one_worker: bool,
) -> None:
    global _stack_file
    _stack_file = open(os.path.join(out_dir, f"{rank}.stack"), "w")  # noqa: SIM115 - kept open
    _stack_file.write(f"{threading.main_thread().ident}\n")
    _stack_file.flush()
    faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True)
    os.environ["MASTER_ADDR"] = "127.0.0.1"  # for code in ``fn`` that reads them
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)  # run_gloo's host_store
    # The rank's gloo groups (the default one and whatever ``fn`` creates) run one worker thread:
    # the runtime overlaps collectives on them (ragged_placement.one_worker_gloo).
    with one_worker_gloo() if one_worker else contextlib.nullcontext():
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        try:
            result = fn(rank, world_size, *args)
            torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
            dist.barrier()
        finally:
            dist.destroy_process_group()
    exit_without_finalization()


def _start_method() -> str:
    """``"forkserver"`` preloading :data:`PRELOAD` where it exists (POSIX), else ``"spawn"``."""
    if "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    mp.set_forkserver_preload(list(PRELOAD))
    return "forkserver"


def run_gloo(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float | None = None,
    threads_per_rank: int = 1,
    one_worker: bool = True,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; return the
    results in rank order. An exception on any rank is raised here (the other ranks are killed).
    ``timeout`` (seconds, a hang guard) kills the ranks and raises ``TimeoutError`` naming each
    rank still running, the c10d call it is blocked in and its stack. ``one_worker``: the rank
    runs inside :func:`~ragged_placement.one_worker_gloo` (its gloo groups run one worker
    thread); ``False`` gives torch's groups as a program that does not opt in has them."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    with tempfile.TemporaryDirectory() as out_dir, host_store() as port:
        ctx = mp.start_processes(
            _rank_main,
            args=(fn, world_size, port, args, out_dir, threads_per_rank, one_worker),
            nprocs=world_size,
            join=False,
            start_method=_start_method(),
        )
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1.0):
                if deadline is not None and time.monotonic() > deadline:
                    name = getattr(fn, "__name__", str(fn))
                    raise TimeoutError(_hang_report(ctx, out_dir, name, timeout))
        finally:  # also on KeyboardInterrupt or a test runner's own timeout: no orphan ranks
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join()
        paths = [os.path.join(out_dir, f"{r}.pt") for r in range(world_size)]
        return [torch.load(p, weights_only=False) for p in paths]
