"""gloo's own reduce-scatter against the all-to-all the runtime runs on gloo (and gloo's
all-reduce, for scale).

torch's gloo backend runs ``reduce_scatter_single`` as an all-reduce of the whole input (each
rank sends ``2 (n-1)/n`` of it); ``ragged_placement._compat.reduce_scatter_single`` runs a gloo
sum as one ``all_to_all_single`` and a local sum (``(n-1)/n`` sent, a ring reduce-scatter's
bytes). This times both, fp32, for inputs of ``--mib`` MiB per rank, over each dim of a 2x2
mesh (``inter``: ranks {0, 2} and {1, 3}; ``intra``: {0, 1} and {2, 3}; both groups of a dim at
once, as the runtime runs them) and over all 4 ranks, with an all-reduce of the same input
beside them; medians of ``--reps`` repetitions between barriers, the slowest rank's; the
results are checked equal to rounding. Under torchrun it also prints the TCP retransmission
timeouts its node's network namespace counted meanwhile (``TCPTimeouts`` of
``/proc/net/netstat``): a link that drops packets (``scripts/two_nodes.sh --queue 0.1ms``)
shows there.

Run on one machine (4 gloo processes, loopback)::

    .venv/bin/python benchmarks/gloo_reduce_scatter.py

or on two emulated nodes (ranks 0-1 and 2-3 in two network namespaces over a 1 Gbit/s link;
root), where ``inter`` crosses the link::

    scripts/two_nodes.sh --script benchmarks/gloo_reduce_scatter.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from functools import partial

import torch
import torch.distributed as dist

from ragged_placement import _compat, one_worker_gloo
from ragged_placement.testing.launch import run_gloo

WORLD = 4
GROUPS = {"inter": ([0, 2], [1, 3]), "intra": ([0, 1], [2, 3]), "all 4": ([0, 1, 2, 3],)}


def _groups() -> dict[str, object]:
    """This rank's group per row of :data:`GROUPS` (every rank creates every group)."""
    rank, out = dist.get_rank(), {}
    for name, lists in GROUPS.items():
        for ranks in lists:
            group = dist.new_group(ranks)
            if rank in ranks:
                out[name] = group
    return out


def _median(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    t = torch.tensor(statistics.median(times), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _worker(rank: int, ws: int, mibs: list[int], reps: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    for name, group in _groups().items():
        n = dist.get_world_size(group)
        for mib in mibs:
            x = torch.randn(mib * 2**18, generator=torch.Generator().manual_seed(rank))
            theirs, ours = torch.empty(x.numel() // n), torch.empty(x.numel() // n)
            own = _median(partial(_compat._reduce_scatter, theirs, x, group=group), reps)
            a2a = _median(partial(_compat.reduce_scatter_single, ours, x, group=group), reps)
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
            ar = _median(partial(dist.all_reduce, x.clone(), group=group), reps)
            out[(name, mib)] = (own, a2a, ar)
    return out


def _tcp_timeouts() -> int:
    """This network namespace's TCP retransmission timeouts so far."""
    with open("/proc/net/netstat") as f:
        lines = [line.split() for line in f if line.startswith("TcpExt:")]
    return int(dict(zip(lines[0][1:], lines[1][1:]))["TCPTimeouts"])


def _table(res: dict, reps: int, where: str) -> None:
    print(f"\nfp32 reduce-scatter, 4 gloo ranks ({where}), median of {reps}, slowest rank, "
          f"torch {torch.__version__}\n")
    print("| group | MiB per rank | gloo's own reduce-scatter | all-to-all + sum | own / all-to-all "
          "| all-reduce |")
    print("|---|---|---|---|---|---|")
    for (name, mib), (own, a2a, ar) in res.items():
        print(f"| {name} | {mib} | {own * 1e3:.1f} ms | {a2a * 1e3:.1f} ms | {own / a2a:.2f}x "
              f"| {ar * 1e3:.1f} ms |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # one machine: spawn the ranks here
        _table(run_gloo(_worker, WORLD, args.mib, args.reps)[0], args.reps, "one machine")
        return
    with one_worker_gloo():  # as run_gloo's ranks: one gloo worker thread per group
        dist.init_process_group("gloo")  # under torchrun (scripts/two_nodes.sh --script)
        if dist.get_world_size() != WORLD:
            raise ValueError(f"this benchmark runs on {WORLD} ranks, got {dist.get_world_size()}")
        before = _tcp_timeouts()
        res = _worker(dist.get_rank(), WORLD, args.mib, args.reps)
    if dist.get_rank() == 0:
        _table(res, args.reps, "two nodes: ranks 0-1 and 2-3")
        print(f"\nTCP retransmission timeouts on node 0 meanwhile: {_tcp_timeouts() - before}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
