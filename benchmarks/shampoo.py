"""Distributed Shampoo: ours on B-row RaggedShard parameters vs the gather-everything step (gloo, CPU).

Parameter set: the four block matrices of ``gpt2-124m`` (qkv ``[3h, h]``, attention proj
``[h, h]``, MLP fc ``[4h, h]``, MLP proj ``[h, 4h]``) for ``--layers`` blocks, from
``ragged_placement/planner/models.json``. Both methods run the same blocked Shampoo (``B = --block``, Adam
grafting, roots every ``--frequency`` steps) on the same global gradients:

* ``ours``: :class:`ragged_placement.optim.Shampoo` on ``RaggedShard`` DTensors whose runs are
  whole ``B``-row bands (what the planner's ``rows(B)`` granularity gives): each rank keeps the
  statistics of its own row slabs only, and a step issues no collective.
* ``gather-everything``: parameters ``Shard(0)`` as FSDP2 holds them; every rank all-gathers
  every gradient into the full matrix, steps the single-device Shampoo on all of it (full
  statistics on every rank) and keeps its rows: what stepping on ``full_tensor()`` does.

Reported: collectives per step (``CommDebugMode``), bytes each rank sends per step summed over
ranks, optimizer state bytes per rank (max), the step time (slowest rank per step, steps start at
a barrier; median over steps, then over ``--runs`` alternating runs), and the largest difference
between the two methods' parameters after the last step.

Run: ``.venv/bin/python benchmarks/shampoo.py`` (``--help`` for the knobs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from ragged_placement import RaggedShard
from ragged_placement._compat import all_gather_single
from ragged_placement.testing.launch import run_gloo
from ragged_placement.optim import Shampoo
from ragged_placement.planner.models import load_configs

from _gpt_shapes import MODELS_JSON, block_matrices  # benchmarks/ is the script directory

def band_placement(rows: int, block: int, ws: int, rotate: int) -> RaggedShard:
    """Whole ``block``-row bands, as even as bands allow, the remainder rotated across matrices."""
    bands = -(-rows // block)
    units = [bands // ws + (1 if (r - rotate) % ws < bands % ws else 0) for r in range(ws)]
    if rows % block:  # the last band is short: units are rows
        units = [u * block for u in units]
        last = max(r for r in range(ws) if units[r])
        units[last] -= bands * block - rows
    return RaggedShard((0,), tuple(units))


def gradient(step: int, index: int, shape: tuple[int, int]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1_000_003 * step + index)
    return torch.randn(shape, generator=gen)


def state_bytes(opt: torch.optim.Optimizer) -> int:
    total = 0
    stack = list(opt.state.values())
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif torch.is_tensor(x):
            t = x._local_tensor if isinstance(x, DTensor) else x
            total += t.numel() * t.element_size()
    return total


def _run(method: str, rank: int, ws: int, args, shapes) -> dict:
    mesh = init_device_mesh("cpu", (ws,))
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    opts = dict(lr=1e-3, max_preconditioner_dim=args.block, precondition_frequency=args.frequency)
    if method == "ours":
        params = [
            torch.nn.Parameter(distribute_tensor(w, mesh, [band_placement(s[0], args.block, ws, i)]))
            for i, (w, s) in enumerate(zip(full, shapes))
        ]
        opt = Shampoo(params, **opts)
    else:
        params = [torch.nn.Parameter(distribute_tensor(w, mesh, [Shard(0)])) for w in full]
        replicas = [torch.nn.Parameter(w.clone()) for w in full]  # every rank: all of it
        opt = Shampoo(replicas, **opts)
    times, calls, sent = [], 0, 0
    for step in range(args.steps + 1):
        grads = [gradient(step, i, s) for i, s in enumerate(shapes)]
        dist.barrier()
        t0 = time.perf_counter()
        step_sent = 0
        with CommDebugMode() as comm:
            if method == "ours":
                for p, g in zip(params, grads):  # each rank's own rows: no communication
                    local = p.placements[0].shard_local(g, rank)
                    p.grad = DTensor.from_local(local, mesh, p.placements, shape=g.shape, stride=g.stride())
                opt.step()
            else:
                for p, r, g in zip(params, replicas, grads):
                    local = g.tensor_split(ws)[rank].contiguous()  # this rank's Shard(0) gradient
                    gathered = torch.empty(local.numel() * ws)
                    all_gather_single(gathered, local.reshape(-1))
                    step_sent += local.numel() * local.element_size() * (ws - 1)
                    r.grad = gathered.view(g.shape)  # even Shard(0) chunks, in rank order
                opt.step()
                with torch.no_grad():
                    for p, r in zip(params, replicas):
                        p._local_tensor.copy_(r.tensor_split(ws)[rank])
        dist.barrier()
        if step:  # the first step builds state and plans owners
            times.append(time.perf_counter() - t0)
            calls += comm.get_total_counts()
            sent += step_sent
    out = torch.cat([p.full_tensor().reshape(-1) for p in params])
    return {
        "time": statistics.median(times),
        "calls": calls / args.steps,
        "sent": sent / args.steps,
        "state": state_bytes(opt),
        "final": out if rank == 0 else None,
    }


def _worker(rank: int, ws: int, args, shapes: list[tuple[int, int]]) -> dict:
    torch.set_num_threads(1)
    results: dict[str, list[dict]] = {"gather-everything": [], "ours": []}
    for _ in range(args.runs):
        for method in results:
            results[method].append(_run(method, rank, ws, args, shapes))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--model", default="gpt2-124m")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--block", type=int, default=256, help="Shampoo block size B")
    ap.add_argument("--frequency", type=int, default=2, help="steps between inverse roots")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    shapes = block_matrices(load_configs(MODELS_JSON)[args.model], args.layers)
    if any(s[0] % args.world for s in shapes):
        raise ValueError(
            f"--world {args.world} must divide every matrix's rows {sorted({s[0] for s in shapes})}"
        )
    per_rank = run_gloo(_worker, args.world, args, shapes)
    mib = 2.0**20
    naive, ours = "gather-everything", "ours"

    def agg(method: str, key: str, how):
        return how(r[key] for rank in per_rank for r in rank[method])

    rows = [
        ("collectives / step", "calls", max, lambda v: f"{v:.0f}"),
        ("bytes sent / step (all ranks)", "sent", sum, lambda v: f"{v / mib / args.runs:.2f} MiB"),
        ("optimizer state / rank (max)", "state", max, lambda v: f"{v / mib:.2f} MiB"),
    ]
    print(
        f"\nShampoo on {args.layers} {args.model} blocks ({4 * args.layers} matrices), B={args.block}, "
        f"roots every {args.frequency} steps, {args.world} gloo ranks, torch {torch.__version__}, "
        f"{args.runs} runs x {args.steps} steps\n"
    )
    print(f"{'metric':32s} {naive:>18s} {ours:>12s} {'ours/naive':>11s}")
    print("-" * 76)
    for label, key, how, fmt in rows:
        a, b = agg(naive, key, how), agg(ours, key, how)
        ratio = f"{b / a:11.3f}" if a else f"{'-':>11s}"
        print(f"{label:32s} {fmt(a):>18s} {fmt(b):>12s} {ratio}")
    t_naive = statistics.median(r["time"] for r in per_rank[0][naive])
    t_ours = statistics.median(r["time"] for r in per_rank[0][ours])
    print(f"{'step time (median)':32s} {t_naive * 1e3:15.1f} ms {t_ours * 1e3:9.1f} ms {t_ours / t_naive:11.3f}")
    diff = max(
        (a["final"] - b["final"]).abs().max().item()
        for a, b in zip(per_rank[0][naive], per_rank[0][ours])
    )
    print(f"\nmax |ours - gather-everything| over all parameters after {args.steps + 1} steps: {diff:.2e}")


if __name__ == "__main__":
    sys.exit(main())
