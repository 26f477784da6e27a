"""The multi-rank harnesses themselves: a rank that hangs or fails is named, and its world is gone
before the next one starts.

Reference for "clean": a 4-rank world right after the broken one computes an exact all-reduce and
all-gather (a rank thread left over from the broken world would join these collectives, since
torch's threaded process group matches calls by group name, and corrupt or hang them).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from dist_utils import run_gloo, run_threaded

import dist_utils
from ragged_placement.testing import launch

TESTS = Path(__file__).parent


def _sum_and_gather(rank: int, ws: int) -> tuple[float, list[int]]:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(ws)]
    dist.all_gather(out, torch.tensor([rank * 10]))
    return t.item(), [int(o) for o in out]


def _assert_next_world_is_clean() -> None:
    expect = (10.0, [0, 10, 20, 30])
    assert run_threaded(_sum_and_gather, 4) == [expect] * 4
    assert not [t for t in threading.enumerate() if t.name.startswith("run_threaded:")]
    assert not dist.is_initialized()  # the caller's (non-threaded) world is untouched


def _ranks_inside(report: str, fn_name: str) -> int:
    """How many ranks of a hang report have ``fn_name`` on their stack."""
    sections = report.split("\nrank ")[1:]
    return sum(f" in {fn_name}\n" in section + "\n" for section in sections)


def _time_out(fn, ws: int, *args, timeouts=(1.0, 8.0, 60.0)) -> str:
    """The hang report of ``run_threaded(fn, ws, *args(timeout), timeout=timeout)`` for the first
    timeout at which every rank had reached ``fn`` (ranks start late on a busy machine)."""
    for timeout in timeouts:
        with pytest.raises(TimeoutError) as info:
            run_threaded(fn, ws, *(a(timeout) if callable(a) else a for a in args), timeout=timeout)
        report = str(info.value)
        if _ranks_inside(report, fn.__name__) == ws:
            break
    assert f"exceeded its {timeout}s hang guard" in report
    return report


def _rank_0_waits_rank_1_spins(rank: int, ws: int) -> None:
    dist.barrier()
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins: a real hang
    else:
        while True:  # a rank stuck in Python code (a loop that never ends)
            time.sleep(0.01)


def test_hang_guard_names_ranks_and_collective_and_tears_the_world_down():
    report = _time_out(_rank_0_waits_rank_1_spins, 2)
    assert "rank 0: blocked in c10d all_reduce" in report, report
    rank_1 = report.split("rank 1: blocked in ")[1].splitlines()[0]
    assert rank_1.endswith("in _rank_0_waits_rank_1_spins") and "test_dist_utils.py" in rank_1
    _assert_next_world_is_clean()


def _rank_2_fails(rank: int, ws: int) -> None:
    if rank == 2:
        raise ValueError("rank 2 broke")
    dist.all_reduce(torch.ones(1))  # the others wait for rank 2 until the world is woken


def test_failed_rank_is_named_and_the_next_world_is_clean():
    with pytest.raises(AssertionError, match=r"(?s)rank 2 failed:.*ValueError: rank 2 broke"):
        run_threaded(_rank_2_fails, 4)
    _assert_next_world_is_clean()


def _sum_of_ranks(rank: int, ws: int) -> float:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def test_a_threaded_world_ends_with_torchs_world_and_autograd_as_they_were():
    """``run_threaded`` returns each rank's result, and afterwards c10d's world is the one before
    it and autograd's multithreading is on again (torch 2.11's own uninstall leaves it off;
    its threaded world lacks the ``comms`` its ``destroy_process_group`` reads:
    ``_compat.install_threaded_pg``)."""
    world = dist.distributed_c10d._world
    assert torch.autograd.is_multithreading_enabled()
    assert run_threaded(_sum_of_ranks, 3) == [3.0, 3.0, 3.0]
    assert dist.distributed_c10d._world is world
    assert torch.autograd.is_multithreading_enabled()


_PROFILE_AFTER_A_WORLD = """
import cProfile, sys
sys.path.insert(0, {tests!r})
from dist_utils import run_threaded

def depth(n):
    return 0 if n == 0 else 1 + depth(n - 1)

assert run_threaded(lambda rank, ws: rank, 2) == [0, 1]
profile = cProfile.Profile()
profile.enable()
assert depth(50) == 50
profile.disable()
print("profiled")
"""


def test_a_profiled_call_after_a_threaded_world_returns():
    """The rank threads cancel any teardown exception still pending for them by taking one, not
    with ``PyThreadState_SetAsyncExc(tid, NULL)``: that leaves CPython's interpreter-wide
    pending flag set, and CPython 3.11 then spins forever in the first Python call made under
    ``cProfile`` (how ``test_fsdp_host_overhead`` hung CI after any threaded test on its
    worker). A fresh interpreter, so that a regression fails here rather than hang this one;
    the limit is a hang guard (the script takes ~5 s, mostly importing torch)."""
    import subprocess

    script = _PROFILE_AFTER_A_WORLD.format(tests=str(TESTS.parent))
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "profiled", done.stderr[-2000:]


class _Interrupted(Exception):
    pass


def _all_ranks_spin(rank: int, ws: int) -> None:
    dist.barrier()
    while True:
        time.sleep(0.01)


def test_interrupt_of_the_caller_tears_the_world_down():
    """What pytest-timeout (SIGALRM) or Ctrl-C do: an exception raised in the main thread while it
    waits for the ranks."""

    def raise_interrupted(signum, frame):
        raise _Interrupted

    old = signal.signal(signal.SIGUSR2, raise_interrupted)
    main = threading.main_thread().ident
    timer = threading.Timer(1.0, signal.pthread_kill, (main, signal.SIGUSR2))
    try:
        timer.start()
        with pytest.raises(_Interrupted):
            run_threaded(_all_ranks_spin, 3)
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR2, old)
    _assert_next_world_is_clean()


def _rank_1_sleeps_in_c(rank: int, ws: int, seconds: float) -> None:
    dist.barrier()
    if rank == 1:
        time.sleep(seconds)  # one C call: an async exception lands only when it returns
    dist.barrier()


def test_rank_that_outlives_the_teardown_blocks_the_next_world_with_a_clear_error(monkeypatch):
    monkeypatch.setattr(dist_utils, "TEARDOWN_GRACE", 0.2)
    sleep = lambda timeout: timeout + 3.0  # noqa: E731 - outlives the hang guard and the grace
    report = _time_out(_rank_1_sleeps_in_c, 2, sleep, timeouts=(0.5, 8.0, 60.0))
    assert "rank 0: blocked in c10d barrier" in report, report
    with pytest.raises(RuntimeError, match=r"_rank_1_sleeps_in_c:rank1.*none is started"):
        run_threaded(_sum_and_gather, 4)
    monkeypatch.setattr(dist_utils, "TEARDOWN_GRACE", 60.0)  # the sleep ends within 3 s
    _assert_next_world_is_clean()


def _gloo_rank_0_waits(rank: int, ws: int, ready_dir: str) -> None:
    dist.barrier()  # both ranks are up
    open(os.path.join(ready_dir, str(rank)), "w").close()
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
    else:
        time.sleep(3600)


@pytest.mark.multiprocess
def test_gloo_hang_guard_kills_the_ranks():
    with tempfile.TemporaryDirectory() as ready_dir:
        with pytest.raises(TimeoutError, match=r"run_gloo\(_gloo_rank_0_waits\) exceeded its 1.0s"):
            run_gloo(_gloo_rank_0_waits, 2, ready_dir, timeout=1.0)
    assert not multiprocessing.active_children()


@pytest.mark.multiprocess
def test_gloo_hang_report_names_the_rank_the_collective_and_the_stack(tmp_path):
    """The report ``run_gloo``'s hang guard raises, taken once both ranks are at their hang (the
    guard itself counts from the spawn, which takes long on a busy machine)."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))  # the ranks import this module
    ready = tmp_path / "ready"
    ready.mkdir()
    with launch.host_store() as port:
        args = (_gloo_rank_0_waits, 2, port, (str(ready),), str(tmp_path), 1, True)
        ctx = mp.start_processes(launch._rank_main, args, nprocs=2, join=False, start_method="spawn")
        try:
            deadline = time.monotonic() + dist_utils.GLOO_TIMEOUT
            while len(os.listdir(ready)) < 2 and time.monotonic() < deadline:
                assert all(p.is_alive() for p in ctx.processes), "a rank exited"
                time.sleep(0.1)
            report = launch._hang_report(ctx, str(tmp_path), "_gloo_rank_0_waits", 1.0)
        finally:
            for p in ctx.processes:
                p.kill()
                p.join()
    assert "rank 0: blocked in c10d all_reduce" in report, report
    rank_1 = report.split("rank 1: blocked in ")[1].splitlines()[0]
    assert rank_1.endswith("in _gloo_rank_0_waits") and "test_dist_utils.py" in rank_1, report
    assert report.split("rank 1:")[1].splitlines()[1].endswith("in _rank_main")  # trimmed stack


def _record_on_every_rank(rank: int, ws: int) -> tuple[list[int], bool]:
    """Every rank opens its own record at once, creates an out-of-order group (the path
    ``state_sharding`` takes) and all-reduces on it."""
    from ragged_placement import _compat

    with dist_utils.recording_collectives(("all_reduce", "new_group")) as record:
        group = _compat.new_group_in_order([ws - 1 - r for r in range(ws)])
        t = torch.ones(1)
        dist.all_reduce(t, group=group)
        dist.barrier()
    return dist.get_process_group_ranks(group), sorted(record.calls["all_reduce"]) == list(range(ws))


def test_records_opened_by_every_rank_thread_leave_torch_as_it_was():
    """Rank threads opening ``recording_collectives`` at once record every rank's calls and,
    once all closed, leave torch's functions in place (each patching on its own stacked
    wrappers and restored the wrong one, so a wrapper outlived the test, hid ``new_group``'s
    ``sort_ranks`` from :func:`ragged_placement._compat.new_group_in_order` and a later 8-rank
    world hung in a group's store barrier)."""
    before = {n: getattr(dist, n) for n in ("all_reduce", "new_group")}
    for _ in range(3):
        results = run_threaded(_record_on_every_rank, 4)
        assert results == [([3, 2, 1, 0], True)] * 4
    assert {n: getattr(dist, n) for n in before} == before
    _assert_next_world_is_clean()
