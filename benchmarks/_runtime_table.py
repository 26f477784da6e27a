"""What the FSDP benchmarks (fsdp_vs_fsdp2.py, compose.py) share: one run's measurements
(:func:`measure_runtime`) and the ours-vs-FSDP2 table they print.

``per_rank[r][runtime]`` is a list with one dict per run: ``all_gathers``, ``ag_bytes``,
``reduce_scatters``, ``rs_bytes``, ``copy_bytes``, ``peak`` (bytes) and ``time`` (the run's median
step, seconds). Counts come from rank 0's first run, peak memory is the max over ranks and runs,
step time the median over rank 0's runs (steps end in a barrier).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch.distributed as dist

from ragged_placement.testing.profiling import CollectiveMeter, HeapPeakMeter, LayoutCopyMeter

Step = Callable[[int], object]


def measure_runtime(make_step: Callable[[], Step], warmup: int, steps: int) -> dict:
    """One run of one runtime: ``make_step()`` builds the sharded model and returns ``step(i)``.

    ``warmup`` steps, then ``steps`` timed steps (each between barriers, median kept), then one
    step under :class:`CollectiveMeter` and one under :class:`LayoutCopyMeter`; the model is then
    dropped and :func:`peak_memory` builds a fresh one."""
    step = make_step()
    for i in range(warmup):
        step(i)
    times = []
    for i in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step(warmup + i)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    with CollectiveMeter() as meter:
        step(0)
    with LayoutCopyMeter() as copies:
        step(1)
    del step
    return {
        "time": statistics.median(times),
        "all_gathers": meter.counts["all_gather"],
        "reduce_scatters": meter.counts["reduce_scatter"],
        "ag_bytes": meter.all_gather_bytes,
        "rs_bytes": meter.reduce_scatter_bytes,
        "copy_bytes": copies.total,
        "peak": peak_memory(make_step),
    }


def peak_memory(make_step: Callable[[], Step], warmup: int = 2, steps: int = 3) -> int:
    """Peak heap bytes of ``steps`` training steps of a model that ``make_step()`` builds under a
    :class:`HeapPeakMeter` (so every byte the runtime holds counts), after ``warmup`` steps. The
    allocation order depends on when collectives complete: the worst of several steps is kept."""
    with HeapPeakMeter() as mem:
        step = make_step()
        for i in range(warmup):
            step(i)
        for i in range(warmup, warmup + steps):
            with mem.measure():
                step(i)
        del step
    return mem.peak


def fmt_bytes(n: float) -> str:
    return f"{n / 2**20:.3f} MiB" if n else "0"


def _agg(per_rank: list[dict], runtime: str, key: str):
    if key == "time":
        return statistics.median(r[key] for r in per_rank[0][runtime])
    if key == "peak":
        return max(r[key] for rank in per_rank for r in rank[runtime])
    return per_rank[0][runtime][0][key]


def print_runtime_table(per_rank: list[dict], title: str, peer: str, ours: str, collective: str = "") -> None:
    """Print ``title``, then each metric for FSDP2 (``peer``) and ours with the ratio ours/FSDP2."""
    rows = [
        (f"{collective}all-gathers / step", "all_gathers", str),
        ("all-gathered bytes / step", "ag_bytes", fmt_bytes),
        (f"{collective}reduce-scatters / step", "reduce_scatters", str),
        ("reduce-scattered bytes / step", "rs_bytes", fmt_bytes),
        ("copy-in/out bytes / step", "copy_bytes", fmt_bytes),
        ("peak memory / rank (max)", "peak", fmt_bytes),
        ("step time (median)", "time", lambda t: f"{t * 1e3:.1f} ms"),
    ]
    print(f"\n{title}\n")
    print(f"{'metric':32s} {peer:>14s} {ours:>14s} {'ours/FSDP2':>11s}")
    print("-" * 74)
    for label, key, fmt in rows:
        a, b = _agg(per_rank, "fsdp2", key), _agg(per_rank, "ours", key)
        ratio = f"{b / a:.3f}" if a else ("-" if not b else "inf")
        print(f"{label:32s} {fmt(a):>14s} {fmt(b):>14s} {ratio:>11s}")
    times = {rt: [f"{r['time'] * 1e3:.1f}" for r in per_rank[0][rt]] for rt in ("fsdp2", "ours")}
    print(f"\nper-run step medians (ms): FSDP2 {times['fsdp2']}, ours {times['ours']}")
