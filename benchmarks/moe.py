"""Mixture of experts under expert parallelism: ours against torch FSDP2 + the same EP (issue 37).

An :class:`~ragged_placement.models.moe.MoETransformer` (default: 12.6 M parameters, 4 blocks of
width 256, the last 3 MoE blocks of 8 experts, top 2, one shared expert) on 4 gloo ranks as EP 2
x FSDP 2 (mesh ``(dp_mod_ep, ep)`` = ``(2, 2)``), sharded by ``parallelize_moe`` with our
``fully_shard`` or with torch's (torchtitan's FSDP2 + EP), the same weights and batches, AdamW.
Both runtimes run in the same job, alternating, ``--runs`` times each.

Per step, from rank 0 (``CollectiveMeter(all_to_all=True).by_dims``): calls and bytes of each
collective per mesh dim: the EP dispatch and combine all-to-alls (and the token-count exchange)
over ``ep``, the experts' all-gathers and reduce-scatters over ``dp_mod_ep``, the dense units'
over both dims (all ranks). Bytes are the collective's size (an all-gather's output, a
reduce-scatter's or all-to-all's input), the same on every rank. Ours runs gloo's
reduce-scatters as all-to-alls (counted as the reduce-scatters they are); FSDP2 runs gloo's own.
Memory per rank (max over ranks): the parameters, gradients and AdamW state each rank holds
after a step (local tensors), and the heap's peak during a step above the heap before the model
was built (:class:`HeapPeakMeter`). Tokens/s: global tokens over rank 0's median step time, the
median of the runs.

``--two-nodes`` (root): the same job as 2 nodes x 2 ranks in two network namespaces joined by a
shaped link (``scripts/two_nodes.sh``, ``--rate``, ``--queue``), ranks 0-1 one node: each ep
group inside a node, ``dp_mod_ep`` across the link; the table then adds the bytes each node sent
across the link during the counted step (max over nodes).

    .venv/bin/python benchmarks/moe.py                 # the table of docs/moe.md
    .venv/bin/python benchmarks/moe.py --two-nodes     # across two emulated nodes (root)
    .venv/bin/python benchmarks/moe.py --width 64 --layers 2 --steps 2 --runs 1   # a smoke run
    .venv/bin/python benchmarks/moe.py --fp8           # ours in block-wise FP8, FSDP2 in bf16

``--fp8``: both runtimes gather in bf16 (``MixedPrecisionPolicy(bfloat16, float32)``), ours
with ``quant=BlockFP8Config()`` too: the dense ``nn.Linear`` weights and the expert stacks
gathered as FP8 blocks and scales (the ``all_gather dp_mod_ep`` rows are the expert units').
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from ragged_placement.models.moe import MoEConfig, MoETransformer, parallelize_moe
from ragged_placement.testing.launch import run_gloo
from ragged_placement.testing.profiling import (
    CollectiveMeter,
    HeapPeakMeter,
    net_bytes,
    state_bytes,
)

REPO = Path(__file__).resolve().parents[1]
RUNTIMES = ("fsdp2", "ours")
KINDS = ("all_to_all", "all_gather", "reduce_scatter", "all_reduce")


def _config(args: argparse.Namespace) -> MoEConfig:
    return MoEConfig(vocab_size=256, dim=args.width, n_layers=args.layers,
                     n_dense_layers=args.dense_layers, n_heads=args.heads,
                     hidden_dim=4 * args.width, moe_hidden_dim=2 * args.width,
                     num_experts=args.experts, top_k=args.top_k)


def _shard_fn(runtime: str):
    if runtime == "ours":
        from ragged_placement.fsdp import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    return fully_shard


def _fsdp_kwargs(runtime: str, args: argparse.Namespace) -> dict:
    """``--fp8``: bf16 all-gathers for both runtimes, and ours' ``quant``."""
    if not args.fp8:
        return {}
    if runtime == "ours":
        from ragged_placement.fsdp import MixedPrecisionPolicy
        from ragged_placement.quant import BlockFP8Config
        return {"mp_policy": MixedPrecisionPolicy(torch.bfloat16, torch.float32),
                "quant": BlockFP8Config()}
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return {"mp_policy": MixedPrecisionPolicy(torch.bfloat16, torch.float32)}


def _batch(step: int, rank: int, args: argparse.Namespace) -> torch.Tensor:
    g = torch.Generator().manual_seed(1_000 * step + rank)
    return torch.randint(0, 256, (args.batch, args.seq + 1), generator=g)


def _build(runtime: str, mesh, args: argparse.Namespace):
    torch.manual_seed(0)
    model = MoETransformer(_config(args))
    parallelize_moe(model, mesh, shard_fn=_shard_fn(runtime), **_fsdp_kwargs(runtime, args))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rank = dist.get_rank()

    def step(i: int, state: dict | None = None) -> float:
        """One step; ``state`` gets this rank's state bytes before the gradients are freed."""
        tokens = _batch(i, rank, args)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        if state is not None:
            state.update(state_bytes(model, opt))
        opt.zero_grad()
        return loss.item()

    return model, opt, step


def _one_run(runtime: str, mesh, args: argparse.Namespace, counted: bool) -> dict:
    """Build, ``--warmup`` steps, ``--steps`` timed steps (between barriers), one step under the
    collective meter (``counted``) and the heap's peak of the timed steps."""
    out: dict = {}
    with HeapPeakMeter() as mem:
        model, opt, step = _build(runtime, mesh, args)
        for i in range(args.warmup):
            step(i)
        times = []
        for i in range(args.warmup, args.warmup + args.steps):
            dist.barrier()
            t0 = time.perf_counter()
            with mem.measure():
                out.setdefault("losses", []).append(step(i))
            dist.barrier()
            times.append(time.perf_counter() - t0)
        if counted:
            dist.barrier()
            sent = net_bytes()
            with CollectiveMeter(all_to_all=True) as meter:
                step(args.warmup + args.steps)
            dist.barrier()
            out["link"] = _link_bytes(sent, net_bytes())
            out["comm"] = {f"{kind} {'+'.join(dims)}": counts
                           for (kind, dims), counts in meter.by_dims(mesh).items()}
        step(args.warmup + args.steps + 1, out.setdefault("state", {}))
        del model, opt, step
    out["peak"], out["time"] = mem.peak, statistics.median(times)
    return out


def _link_bytes(before: dict[str, int], after: dict[str, int]) -> int:
    """Bytes this node sent on its links between two :func:`net_bytes` (not loopback: inside
    a node; 0 outside ``scripts/two_nodes.sh``'s namespaces, where only one rank per node
    counts, its local rank 0)."""
    if os.environ.get("LOCAL_RANK", "0") != "0" or "GLOO_SOCKET_IFNAME" not in os.environ:
        return 0
    return sum(after[k] - before.get(k, 0) for k in after if k != "lo")


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world // args.ep, args.ep), mesh_dim_names=("dp_mod_ep", "ep"))
    runs: dict[str, list[dict]] = {r: [] for r in RUNTIMES}
    for i in range(args.runs):
        for runtime in RUNTIMES:  # alternating, so that drifting load hits both
            runs[runtime].append(_one_run(runtime, mesh, args, counted=i == 0))
    return runs


def _mib(n: float) -> str:
    """MiB with 3 decimals; bytes below 1 KiB (our runtime's flags all-reduce)."""
    return f"{n / 2**20:.3f}" if n >= 1024 or not n else f"{n:.0f} B"


def _row(label: str, a: float, b: float, fmt=_mib) -> None:
    ratio = f"{b / a:.3f}" if a else ("-" if not b else "FSDP2: none")
    print(f"| {label} | {fmt(a)} | {fmt(b)} | {ratio} |")


def report(per_rank: list[dict], args: argparse.Namespace, world: int) -> dict:
    """Print the table (markdown) and return its numbers."""
    first = {rt: per_rank[0][rt][0] for rt in RUNTIMES}
    tokens = args.batch * args.seq * world
    tps = {rt: statistics.median(tokens / r["time"] for r in per_rank[0][rt]) for rt in RUNTIMES}
    state = {rt: {k: max(rank[rt][0]["state"][k] for rank in per_rank) for k in first[rt]["state"]}
             for rt in RUNTIMES}
    peak = {rt: max(r["peak"] for rank in per_rank for r in rank[rt]) for rt in RUNTIMES}
    n_params = sum(p.numel() for p in MoETransformer(_config(args)).parameters())
    print(f"\nMoE {n_params / 1e6:.1f} M parameters ({args.layers} blocks x {args.width}, "
          f"{args.layers - args.dense_layers} MoE of {args.experts} experts, top {args.top_k}), "
          f"{world} gloo ranks as EP {args.ep} x FSDP {world // args.ep}, batch {args.batch} x "
          f"seq {args.seq} per rank, AdamW; {args.runs} runs of {args.steps} timed steps"
          f"{'; ours in FP8 (quant), FSDP2 + EP in bf16' if args.fp8 else ''}\n")
    print("| per step, rank 0 (MiB; dims: dp_mod_ep, ep, or both: all ranks) | FSDP2 + EP | ours | ours/FSDP2 |")
    print("|---|---|---|---|")
    keys = sorted(set(first["fsdp2"]["comm"]) | set(first["ours"]["comm"]),
                  key=lambda k: (KINDS.index(k.split()[0]), k))
    for key in keys:
        a, b = (first[rt]["comm"].get(key, [0, 0, 0]) for rt in RUNTIMES)
        _row(f"{key}: calls", a[0], b[0], fmt=str)
        _row(f"{key}: MiB", a[1], b[1])
    for kind in ("params", "grads", "optimizer"):
        _row(f"{kind} MiB per rank (max)", state["fsdp2"][kind], state["ours"][kind])
    _row("heap peak in a step MiB per rank (max)", peak["fsdp2"], peak["ours"])
    link = {rt: max(rank[rt][0]["link"] for rank in per_rank) for rt in RUNTIMES}
    if any(link.values()):
        _row("MiB a node sent across the link in the counted step (max)", link["fsdp2"],
             link["ours"])
    _row("tokens/s (median of runs)", tps["fsdp2"], tps["ours"], fmt=lambda t: f"{t:,.0f}")
    worse = [k for k in keys if first["ours"]["comm"].get(k, [0, 0])[1] >
             first["fsdp2"]["comm"].get(k, [0, 0])[1] and not k.startswith("all_reduce")]
    print(f"\ntarget (ours moves no more all-to-all / all-gather / reduce-scatter bytes than "
          f"FSDP2 + EP on any dim): {'met' if not worse else 'NOT met: ' + ', '.join(worse)}")
    runs = {rt: [f"{tokens / r['time']:,.0f}" for r in per_rank[0][rt]] for rt in RUNTIMES}
    print(f"tokens/s per run: FSDP2 + EP {runs['fsdp2']}, ours {runs['ours']}")
    return {"comm": {rt: first[rt]["comm"] for rt in RUNTIMES}, "state": state, "peak": peak,
            "tokens_per_s": tps, "worse": worse, "link": link}


def _under_torchrun(args: argparse.Namespace) -> None:
    """One rank of the ``--two-nodes`` job (started by torchrun in scripts/two_nodes.sh)."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank: list = [None] * world
    dist.all_gather_object(per_rank, _rank(rank, world, args))
    if rank == 0:
        report(per_rank, args, world)
    dist.barrier()
    dist.destroy_process_group()


def _two_nodes(args: argparse.Namespace, argv: list[str]) -> int:
    """Run this script under scripts/two_nodes.sh (2 nodes x ``--world / 2`` ranks)."""
    forwarded = [a for a in argv if a != "--two-nodes"]
    cmd = ["bash", "scripts/two_nodes.sh", "--rate", args.rate, "--queue", args.queue,
           "--nproc-per-node", str(args.world // 2), "--script", "benchmarks/moe.py", "--",
           *forwarded, "--torchrun"]
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=REPO, env=env, check=False).returncode


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dense-layers", type=int, default=1)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--fp8", action="store_true",
                    help="ours with quant=BlockFP8Config(), both with bf16 all-gathers")
    ap.add_argument("--two-nodes", action="store_true",
                    help="2 emulated nodes over a shaped link (scripts/two_nodes.sh; root)")
    ap.add_argument("--rate", default="1gbit", help="--two-nodes: the link's rate")
    ap.add_argument("--queue", default="10ms", help="--two-nodes: the link's queue (tbf latency)")
    ap.add_argument("--torchrun", action="store_true", help=argparse.SUPPRESS)  # a --two-nodes rank
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    _config(args)  # bad sizes raise here, before any process starts
    if args.world % args.ep or args.experts % args.ep:
        ap.error(f"--ep {args.ep} must divide --world {args.world} and --experts {args.experts}")
    if args.two_nodes and (args.world % 2 or (args.world // 2) % args.ep):
        ap.error(f"--two-nodes puts --world / 2 ranks on a node and each ep group inside one: "
                 f"--ep {args.ep} must divide {args.world // 2}")
    if args.torchrun:
        _under_torchrun(args)
        return {}
    if args.two_nodes:
        sys.exit(_two_nodes(args, argv))
    per_rank = run_gloo(_rank, args.world, args)
    return report(per_rank, args, args.world)


if __name__ == "__main__":
    main()
