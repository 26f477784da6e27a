"""Distributed Muon: ours vs the naive all-gather-everything step vs a PyPI peer (gloo, CPU).

GPT-shaped parameter set: the four block matrices of ``gpt2-124m`` (qkv ``[3h, h]``, attention
proj ``[h, h]``, MLP fc ``[4h, h]``, MLP proj ``[h, 4h]``; ``h = 768``) for ``--layers`` blocks,
read from ``ragged_placement/planner/models.json``. Spawns ``--world`` gloo ranks (one torch thread each) and runs
the same momentum + bf16 Newton-Schulz step four ways:

* ``ours``: :class:`ragged_placement.optim.Muon`, parameters ``Shard(0)``: owners by NS FLOPs,
  one bf16 ``all_to_all_single`` each way.
* ``naive``: every rank all-gathers every momentum-updated fp32 matrix (what ``full_tensor()``
  does for ``Shard(0)``), every rank runs every NS, keeps its rows.
* ``muon-fsdp2``: the PyPI package ``muon-fsdp2`` (per-matrix ``gather`` to rank ``i % world``,
  NS, ``scatter``, fp32). Its ``torch.compile``'d NS loop is replaced by the same eager loop
  (compiling on CPU would time the compiler); skipped with a note if it is not installed.
* ``ours, whole``: ours with each matrix whole on one rank (``RaggedShard`` with all units on
  the rank the FLOP planner picks), as the planner's ``matrix`` granularity gives.

Reported per method: bytes each rank put on the wire per step, summed over ranks (all-to-all:
the input minus the self split; all-gather: input x (world - 1); gather/scatter: the non-root
inputs / root chunks), collectives per step, NS FLOPs max / mean over ranks, and the step time:
per step the slowest rank (steps start at a barrier), median over ``--steps`` timed steps (after
one warm-up), median (min-max) over ``--runs`` runs that alternate the methods. The owner plan
for the full 12-layer model (the real planner code, no NS run) is printed too: FLOP balance and
bytes.

Run: ``.venv/bin/python benchmarks/optim.py`` (``--help`` for the knobs).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch
import torch.distributed as dist

from ragged_placement import RaggedShard
from ragged_placement._compat import all_gather_single
from ragged_placement.testing.launch import run_gloo
from ragged_placement.optim import Muon, newton_schulz, newton_schulz_flops
from ragged_placement.optim._sharding import Exchange, Item, Layout, assign_owners
from ragged_placement.planner.models import load_configs

from _gpt_shapes import MODELS_JSON, block_matrices  # benchmarks/ is the script directory

def plan_stats(shapes: list[tuple[int, int]], ws: int, whole: bool) -> tuple[float, int]:
    """FLOP max/mean and bytes per step (bf16, both ways, all ranks) of our owner plan."""
    items = [Item(i, 0, s, newton_schulz_flops(*s)) for i, s in enumerate(shapes)]
    if whole:
        owners, _ = assign_owners(items, [_even_layout(s, ws) for s in shapes])
        layouts = [_one_rank_layout(s, ws, o) for s, o in zip(shapes, owners)]
    else:
        layouts = [_even_layout(s, ws) for s in shapes]
    owners, loads = assign_owners(items, layouts)
    traffic = Exchange(items, owners, layouts, None, 0, torch.bfloat16, torch.device("cpu")).traffic
    return max(loads) / (sum(loads) / ws), 2 * 2 * traffic


def _even_layout(shape, ws: int) -> Layout:
    rows, cols = shape
    chunk = -(-rows // ws)
    return Layout(
        shape,
        None,
        0,
        tuple((min(r * chunk, rows) * cols, min((r + 1) * chunk, rows) * cols) for r in range(ws)),
    )


def _one_rank_layout(shape, ws: int, owner: int) -> Layout:
    n = math.prod(shape)
    return Layout(
        shape,
        None,
        0,
        tuple((0, n) if r == owner else ((0, 0) if r < owner else (n, n)) for r in range(ws)),
    )


class _Wire:
    """Counts collectives and the bytes this rank sends, by wrapping the c10d entry points."""

    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0
        self._saved = []

    def install(self, peer_module) -> None:
        import ragged_placement._compat as compat
        import ragged_placement.optim._sharding as sharding

        ws = dist.get_world_size()

        def a2a(out, inp, out_splits=None, in_splits=None, **kw):
            self.calls += 1
            me = dist.get_rank()
            self.bytes += (
                inp.numel() - (in_splits[me] if in_splits else inp.numel() // ws)
            ) * inp.element_size()
            return self._orig_a2a(out, inp, out_splits, in_splits, **kw)

        def ag(out, inp, **kw):
            self.calls += 1
            self.bytes += inp.numel() * inp.element_size() * (ws - 1)
            return self._orig_ag(out, inp, **kw)

        def gather(tensor, gather_list=None, **kw):
            self.calls += 1
            if gather_list is None:
                self.bytes += tensor.numel() * tensor.element_size()
            return self._orig_gather(tensor, gather_list, **kw)

        def scatter(tensor, scatter_list=None, **kw):
            self.calls += 1
            if scatter_list is not None:
                self.bytes += (
                    sum(t.numel() * t.element_size() for t in scatter_list) * (ws - 1) // ws
                )
            return self._orig_scatter(tensor, scatter_list, **kw)

        self._orig_a2a, self._orig_ag = dist.all_to_all_single, compat.all_gather_single
        sharding.dist.all_to_all_single = a2a
        globals()["all_gather_single"] = ag
        if peer_module is not None:
            self._orig_gather, self._orig_scatter = peer_module.gather, peer_module.scatter
            peer_module.gather, peer_module.scatter = gather, scatter

    def reset(self) -> None:
        self.calls = self.bytes = 0


class NaiveMuon:
    """Every rank all-gathers every fp32 momentum-updated matrix and runs every NS."""

    def __init__(self, params, lr: float, momentum: float = 0.95) -> None:
        self.params, self.lr, self.momentum = params, lr, momentum
        self.bufs = [torch.zeros_like(p._local_tensor) for p in params]
        self.flops = sum(newton_schulz_flops(*p.shape) for p in params)

    @torch.no_grad()
    def step(self) -> None:
        ws, rank = dist.get_world_size(), dist.get_rank()
        for p, buf in zip(self.params, self.bufs):
            g = p.grad._local_tensor
            buf.lerp_(g, 1 - self.momentum)
            update = g.lerp(buf, self.momentum)
            full = update.new_empty(p.shape)
            all_gather_single(full, update.contiguous())
            ortho = newton_schulz(full)
            rows, cols = p.shape
            p._local_tensor.add_(ortho.chunk(ws)[rank], alpha=-self.lr * max(1, rows / cols) ** 0.5)


def _eager_nsloop(X, steps: int, *, a=3.4445, b=-4.7750, c=2.0315):
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    return X


def _worker(rank: int, ws: int, args, shapes) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    try:
        import muon_fsdp2

        muon_fsdp2.nsloop_torch = _eager_nsloop
    except ImportError:
        muon_fsdp2 = None
    mesh = init_device_mesh("cpu", (ws,))
    wire = _Wire()
    wire.install(muon_fsdp2)
    gen = torch.Generator().manual_seed(0)
    fulls = [0.02 * torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    items = [Item(i, 0, s, newton_schulz_flops(*s)) for i, s in enumerate(shapes)]
    whole_owner, _ = assign_owners(items, [_even_layout(s, ws) for s in shapes])

    def params(kind: str):
        out = []
        for i, (full, g) in enumerate(zip(fulls, grads)):
            if kind == "whole":
                pl = RaggedShard((0,), tuple(int(r == whole_owner[i]) for r in range(ws)))
                local, glocal = pl.shard_local(full, rank).clone(), pl.shard_local(g, rank).clone()
            else:
                pl = Shard(0)
                local, glocal = full.chunk(ws)[rank].clone(), g.chunk(ws)[rank].clone()
            p = torch.nn.Parameter(
                DTensor.from_local(
                    local, mesh, [pl], shape=full.shape, stride=full.stride(), run_check=False
                )
            )
            p.grad = DTensor.from_local(
                glocal, mesh, [pl], shape=full.shape, stride=full.stride(), run_check=False
            )
            out.append(p)
        return out

    methods = {
        "ours": lambda: (Muon(ps := params("even"), lr=0.02), ps),
        "naive": lambda: (NaiveMuon(ps := params("even"), lr=0.02), ps),
        "ours, whole": lambda: (Muon(ps := params("whole"), lr=0.02), ps),
    }
    if muon_fsdp2 is not None:
        methods["muon-fsdp2"] = lambda: (
            muon_fsdp2.Muon(
                [dict(params=(ps := params("even")), use_muon=True, lr=0.02, rms_scale=False)]
            ),
            ps,
        )
    results: dict = {name: None for name in args.methods}
    for _ in range(args.runs):  # runs alternate the methods, so slow phases of the machine spread
        for name in args.methods:
            if name not in methods:
                continue
            opt, ps = methods[name]()
            grads_local = [p.grad for p in ps]
            times = []
            for step in range(1 + args.steps):
                for p, g in zip(ps, grads_local):
                    p.grad = g  # muon-fsdp2 overwrites .grad with its momentum update
                wire.reset()
                dist.barrier()
                t0 = time.perf_counter()
                opt.step()
                if step:
                    times.append(time.perf_counter() - t0)
            info = opt.last_step_info if isinstance(opt, Muon) else None
            entry = results[name] or {"times": []}
            entry["times"].append(times)
            entry["bytes"], entry["calls"] = wire.bytes, wire.calls
            entry["flops"] = (
                max(info.flops_per_rank) / (sum(info.flops_per_rank) / ws) if info else None
            )
            results[name] = entry
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument(
        "--layers", type=int, default=1, help="blocks timed (the 12-layer plan is always printed)"
    )
    ap.add_argument("--steps", type=int, default=3, help="timed steps per method (after 1 warm-up)")
    ap.add_argument("--runs", type=int, default=3, help="alternating runs of all methods")
    ap.add_argument("--model", default="gpt2-124m")
    ap.add_argument("--models-json", default=MODELS_JSON)
    ap.add_argument("--methods", nargs="+", default=["ours", "naive", "muon-fsdp2", "ours, whole"])
    args = ap.parse_args()
    ws = args.world
    config = load_configs(args.models_json)[args.model]
    full_layers = config["layers"]
    shapes = block_matrices(config, args.layers)
    numel = sum(math.prod(s) for s in shapes)

    print(f"# owner plan, {args.model}, all {full_layers} layers, {ws} ranks (planner code, no NS)")
    all_shapes = block_matrices(config, full_layers)
    all_numel = sum(math.prod(s) for s in all_shapes)
    for label, whole in (("Shard(0)", False), ("whole matrices", True)):
        imbalance, nbytes = plan_stats(all_shapes, ws, whole)
        naive = 4 * all_numel * (ws - 1) // ws * ws
        print(
            f"{label:>16}: NS FLOPs max/mean {imbalance:.3f}, bytes/step {nbytes / 2**20:8.1f} MiB "
            f"(naive fp32 all-gather: {naive / 2**20:.1f} MiB, ratio {nbytes / naive:.3f})"
        )

    print(
        f"\n# timed: {args.layers} layer(s) = {len(shapes)} matrices, {numel / 1e6:.2f} M elements,"
        f" {ws} gloo ranks x 1 thread, median of {args.steps} steps x {args.runs} runs"
    )
    try:
        import muon_fsdp2  # noqa: F401
    except ImportError:
        print("note: muon-fsdp2 is not installed (pip install muon-fsdp2): its row is skipped")
    per_rank = run_gloo(_worker, ws, args, shapes)

    def step_time(name: str) -> tuple[float, float, float]:
        """Median over runs of the median over steps of the slowest rank; min and max over runs."""
        runs = per_rank[0][name]["times"]
        per_run = [
            statistics.median(
                max(r[name]["times"][run][step] for r in per_rank) for step in range(len(steps))
            )
            for run, steps in enumerate(runs)
        ]
        return statistics.median(per_run), min(per_run), max(per_run)

    def wire_bytes(name: str) -> int:
        return sum(r[name]["bytes"] for r in per_rank)

    have_naive = per_rank[0].get("naive") is not None
    print(
        f"{'method':>14} {'bytes/step':>12} {'vs naive':>9} {'coll/step':>10} "
        f"{'FLOPs max/mean':>15} {'step s (min-max)':>18} {'vs naive':>9}"
    )
    for name in args.methods:
        if per_rank[0][name] is None:
            print(f"{name:>14}  (skipped: not installed)")
            continue
        nbytes = wire_bytes(name)
        t, t_min, t_max = step_time(name)
        byte_ratio = nbytes / wire_bytes("naive") if have_naive else float("nan")
        time_ratio = t / step_time("naive")[0] if have_naive else float("nan")
        flops = per_rank[0][name]["flops"]
        flops_s = "-" if flops is None else f"{flops:.3f}"
        print(
            f"{name:>14} {nbytes / 2**20:9.2f} MiB {byte_ratio:9.3f} "
            f"{per_rank[0][name]['calls']:>10} "
            f"{flops_s:>15} {t:6.2f} ({t_min:.2f}-{t_max:.2f}) {time_ratio:9.2f}"
        )
    print(
        f"\ntarget: ours bytes <= 2/world = {2 / ws:.2f} x naive; whole-matrix bytes 0; "
        "FLOPs max/mean <= 1.10"
    )


if __name__ == "__main__":
    sys.exit(main())
