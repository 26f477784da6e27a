"""The measurement instruments of ragged_placement.testing.profiling against known allocations."""

from __future__ import annotations

import threading

import pytest
import torch
from dist_utils import run_gloo

from ragged_placement.testing.profiling import HeapPeakMeter, heap_in_use

MiB = 2**20
TOL = MiB // 4  # interpreter and allocator noise


def _floats(nbytes: int) -> torch.Tensor:
    return torch.ones(nbytes // 4)


def test_heap_peak_counts_what_is_allocated_after_entering_and_nothing_before():
    for _ in range(2):  # warm up the dispatch mode and the allocator's thresholds
        with HeapPeakMeter() as mem, mem.measure():
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



def _one_step_counted(rank: int, cfg, init: dict, mesh, runtime: str, sharding) -> tuple:
    """A small GPT's blocks and root sharded (each runtime at its default
    ``reshard_after_forward``), one AdamW step, then one more counted: the counter's groups and
    our units' own ``CommStats.by_dims`` (empty for FSDP2 and for default points)."""
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    from ragged_placement.fsdp import fully_shard
    from ragged_placement.models import GPT
    from ragged_placement.testing.profiling import CollectiveMeter

    model = GPT(cfg)
    model.load_state_dict(init)
    for m in [*model.layers, model]:
        if runtime == "ours":
            fully_shard(m, mesh=mesh, state_sharding=sharding)
        else:
            fsdp2_fully_shard(m, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    units = [u for _, u in model.fsdp_units()] if runtime == "ours" else []
    for _ in range(2):
        x, y = torch.randint(256, (2, 16), generator=g), torch.randint(256, (2, 16), generator=g)
        for u in units:
            u.stats.reset()
        with CollectiveMeter() as meter:
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
    stats: dict = {}
    for u in units:
        for key, (n, nbytes) in u.stats.by_dims.items():
            stats[key] = [a + b for a, b in zip(stats.get(key, [0, 0]), (n, nbytes))]
    return meter, stats


def _counters_on_2x2(rank: int, ws: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ragged_placement.fsdp import StateSharding
    from ragged_placement.models import GPT, GPTConfig
    from ragged_placement.testing.profiling import CollectiveMeter

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("inter", "intra"))
    flat = init_device_mesh("cpu", (4,))
    cfg = GPTConfig(n_layer=2, n_embd=64, n_head=2, block_size=16)
    torch.manual_seed(0)
    init = GPT(cfg).state_dict()
    runs = {"fsdp2_full": ("fsdp2", flat, None), "fsdp2_hsdp": ("fsdp2", mesh, None),
            "zero3": ("ours", mesh, StateSharding.zero3(mesh)),
            "hsdp": ("ours", mesh, StateSharding.hsdp(mesh, "intra"))}
    out = {}
    for name, (runtime, m, sharding) in runs.items():
        meter, stats = _one_step_counted(rank, cfg, init, m, runtime, sharding)
        out[name] = (meter.by_dims(mesh), stats)  # FSDP2's 1-D groups named by 2x2 dims
    diagonal = dist.new_group([0, 3])  # spans no set of the 2x2 mesh's dims
    if rank in (0, 3):
        with CollectiveMeter() as meter:
            dist.all_reduce(torch.ones(4), group=diagonal)
        with pytest.raises(ValueError, match=r"ranks \[0, 3\] spans no set of dims"):
            meter.by_dims(mesh)
    return out


@pytest.mark.multiprocess
def test_collective_meter_by_dims_matches_fsdp2_and_comm_stats_on_2x2():
    """Per step on a 2x2 mesh, by the dims each group spans: our zero3 runs FSDP2 full-shard's
    all-gathers and reduce-scatters (calls, bytes, bytes moved) over both dims, our hsdp FSDP2
    HSDP's over intra and its all-reduces over inter; ours adds one all-reduce of one byte per
    parameter (the unused-gradient flags) over each group. The counter equals the units' own
    CommStats.by_dims plus those flags."""
    from ragged_placement.models import GPT, GPTConfig

    n = len(list(GPT(GPTConfig(n_layer=2, n_embd=64, n_head=2, block_size=16)).parameters()))
    flags = [1, n, 2 * 3 * n // 4]  # an all-reduce of n bytes over 4 ranks: 2 (n-1)/n moved
    flags_2 = [1, n, n]  # over 2 ranks
    both, intra, inter = ("inter", "intra"), ("intra",), ("inter",)
    for rank, out in enumerate(run_gloo(_counters_on_2x2, 4)):
        full, zero3, zero3_stats = out["fsdp2_full"][0], *out["zero3"]
        assert set(full) == {("all_gather", both), ("reduce_scatter", both)}, rank
        assert zero3 == {**full, ("all_reduce", both): flags}, rank
        assert {k: v[:2] for k, v in zero3.items() if k[0] != "all_reduce"} == zero3_stats
        hsdp2, hsdp = out["fsdp2_hsdp"][0], out["hsdp"][0]
        assert set(hsdp2) == {("all_gather", intra), ("reduce_scatter", intra),
                              ("all_reduce", inter)}, rank
        ar = hsdp2[("all_reduce", inter)]
        assert hsdp == {**hsdp2, ("all_reduce", intra): flags_2,
                        ("all_reduce", inter): [a + b for a, b in zip(ar, flags_2)]}, rank
        assert out["fsdp2_full"][1] == out["fsdp2_hsdp"][1] == out["hsdp"][1] == {}


def _uneven_fp8_metered(rank: int, ws: int) -> list[tuple[int, int, int]]:
    """One step of the FP8 GPT, whose blocks gather uneven FP8 sends, under the meter: as the
    runtime issues it, and with the uneven all-gather behind a ``*args`` wrapper (a benchmark's
    stand-in, a tracer). Per way: (meter's all-gather bytes, the units' own count, gathers)."""
    from common.fp8 import SEQ, fp8_corpus, fp8_gpt, fp8_mesh, shard_fp8
    from common_fsdp import rows as _rows

    from ragged_placement.fsdp import collectives
    from ragged_placement.fsdp.fp8 import FP8UnitGather
    from ragged_placement.testing.profiling import CollectiveMeter

    torch.set_num_threads(1)
    m = fp8_gpt()
    shard_fp8(m, fp8_mesh(ws))
    units = [u for _, u in m.fsdp_units()]
    assert any(isinstance(b.gather, FP8UnitGather) and b.gather.segment.rank_starts is not None
               for u in units for b in u.buffers)
    real = collectives._all_gather_uneven
    out = []
    for wrapped in (False, True):
        if wrapped:
            collectives._all_gather_uneven = lambda *args: real(*args)
        before = sum(u.stats.all_gather_bytes for u in units)
        try:
            with CollectiveMeter() as meter:
                x, y = fp8_corpus().batch(0, 8, SEQ)
                m(_rows(x, rank, ws), _rows(y, rank, ws)).backward()
        finally:
            collectives._all_gather_uneven = real
        counted = sum(u.stats.all_gather_bytes for u in units) - before
        out.append((meter.all_gather_bytes, counted, meter.counts["all_gather"]))
    return out


@pytest.mark.multiprocess
def test_collective_meter_counts_uneven_fp8_all_gathers_through_any_wrapper():
    """The meter (the trainer's log line and ``--metrics``, the benchmarks) counts an uneven
    all-gather's output, a tuple of per-rank views when it is called through a wrapper taking
    ``*args`` (``benchmarks/fp8.py``'s fake-group stand-in crashed the meter there), as the
    units' own counters do."""
    for ways in run_gloo(_uneven_fp8_metered, 4):
        assert ways[0] == ways[1]
        metered, counted, gathers = ways[0]
        assert metered == counted > 0 and gathers > 0


def _all_to_alls_metered(rank: int, ws: int) -> list[tuple[dict, dict]]:
    """An all-to-all of 8 floats and a gloo sum reduce-scatter of 8 floats (which the runtime
    runs as an all-to-all), under the meter without and with ``all_to_all=True``."""
    import torch.distributed as dist

    from ragged_placement._compat import reduce_scatter_single
    from ragged_placement._gloo import sums_by_all_to_all
    from ragged_placement.testing.profiling import CollectiveMeter

    assert sums_by_all_to_all(dist.ReduceOp.SUM, None)  # the reduce-scatter is an all-to-all
    out = []
    for all_to_all in (False, True):
        with CollectiveMeter(all_to_all=all_to_all) as meter:
            dist.all_to_all_single(torch.empty(8), torch.ones(8))
            reduce_scatter_single(torch.empty(4), torch.ones(8))
        out.append((dict(meter.counts), {k: v for k, v in meter.by_group.items()}))
    return out


@pytest.mark.multiprocess
def test_collective_meter_counts_all_to_alls_outside_other_collectives():
    """``all_to_all=True`` (benchmarks/moe.py: expert parallelism's dispatch) counts an
    all-to-all at its input's size, and the all-to-all by which gloo's reduce-scatter runs stays
    that reduce-scatter, counted once; by default all-to-alls are not counted."""
    for plain, counted in run_gloo(_all_to_alls_metered, 2):
        assert plain[0] == {"reduce_scatter": 1, "reduce_scatter_bytes": 32}
        assert counted[0] == {**plain[0], "all_to_all": 1, "all_to_all_bytes": 32}
        assert counted[1][("all_to_all", (0, 1))] == [1, 32, 16]
