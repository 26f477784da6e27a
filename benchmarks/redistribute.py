"""RaggedShard redistribution and matmul vs the matching Shard path, on 4 gloo ranks; import cost.

For each transform: bytes sent per rank (counted from the collectives actually issued, c10d and
functional, by a dispatch mode) and the median wall time of several runs, for ours and for the
peer in the same run: torch's own ``Shard`` redistribution of the same tensor, and for
RaggedShard <-> RaggedShard / Shard the route through a full replica that veScale takes.

Matmul: ``x @ w`` with ``x`` row-sharded (RaggedShard, even and uneven units) and ``w``
replicated, against ``x`` on ``Shard(0)``: the forward alone, and forward + backward with the
weight gradient (``Partial``) reduced to ``Replicate`` as an optimizer would need it.

Import cost: ``import ragged_placement`` after ``import torch.distributed.tensor``, in fresh
processes (median of 5), next to the cost of ``import torch.distributed.tensor`` itself.

    python benchmarks/redistribute.py [--rows 8192] [--cols 512] [--runs 7]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from ragged_placement import RaggedShard
from ragged_placement.testing.launch import run_gloo

warnings.filterwarnings("ignore", category=FutureWarning)


class SentBytes(TorchDispatchMode):
    """Bytes this rank sends in the collectives issued inside the block (ring algorithms:
    all-gather ``(n-1) x input``, reduce-scatter ``(n-1)/n x input``, all-to-all ``input minus
    the part kept``, all-reduce ``2 (n-1)/n x input``)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ns, name = func.namespace, func._overloadpacket.__name__
        if ns not in ("c10d", "_c10d_functional"):
            return out
        nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
        if ns == "c10d":
            if name in ("_allgather_base_", "alltoall_base_", "_reduce_scatter_base_", "allreduce_"):
                self.calls += 1
                pg = dist.ProcessGroup.unbox(args[2])
                n = pg.size()
                rank = pg.rank()
                if name == "_allgather_base_":
                    self.bytes += nbytes(args[1]) * (n - 1)
                elif name == "_reduce_scatter_base_":
                    self.bytes += nbytes(args[1]) * (n - 1) // n
                elif name == "alltoall_base_":
                    splits = args[4] or [args[1].numel() // n] * n
                    per = args[1].element_size() * (args[1].numel() // max(sum(splits), 1))
                    self.bytes += (sum(splits) - splits[rank]) * per
                else:
                    self.bytes += sum(nbytes(t) for t in args[0]) * 2 * (n - 1) // n
        elif name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "all_reduce"):
            self.calls += 1
            group = dist.distributed_c10d._resolve_process_group(args[-1])
            n, rank = group.size(), group.rank()
            if name == "all_gather_into_tensor":
                self.bytes += nbytes(args[0]) * (n - 1)
            elif name == "reduce_scatter_tensor":
                self.bytes += nbytes(args[0]) * (n - 1) // n
            elif name == "all_to_all_single":
                in_splits = args[2]
                per = args[0].element_size() * (args[0].numel() // max(sum(in_splits), 1))
                self.bytes += (sum(in_splits) - in_splits[rank]) * per
            else:
                self.bytes += nbytes(args[0]) * 2 * (n - 1) // n
        return out


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _measure_pair(fn, peer_fn, runs: int) -> tuple[tuple[int, int, float], tuple[int, int, float]]:
    """Counts from one metered call each, then medians of ``runs`` timed calls, ours and the
    peer's alternating so that both see the same machine noise (after two warm-up calls each)."""
    counts = []
    for f in (fn, peer_fn):
        with SentBytes() as meter:
            f()
        f()
        counts.append((meter.bytes, meter.calls))
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(runs):
        times[0].append(_timed(fn))
        times[1].append(_timed(peer_fn))
    return tuple((*c, statistics.median(t) * 1e3) for c, t in zip(counts, times))  # type: ignore[return-value]


def _worker(rank: int, world: int, rows: int, cols: int, runs: int) -> list[tuple]:
    mesh = init_device_mesh("cpu", (world,))
    t = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
    uneven = RaggedShard((0,), (3, 1, 2, 2))
    rebalanced = RaggedShard((0,), (1, 3, 2, 2))
    rs = distribute_tensor(t, mesh, [uneven])
    sh = distribute_tensor(t, mesh, [Shard(0)])
    rep = distribute_tensor(t, mesh, [Replicate()])
    par = distribute_tensor(t, mesh, [Partial()])

    def via_replica(src, dst):
        return lambda: src.redistribute(mesh, [Replicate()]).redistribute(mesh, dst)

    even = distribute_tensor(t, mesh, [RaggedShard((0,), (1, 1, 1, 1))])
    cases = [
        ("RS even -> Replicate", lambda: even.redistribute(mesh, [Replicate()]),
         "Shard(0) -> Replicate", lambda: sh.redistribute(mesh, [Replicate()])),
        ("RS -> Replicate", lambda: rs.redistribute(mesh, [Replicate()]),
         "Shard(0) -> Replicate", lambda: sh.redistribute(mesh, [Replicate()])),
        ("Partial -> RS even", lambda: par.redistribute(mesh, [RaggedShard((0,), (1, 1, 1, 1))]),
         "Partial -> Shard(0)", lambda: par.redistribute(mesh, [Shard(0)])),
        ("Partial -> RS", lambda: par.redistribute(mesh, [uneven]),
         "Partial -> Shard(0)", lambda: par.redistribute(mesh, [Shard(0)])),
        ("Replicate -> RS", lambda: rep.redistribute(mesh, [uneven]),
         "Replicate -> Shard(0)", lambda: rep.redistribute(mesh, [Shard(0)])),
        ("RS -> RS (rebalance)", lambda: rs.redistribute(mesh, [rebalanced]),
         "via full replica", via_replica(rs, [rebalanced])),
        ("RS -> Shard(0)", lambda: rs.redistribute(mesh, [Shard(0)]),
         "via full replica", via_replica(rs, [Shard(0)])),
        ("RS -> Shard(1)", lambda: rs.redistribute(mesh, [Shard(1)]),
         "Shard(0) -> Shard(1)", lambda: sh.redistribute(mesh, [Shard(1)])),
    ]
    cases += _matmul_cases(mesh, t, cols)
    rows_out = []
    for name, fn, peer_name, peer_fn in cases:
        ours, peer = _measure_pair(fn, peer_fn, runs)
        rows_out.append((name, *ours, peer_name, *peer))
    return rows_out


def _matmul_cases(mesh, t: torch.Tensor, cols: int) -> list[tuple]:
    """``x @ w`` (forward; forward + backward with w's gradient all-reduced), RaggedShard rows vs
    Shard(0) rows, ``w`` a replicated ``[cols, cols]`` matrix."""
    g = torch.Generator().manual_seed(1)
    w_full = torch.randn(cols, cols, generator=g) / cols**0.5
    grad_full = torch.randn(t.shape[0], cols, generator=g)

    def make(placement):
        x = distribute_tensor(t, mesh, [placement]).requires_grad_()
        w = distribute_tensor(w_full, mesh, [Replicate()]).requires_grad_()
        grad = distribute_tensor(grad_full, mesh, [placement])

        def forward():
            with torch.no_grad():
                return x @ w

        def train_step():
            x.grad = w.grad = None
            (x @ w).backward(grad)
            return w.grad.full_tensor()

        return forward, train_step

    even, uneven, shard = (make(p) for p in (RaggedShard((0,), (1, 1, 1, 1)), RaggedShard((0,), (3, 1, 2, 2)),
                                              Shard(0)))
    return [
        ("mm fwd: RS even x R", even[0], "Shard(0) x R", shard[0]),
        ("mm fwd: RS x R", uneven[0], "Shard(0) x R", shard[0]),
        ("mm fwd+bwd: RS even", even[1], "Shard(0)", shard[1]),
        ("mm fwd+bwd: RS", uneven[1], "Shard(0)", shard[1]),
    ]


def import_cost(runs: int = 5) -> tuple[float, float]:
    """Median seconds over ``runs`` fresh processes: ``import ragged_placement`` after
    ``import torch.distributed.tensor``, and ``import torch.distributed.tensor`` itself."""
    code = ("import time; t0 = time.perf_counter(); import torch.distributed.tensor; "
            "t1 = time.perf_counter(); import ragged_placement; t2 = time.perf_counter(); print(t2 - t1, t1 - t0)")
    ours, base = [], []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
        a, b = map(float, out.split())
        ours.append(a)
        base.append(b)
    return statistics.median(ours), statistics.median(base)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--cols", type=int, default=512)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--import-runs", type=int, default=5,
                    help="fresh processes timing the package's import (median)")
    args = ap.parse_args()
    if args.import_runs < 1:
        ap.error(f"--import-runs must be >= 1, got {args.import_runs}")
    rows = run_gloo(_worker, 4, args.rows, args.cols, args.runs)[0]
    mib = 1 << 20
    print(f"4 gloo ranks, fp32 [{args.rows}, {args.cols}] ({args.rows * args.cols * 4 / mib:.0f} MiB), "
          f"RS = RaggedShard((0,), (3, 1, 2, 2)); median of {args.runs} alternating runs after warm-up; "
          f"MiB/rank = bytes each rank sends")
    header = (f"{'ours':<22}{'MiB/rank':>9}{'colls':>6}{'ms':>8}   {'peer':<22}{'MiB/rank':>9}{'colls':>6}"
              f"{'ms':>8}{'bytes x':>9}{'time x':>8}")
    print(header)
    print("-" * len(header))
    for name, b, c, ms, pname, pb, pc, pms in rows:
        ratio_b = f"{b / pb:.2f}" if pb else ("-" if not b else "inf")
        print(f"{name:<22}{b / mib:>9.2f}{c:>6}{ms:>8.2f}   {pname:<22}{pb / mib:>9.2f}{pc:>6}{pms:>8.2f}"
              f"{ratio_b:>9}{ms / pms:>8.2f}")
    print(f"mm: x [{args.rows}, {args.cols}] @ w [{args.cols}, {args.cols}] replicated; fwd+bwd reduces w.grad "
          f"(Partial) to Replicate")
    ours, base = import_cost(args.import_runs)
    print(f"import ragged_placement after torch.distributed.tensor: {ours * 1e3:.0f} ms "
          f"(torch.distributed.tensor itself: {base * 1e3:.0f} ms; median of {args.import_runs} "
          f"fresh processes)")


if __name__ == "__main__":
    main()
