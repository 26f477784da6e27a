"""Harnesses for multi-rank tests.

* :func:`run_threaded` simulates ``world_size`` ranks in one process, one thread per rank, over
  torch's in-process "threaded" process group. Collectives really move data, so our code runs
  unmodified on every rank. Fast enough for hypothesis property tests.
* :func:`run_gloo` spawns ``world_size`` real processes over gloo (integration tests), through
  :func:`ragged_placement.testing.launch.run_gloo`.
* :func:`recording_collectives` records which rank called which c10d collective (threaded ranks
  share the patched module), for tests that assert what a step communicates.

Both call ``fn(rank, world_size, *args)`` on every rank and return the per-rank results in rank
order; an exception on any rank is re-raised in the caller. Process groups are always destroyed.
Their ``timeout`` is a hang guard, never what decides a pass on a slow machine: on expiry the
``TimeoutError`` names each rank still running, the c10d call it is blocked in and its stack.
Whatever ends a call, its ranks are gone before it returns (threads torn down, processes
killed), so a failed or hung test cannot leak ranks or process groups into the next one.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import ctypes
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ragged_placement.testing import launch

__all__ = [
    "CollectiveCalls",
    "WorldTornDown",
    "recording_collectives",
    "run_gloo",
    "run_threaded",
]

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


# recording_collectives' state, shared by every thread: the records open now, and the c10d
# functions it replaced (one recording wrapper per name, whoever opened a record first). Rank
# threads open records at once; each patching on its own would stack wrappers and restore the
# wrong function on exit, leaving a wrapper installed for the rest of the process.
_recording_lock = threading.Lock()
_records: list[tuple[CollectiveCalls, frozenset[str]]] = []
_replaced: dict[str, Callable[..., Any]] = {}


def _recording(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        rank = dist.get_rank()
        with _recording_lock:
            for record, names in _records:
                if name in names:
                    record.calls.setdefault(name, []).append(rank)
                    if name == "all_to_all_single":
                        record.all_to_all_bytes[rank] += args[1].numel() * args[1].element_size()
        return fn(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def recording_collectives(names: tuple[str, ...] = COLLECTIVES) -> Iterator[CollectiveCalls]:
    """Record, while the block runs, every call of ``torch.distributed.<name>`` for each of
    ``names`` by any thread (see :class:`CollectiveCalls`). Safe to open from every rank thread
    at once: each record sees every rank's calls, and the last record to close restores torch's
    functions."""
    record = CollectiveCalls()
    entry = (record, frozenset(names))
    with _recording_lock:
        for n in names:
            if n not in _replaced:
                _replaced[n] = getattr(dist, n)
                setattr(dist, n, _recording(n, _replaced[n]))
        _records.append(entry)
    try:
        yield record
    finally:
        with _recording_lock:
            _records.remove(entry)
            if not _records:
                for n, fn in _replaced.items():
                    setattr(dist, n, fn)
                _replaced.clear()


# One threaded world at a time: torch's threaded process group keeps its in-flight collectives in
# class attributes keyed by group name, so two worlds alive at once would join each other's calls.
_THREADED_LOCK = threading.Lock()
# Rank threads (and their done events) of a torn-down world still running when it returned.
_straggling: list[tuple[threading.Thread, threading.Event]] = []
# Hang guard of run_threaded (seconds): >= 10x any test's time on an idle 2-core machine.
THREADED_TIMEOUT = 600.0
# Hang guard of run_gloo (seconds), from the spawn: 8 ranks importing torch on 2 busy cores
# take minutes.
GLOO_TIMEOUT = 600.0
# How long a torn-down world's rank threads get to exit.
TEARDOWN_GRACE = 60.0


class WorldTornDown(BaseException):
    """Raised inside a rank thread to stop it when its world is torn down (a ``BaseException``,
    like ``SystemExit``, so that ``except Exception`` in the code under test does not swallow
    it)."""


def _frames(thread: threading.Thread) -> list[tuple[str, int, str]]:
    """``thread``'s stack from its rank function on, outermost first."""
    frame = sys._current_frames().get(thread.ident)
    stack = traceback.extract_stack(frame) if frame else []
    frames = [(f.filename, f.lineno, f.name) for f in stack]
    entry = [i for i, (f, _, name) in enumerate(frames) if name == "rank_main" and f == __file__]
    return frames[entry[-1] + 1 :] if entry else frames


def _hang_report(
    fn: Callable[..., Any], timeout: float, threads: list[threading.Thread], running: list[int]
) -> str:
    lines = [f"run_threaded({getattr(fn, '__name__', fn)}) exceeded its {timeout}s hang guard"]
    for rank in running:
        frames = _frames(threads[rank])
        lines.append(f"rank {rank}: blocked in {launch.in_flight_call(frames)}")
        lines.extend(f"    {f}:{n} in {name}" for f, n, name in frames)
    return "\n".join(lines)


class _Settled(BaseException):
    """What :func:`_settle_async_exc` sends a thread to itself, replacing a pending one."""


def _raise_in(thread: threading.Thread, exc_type: type[BaseException]) -> int:
    """Raise ``exc_type`` in ``thread`` at its next eval-loop check (CPython's asynchronous
    exception, replacing one still pending). Returns the number of threads it was set for."""
    return ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread.ident), ctypes.py_object(exc_type)
    )


def _settle_async_exc() -> None:
    """Drop any asynchronous exception still pending for the calling thread, by replacing it
    with :class:`_Settled` and taking that here.

    Cancelling with ``PyThreadState_SetAsyncExc(tid, NULL)`` instead leaves CPython's
    interpreter-wide "async exception pending" flag set (before 3.13 only delivering one clears
    it): every later eval-breaker check takes the slow path, and under a profiler (``cProfile``)
    CPython 3.11 re-runs the ``RESUME`` check of the next Python call forever, which hung the
    first profiled test after any threaded world."""
    try:
        if _raise_in(threading.current_thread(), _Settled):
            while True:  # the eval loop delivers it at the next check: a call or this jump back
                time.sleep(0)
    except _Settled:
        pass


class _RankThreads:
    """The rank threads of one world.

    ``done[rank]`` is set when a thread has left its rank function for good; waits use it rather
    than ``Thread.join``, because on Python < 3.12 an exception that interrupts a ``join`` (a
    test runner's timeout) can mark a running thread as stopped. An asynchronous exception is only
    ever sent to a thread that is still inside its rank function (under ``lock``): one that lands
    in ``threading``'s own clean-up would leave the thread half-deleted."""

    def __init__(self, target: Callable[[int], None], world_size: int, name: str) -> None:
        self.lock = threading.Lock()
        self.done = [threading.Event() for _ in range(world_size)]
        self._target = target
        self.threads = [
            threading.Thread(
                target=self._run, args=(r,), name=f"run_threaded:{name}:rank{r}", daemon=True
            )
            for r in range(world_size)
        ]

    def _run(self, rank: int) -> None:
        try:
            self._target(rank)
        except (WorldTornDown, SystemExit):
            pass  # torn down (or woken by the terminate event): the caller reports why
        while True:
            try:
                with self.lock:
                    self.done[rank].set()
                _settle_async_exc()  # one sent before the line above
                return
            except WorldTornDown:
                continue

    def running(self) -> list[int]:
        return [r for r, d in enumerate(self.done) if not d.is_set()]

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every rank; True if all finished."""
        deadline = time.monotonic() + timeout
        for d in self.done:
            d.wait(max(0.0, deadline - time.monotonic()))
        return not self.running()

    def _stop(self, rank: int) -> None:
        with self.lock:
            if not self.done[rank].is_set():
                _raise_in(self.threads[rank], WorldTornDown)

    def tear_down(
        self, pg_class: Any, grace: float
    ) -> list[tuple[threading.Thread, threading.Event]]:
        """Stop the rank threads still running: wake those waiting in a threaded collective (they
        exit with ``SystemExit``), raise :class:`WorldTornDown` in the others, and wait up to
        ``grace`` seconds. Returns the threads still running."""
        deadline = time.monotonic() + grace
        next_raise = 0.0
        while self.running() and time.monotonic() < deadline:
            pg_class.exception_handle(WorldTornDown())  # sets the terminate event, wakes waiters
            if time.monotonic() >= next_raise:  # again later, for a thread that swallowed it
                for r in self.running():
                    self._stop(r)
                next_raise = time.monotonic() + 5.0
            self.wait(0.05)
        for r, t in enumerate(self.threads):
            if self.done[r].is_set():
                t.join(1.0)  # it is past its rank function: only threading's clean-up is left
        return [(self.threads[r], self.done[r]) for r in self.running()]


def _reap_stragglers(grace: float) -> None:
    """Wait for the rank threads of an earlier torn-down world; raise if some still run."""
    deadline = time.monotonic() + grace
    for t, done in _straggling:
        if done.wait(max(0.0, deadline - time.monotonic())):
            t.join(1.0)
    _straggling[:] = [(t, done) for t, done in _straggling if not done.is_set()]
    if _straggling:
        names = ", ".join(t.name for t, _ in _straggling)
        raise RuntimeError(
            f"rank threads of an earlier run_threaded world are still running ({names}); a new "
            "world would share their process groups, so none is started"
        )


def run_threaded(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = THREADED_TIMEOUT
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` threads sharing a threaded PG.

    Returns the per-rank results in rank order; an exception on any rank is re-raised as an
    ``AssertionError`` naming the rank. ``timeout`` (seconds) is a hang guard: when it expires,
    the ``TimeoutError`` names each rank still running, the c10d call it is blocked in and its
    stack. Whatever ends the call (results, an error, the hang guard, a test runner's own
    timeout, Ctrl-C), the world is torn down before it returns: its rank threads have exited
    and the threaded process group is uninstalled, so the next world starts clean.
    """
    from torch.testing._internal.distributed.multi_threaded_pg import ProcessLocalGroup

    from ragged_placement._compat import install_threaded_pg, uninstall_threaded_pg

    with _THREADED_LOCK:
        _reap_stragglers(TEARDOWN_GRACE)
        ProcessLocalGroup.reset()
        results: list[Any] = [None] * world_size
        errors: queue.Queue = queue.Queue()
        torch._C._distributed_c10d._set_thread_isolation_mode(True)
        world = install_threaded_pg()
        store = dist.HashStore()

        def rank_main(rank: int) -> None:
            dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
            try:
                results[rank] = fn(rank, world_size, *args)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                errors.put((rank, exc, traceback.format_exc()))
                ProcessLocalGroup.exception_handle(exc)
            finally:
                if world == dist.distributed_c10d._world:
                    dist.destroy_process_group()

        ranks = _RankThreads(rank_main, world_size, getattr(fn, "__name__", "fn"))
        try:
            for t in ranks.threads:
                t.start()
            if not ranks.wait(timeout):
                raise TimeoutError(_hang_report(fn, timeout, ranks.threads, ranks.running()))
        finally:
            stragglers = ranks.tear_down(ProcessLocalGroup, TEARDOWN_GRACE)
            _straggling.extend(stragglers)
            if not stragglers:
                ProcessLocalGroup.reset()  # else the terminate event stays set for them
            uninstall_threaded_pg()
            torch._C._distributed_c10d._set_thread_isolation_mode(False)
        if not errors.empty():
            rank, exc, tb = errors.get()
            raise AssertionError(f"rank {rank} failed:\n{tb}") from exc
        return results


def run_gloo(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = GLOO_TIMEOUT,
    one_worker: bool = True,
) -> list[Any]:
    """:func:`ragged_placement.testing.launch.run_gloo` with tests/ importable in the spawned ranks (``fn``
    is a module-level function of a test module). ``timeout`` is a hang guard: on expiry the
    ``TimeoutError`` names each rank still running, the c10d call it is blocked in and its
    stack."""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    if tests_dir not in sys.path:
        sys.path.insert(0, tests_dir)
    return launch.run_gloo(fn, world_size, *args, timeout=timeout, one_worker=one_worker)
