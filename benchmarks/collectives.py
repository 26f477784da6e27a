"""How gloo runs a unit of several segments: coalesced, separate, or packed into one collective.

A unit's plan can hold several segments (a GPT block: 3). NCCL runs them coalesced as one group
call without copies; gloo runs a coalesced collective through staging of its own. This measures,
on ``--world`` gloo ranks, one all-gather and one reduce-scatter of a unit's segments (default:
the GPT 4x128 block's, ``--sizes``) issued

* ``single``: as one collective over the whole chunk (the bytes, with no segment structure);
* ``coalesced``: in torch's ``_coalescing_manager`` (zero-copy, what NCCL runs);
* ``separate``: as one async collective per segment, waited together;
* ``packed``: as one collective through a staging buffer with FSDP2's copy ops (what
  :func:`ragged_placement.fsdp.collectives.reduce_scatter_segments` runs on gloo).

Medians of ``--reps`` alternating repetitions, each between barriers; ratios to ``single``.
A reduce-scatter outside a coalescing manager runs as the runtime runs it on gloo, one
all-to-all and a local sum (``_compat.reduce_scatter_single``; gloo's own against it:
``benchmarks/gloo_reduce_scatter.py``); ``coalesced`` is gloo's own coalesced reduce-scatter.

``--fp8``: the FP8 all-gather of one unit (a GPT block of width ``--fp8-width``, 128x128
blocks, on uneven per-rank chunks) as the padded equal all-gather of its FP8 sends (every rank
padded to the largest: one ``all_gather_into_tensor``) against the uneven one the runtime runs
where padding exceeds 1% (no padding; on gloo one broadcast per rank), same plan, same bytes
packed; the gathered FP8 weights are checked equal.

Run: ``.venv/bin/python benchmarks/collectives.py [--world 4] [--fp8]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from ragged_placement.planner import plan_segmented
from ragged_placement.planner.plan import Segment

from ragged_placement import _compat
from ragged_placement.fsdp import collectives
from ragged_placement.fsdp.fp8 import fp8_granularity
from ragged_placement.testing.launch import run_gloo
from ragged_placement.models import Block, GPTConfig
from ragged_placement.quant import FlatParam, FP8GatherLayout


def _packed_all_gather(out: torch.Tensor, chunk: torch.Tensor, sizes: list[int], ws: int) -> None:
    """One all-gather into a staging buffer, then FSDP2's copy-out into the segments' places."""
    staging = chunk.new_empty(ws, sum(sizes))
    _compat.all_gather_single(staging.view(-1), chunk)
    outs, offset = [], 0
    for c in sizes:
        outs.append(out[offset:offset + ws * c].view(ws, c))
        offset += ws * c
    torch.split_with_sizes_copy(staging, sizes, dim=1, out=outs)


def _variants(sizes: list[int], ws: int) -> dict[str, dict]:
    total = sum(sizes)
    segments = [Segment(sum(sizes[:k]), ws * sum(sizes[:k]), c) for k, c in enumerate(sizes)]
    out, chunk = torch.empty(ws * total), torch.randn(total)
    grads = [torch.randn(ws * c) for c in sizes]
    full, reduced = torch.randn(ws * total), torch.empty(total)

    def coalesced(call):
        with dist._coalescing_manager(async_ops=True) as cm:
            for k, s in enumerate(segments):
                call(k, s)
        cm.wait()

    def separate(call):
        for w in [call(k, s) for k, s in enumerate(segments)]:
            w.wait()

    def ag(k, s):
        return _compat.all_gather_single(
            out[s.buffer_offset:s.buffer_offset + ws * s.chunk_numel],
            chunk[s.chunk_offset:s.chunk_offset + s.chunk_numel], async_op=True)

    def rs(k, s):
        return _compat.reduce_scatter_single(
            reduced[s.chunk_offset:s.chunk_offset + s.chunk_numel], grads[k], async_op=True)

    return {
        "all-gather": {
            "single": lambda: _compat.all_gather_single(out, chunk),
            "coalesced": lambda: coalesced(ag),
            "separate": lambda: separate(ag),
            "packed": lambda: _packed_all_gather(out, chunk, sizes, ws),
        },
        "reduce-scatter": {
            "single": lambda: _compat.reduce_scatter_single(reduced, full),
            "coalesced": lambda: coalesced(rs),
            "separate": lambda: separate(rs),
            "packed": lambda: collectives.reduce_scatter_segments(reduced, grads, segments, ws),
        },
    }


def _worker(rank: int, ws: int, sizes: list[int], reps: int) -> dict:
    torch.set_num_threads(1)
    variants = _variants(sizes, ws)
    times = {(c, v): [] for c, vs in variants.items() for v in vs}
    for _ in range(reps):
        for c, vs in variants.items():
            for v, fn in vs.items():
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                dist.barrier()
                times[(c, v)].append(time.perf_counter() - t0)
    return {k: statistics.median(t) for k, t in times.items()}


def _fp8_layouts(width: int, ws: int) -> tuple[object, list[FP8GatherLayout]]:
    """The plan of a GPT block of ``width`` as ``fully_shard(quant=...)`` makes it, and its FP8
    gather layout with equal (padded) and uneven sends."""
    with torch.device("meta"):
        block = Block(GPTConfig(n_layer=1, n_embd=width, n_head=4, block_size=64))
    shapes = [(n, tuple(p.shape)) for n, p in block.named_parameters()]
    fp8 = {n: len(s) == 2 for n, s in shapes}
    policy = fp8_granularity(None, {n: s for n, s in shapes if fp8[n]}, (128, 128))
    plan = plan_segmented(shapes, ws, granularity=policy, dtype=torch.float32, uneven=True)
    params = [FlatParam(n, plan.shapes[n], plan.offsets[n], fp8[n]) for n in plan.names]
    return plan, [
        FP8GatherLayout(params, plan.chunk_numel, ws, rank_starts=plan.segments[0].rank_starts,
                        equal=equal)
        for equal in (True, False)
    ]


def _fp8_worker(rank: int, ws: int, width: int, reps: int) -> dict:
    torch.set_num_threads(1)
    plan, layouts = _fp8_layouts(width, ws)
    full = torch.randn(plan.buffer_numel, generator=torch.Generator().manual_seed(0))
    lo, hi = plan.segments[0].rank_range(rank)
    chunk = torch.zeros(plan.chunk_numel)
    chunk[:hi - lo] = full[lo:hi]
    runs, gathered = {}, {}
    for name, layout in zip(("equal (padded)", "uneven"), layouts):
        send = layout.pack(rank, chunk, kernel="torch")
        out = torch.empty(layout.gathered_nbytes, dtype=torch.uint8)
        seg = Segment(0, 0, layout.send_nbytes, layout.send_starts if layout.uneven else None)
        runs[name] = lambda out=out, send=send, seg=seg: collectives.all_gather_segments(
            out, send, [seg], ws)
        gathered[name] = (layout, out)
    times = {name: [] for name in runs}
    for _ in range(reps):
        for name, fn in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    same = [
        [t if isinstance(t, torch.Tensor) else t[0].view(torch.uint8) for t in lay.unpack(out)]
        for lay, out in gathered.values()
    ]
    assert all(torch.equal(a, b) for a, b in zip(*same))
    return {
        name: (statistics.median(t), gathered[name][0].gathered_nbytes, gathered[name][0].uneven)
        for name, t in times.items()
    }


def _fp8_table(ws: int, width: int, reps: int) -> None:
    res = run_gloo(_fp8_worker, ws, width, reps)[0]
    plan = _fp8_layouts(width, ws)[0]
    print(f"\nFP8 all-gather of a GPT block (width {width}, {type(plan).__name__}) on {ws} gloo "
          f"ranks, median of {reps}, torch {torch.__version__}\n")
    print(f"{'gather':16s}{'calls':>8s}{'bytes':>12s}{'time':>11s}{'/ equal':>9s}")
    print("-" * 56)
    base = res["equal (padded)"][0]
    for name, (t, nbytes, uneven) in res.items():
        calls = f"{ws} bc" if uneven else "1 ag"
        print(f"{name:16s}{calls:>8s}{nbytes:>12,}{t * 1e3:8.2f} ms{t / base:9.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--sizes", type=int, nargs="+", default=[416, 32768, 16384],
                    help="per-rank elements of each segment (fp32)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--fp8", action="store_true", help="the FP8 gather: equal vs uneven")
    ap.add_argument("--fp8-width", type=int, default=384)
    args = ap.parse_args()
    if args.fp8:
        _fp8_table(args.world, args.fp8_width, args.reps)
        return
    res = run_gloo(_worker, args.world, args.sizes, args.reps)[0]
    print(f"\n{len(args.sizes)} segments {args.sizes} (fp32 elements per rank) on {args.world} "
          f"gloo "
          f"ranks, median of {args.reps}, torch {torch.__version__}\n")
    print(f"{'collective':16s}{'variant':12s}{'time':>10s}{'/ single':>10s}")
    print("-" * 48)
    for (c, v), t in res.items():
        print(f"{c:16s}{v:12s}{t * 1e3:8.2f} ms{t / res[(c, 'single')]:10.2f}")


if __name__ == "__main__":
    main()
