"""The measurement instruments of ragged_placement.fsdp.profiling against known allocations."""

from __future__ import annotations

import threading

import torch

from ragged_placement.fsdp.profiling import HeapPeakMeter, heap_in_use

MiB = 2**20
TOL = MiB // 4  # interpreter and allocator noise


def _floats(nbytes: int) -> torch.Tensor:
    return torch.ones(nbytes // 4)


def test_heap_peak_counts_what_is_allocated_after_entering_and_nothing_before():
    for _ in range(2):  # warm up the dispatch mode and the allocator's thresholds
        with HeapPeakMeter() as mem:
            with mem.measure():
                _floats(MiB)
    before = _floats(16 * MiB)  # alive before entering: not counted
    with HeapPeakMeter() as mem:
        kept = _floats(4 * MiB)  # allocated after entering, alive through the window: counted
        with mem.measure():
            a = _floats(8 * MiB)
            b = a * 2  # peak: kept + a + b = 20 MiB
            del a, b
            c = _floats(2 * MiB)
        del c
        _floats(64 * MiB)  # outside any window: not counted
    assert abs(mem.peak - 20 * MiB) < TOL, mem.peak / MiB
    del before, kept


def test_heap_peak_sees_memory_freed_on_another_thread():
    # The profiler's allocator events miss frees on threads it does not follow (a gloo worker
    # dropping a buffer); the heap does not: a 32 MiB buffer freed by a thread before the window
    # is not in the peak.
    with HeapPeakMeter() as mem:
        box = [_floats(32 * MiB)]
        t = threading.Thread(target=box.clear)
        t.start()
        t.join()
        with mem.measure():
            x = _floats(8 * MiB)
            del x
    assert abs(mem.peak - 8 * MiB) < TOL, mem.peak / MiB
    assert heap_in_use() > 0
