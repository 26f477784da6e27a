"""Mixture of experts under expert parallelism: ours against torch FSDP2 + the same EP (issue 37).

An :class:`~ragged_placement.models.moe.MoETransformer` (default: 12.6 M parameters, 4 blocks of
width 256, the last 3 MoE blocks of 8 experts, top 2, one shared expert) on 4 gloo ranks as EP 2
x FSDP 2 (mesh ``(dp_mod_ep, ep)`` = ``(2, 2)``), sharded by ``parallelize_moe`` with our
``fully_shard`` or with torch's (torchtitan's FSDP2 + EP), the same weights and batches, AdamW.
Three runtimes run in the same job, alternating, ``--runs`` times each: FSDP2 + EP, ours in the
plain FSDP layout (zero3 over every rank for the dense units, over ``dp_mod_ep`` for the
experts), and ours with the partitioner's choice (``plan_state_sharding`` of the model on the
mesh at ``--ep``, with ``--bandwidth`` and ``--memory-budget``: its ``StateSharding`` and
``reshard_after_forward`` passed to ``parallelize_moe``; the experts get it with ``ep``
dropped). What the partitioner would pick with the EP degree searched (``ep="auto"``) is
printed beside it.

Muon (``--no-muon`` skips it): after the timed runs, one Muon step (the blocks' matrices and
3-D expert stacks; AdamW for the rest) on ours and on the choice, the collectives inside
``opt.step()`` by mesh dim and what Muon's exchange sent (``Muon.last_step_info``): experts a
rank holds whole send nothing, so nothing runs over the experts' dim ``dp_mod_ep`` alone but
the choice's refresh all-gathers (the runtime's, from the optimizer's post-step hook). FSDP2 +
EP has no Muon row: ``torch.optim.Muon`` takes 2-D parameters only, and ours raises on FSDP2's
``(_StridedShard(0), Shard(0))`` expert stacks.

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
across the link during the counted step (max over nodes). The bytes each rank moves over each
mesh dim (a ring's per-rank share of every all-to-all, all-gather and reduce-scatter whose group
spans it) are the machine-independent comparison of the three.

    .venv/bin/python benchmarks/moe.py                 # the table of docs/moe.md
    .venv/bin/python benchmarks/moe.py --two-nodes     # across two emulated nodes (root)
    .venv/bin/python benchmarks/moe.py --width 64 --layers 2 --steps 2 --runs 1   # a smoke run
    .venv/bin/python benchmarks/moe.py --fp8 --no-muon # ours in block-wise FP8, FSDP2 in bf16

``--fp8``: every runtime gathers in bf16 (``MixedPrecisionPolicy(bfloat16, float32)``), ours
(and the choice) with ``quant=BlockFP8Config()`` too: the dense ``nn.Linear`` weights and the
expert stacks gathered as FP8 blocks and scales (the ``all_gather dp_mod_ep`` rows are the
expert units').
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

from ragged_placement import one_worker_gloo
from ragged_placement.expert_parallel import drop_dim
from ragged_placement.fsdp import StateSharding
from ragged_placement.models.moe import MoEConfig, MoETransformer
from ragged_placement.parallelize import parallelize_moe
from ragged_placement.optim import Muon
from ragged_placement.planner import StateShardingPlan, plan_state_sharding
from ragged_placement.testing.launch import run_gloo
from ragged_placement.testing.profiling import (
    CollectiveMeter,
    HeapPeakMeter,
    net_bytes,
    state_bytes,
)

REPO = Path(__file__).resolve().parents[1]
RUNTIMES = ("fsdp2", "ours", "choice")
LABELS = {"fsdp2": "FSDP2 + EP", "ours": "ours", "choice": "ours, choice"}
DIMS = ("dp_mod_ep", "ep")
# Muon runs on ours only: torch.optim.Muon takes 2-D parameters, and ours raises on FSDP2's
# (_StridedShard(0), Shard(0)) expert stacks
MUON = ("ours", "choice")
KINDS = ("all_to_all", "all_gather", "reduce_scatter", "all_reduce")


def _config(args: argparse.Namespace) -> MoEConfig:
    return MoEConfig(vocab_size=256, dim=args.width, n_layers=args.layers,
                     n_dense_layers=args.dense_layers, n_heads=args.heads,
                     hidden_dim=4 * args.width, moe_hidden_dim=2 * args.width,
                     num_experts=args.experts, top_k=args.top_k)


def _shard_fn(runtime: str):
    if runtime == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        from ragged_placement.fsdp import fully_shard
    return fully_shard


def _bandwidth(args: argparse.Namespace) -> dict[str, float]:
    """``--bandwidth`` (bytes/s per rank) as ``{dp_mod_ep: ..., ep: ...}``."""
    return {k: float(v) for k, v in (item.split("=") for item in args.bandwidth.split(","))}


def plan(args: argparse.Namespace, ep: object = None) -> StateShardingPlan:
    """The partitioner's plan for the benchmark's model on its ``(dp_mod_ep, ep)`` mesh: at
    ``--ep`` (the EP group fills ``ep``: inside a node on ``--two-nodes``), or searching ``ep``
    (``"auto"``), for AdamW in fp32, ``--batch x --seq`` tokens per rank, ``--top-k``. No
    process group: the model on meta, the mesh by its sizes."""
    with torch.device("meta"):
        model = MoETransformer(_config(args))
    return plan_state_sharding(
        model, dict(zip(DIMS, (args.world // args.ep, args.ep))), args.memory_budget,
        bandwidth=_bandwidth(args), param_dtype=None, ep=args.ep if ep is None else ep,
        tokens_per_rank=args.batch * args.seq, top_k=args.top_k)


def _parallelize(runtime: str, model: MoETransformer, mesh, args: argparse.Namespace) -> None:
    """``parallelize_moe`` with torch's ``fully_shard`` (fsdp2), ours (plain FSDP layout), or
    ours with the partitioner's choice (``choice``)."""
    kwargs = _precision(runtime, args)
    if runtime == "choice":
        choice = plan(args)
        kwargs.update(state_sharding=choice.sharding,
                      reshard_after_forward=choice.reshard_after_forward)
    parallelize_moe(model, mesh, shard_fn=_shard_fn(runtime), **kwargs)


def _precision(runtime: str, args: argparse.Namespace) -> dict:
    """``--fp8``: bf16 all-gathers for every runtime, and ours' ``quant``."""
    if not args.fp8:
        return {}
    if runtime == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy
        return {"mp_policy": MixedPrecisionPolicy(torch.bfloat16, torch.float32)}
    from ragged_placement.fsdp import MixedPrecisionPolicy
    from ragged_placement.quant import BlockFP8Config
    return {"mp_policy": MixedPrecisionPolicy(torch.bfloat16, torch.float32),
            "quant": BlockFP8Config()}


def _muon(model: MoETransformer) -> Muon:
    """Muon on the blocks' matrices (2-D, and the 3-D expert stacks: each expert its own
    matrix), AdamW on the rest (the trainer's ``--optimizer muon``)."""
    in_blocks = {id(p) for p in model.layers.parameters()}
    matrices = [p for p in model.parameters() if p.ndim in (2, 3) and id(p) in in_blocks]
    others = [p for p in model.parameters() if id(p) not in {id(m) for m in matrices}]
    return Muon([{"params": matrices}, {"params": others, "algorithm": "adamw", "lr": 1e-3}],
                lr=0.02, adjust_lr="match_rms_adamw")


def _batch(step: int, rank: int, args: argparse.Namespace) -> torch.Tensor:
    g = torch.Generator().manual_seed(1_000 * step + rank)
    return torch.randint(0, 256, (args.batch, args.seq + 1), generator=g)


def _build(runtime: str, mesh, args: argparse.Namespace, muon: bool = False):
    torch.manual_seed(0)
    model = MoETransformer(_config(args))
    _parallelize(runtime, model, mesh, args)
    opt = _muon(model) if muon else torch.optim.AdamW(model.parameters(), lr=1e-3)
    rank = dist.get_rank()

    def step(i: int, state: dict | None = None, meter: CollectiveMeter | None = None) -> float:
        """One step; ``state`` gets this rank's state bytes before the gradients are freed;
        ``meter`` counts the optimizer step's collectives."""
        tokens = _batch(i, rank, args)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        if meter is None:
            opt.step()
        else:
            with meter:
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


def _muon_run(runtime: str, mesh, args: argparse.Namespace) -> dict:
    """One Muon step after one warm-up step: the collectives inside ``opt.step()`` by mesh dim
    (the choice's include the runtime's refresh all-gathers, issued from the optimizer's
    post-step hook) and what Muon itself sent (``Muon.last_step_info``)."""
    model, opt, step = _build(runtime, mesh, args, muon=True)
    step(0)
    meter = CollectiveMeter(all_to_all=True)
    step(1, meter=meter)
    info = opt.last_step_info
    return {"comm": {f"{kind} {'+'.join(dims)}": counts
                     for (kind, dims), counts in meter.by_dims(mesh).items()},
            "sent": info.bytes_sent, "nd_matrices": info.nd_matrices}


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
        for runtime in RUNTIMES:  # alternating, so that drifting load hits each
            runs[runtime].append(_one_run(runtime, mesh, args, counted=i == 0))
    muon = {runtime: _muon_run(runtime, mesh, args) for runtime in MUON} if args.muon else {}
    return {"runs": runs, "muon": muon}


def _mib(n: float) -> str:
    """MiB with 3 decimals; bytes below 1 KiB (our runtime's flags all-reduce)."""
    return f"{n / 2**20:.3f}" if n >= 1024 or not n else f"{n:.0f} B"


def _row(label: str, values: dict[str, float], fmt=_mib) -> None:
    """One table row: each runtime's value, then ours/FSDP2 and choice/FSDP2."""
    base = values["fsdp2"]
    ratios = [f"{values[rt] / base:.3f}" if base else ("-" if not values[rt] else "FSDP2: none")
              for rt in RUNTIMES[1:]]
    print(f"| {label} | {' | '.join(fmt(values[rt]) for rt in RUNTIMES)} | {' | '.join(ratios)} |")


def _header(title: str) -> None:
    print(f"| {title} | {' | '.join(LABELS[rt] for rt in RUNTIMES)} | ours/FSDP2 | choice/FSDP2 |")
    print("|---" * (2 * len(RUNTIMES)) + "|")


def _comm_rows(comm: dict[str, dict], prefix: str = "") -> list[str]:
    """Calls and MiB per collective and dims, in the order all-to-all, all-gather,
    reduce-scatter, all-reduce; the keys."""
    keys = sorted({k for c in comm.values() for k in c}, key=lambda k: (KINDS.index(k.split()[0]), k))
    for key in keys:
        counts = {rt: comm[rt].get(key, [0, 0, 0]) for rt in RUNTIMES}
        _row(f"{prefix}{key}: calls", {rt: c[0] for rt, c in counts.items()}, fmt=str)
        _row(f"{prefix}{key}: MiB", {rt: c[1] for rt, c in counts.items()})
    return keys


def moved_by_dim(comm: dict[str, list[int]]) -> dict[str, int]:
    """Bytes a rank moves per step over each mesh dim: the all-to-alls, all-gathers and
    reduce-scatters of groups spanning that dim (``moved``: what a ring sends per rank; a
    collective over both dims counts on both). The flags' all-reduces are left out."""
    out = dict.fromkeys(DIMS, 0)
    for key, (_, _, moved) in comm.items():
        kind, dims = key.split()
        if kind != "all_reduce":
            for d in dims.split("+"):
                out[d] += moved
    return out


def _plan_lines(args: argparse.Namespace) -> dict:
    """Print the partitioner's choice (and what searching EP would pick) and return it."""
    choice = plan(args)
    mesh = dict(zip(DIMS, (args.world // args.ep, args.ep)))
    fsdp2 = choice.find(StateSharding(params=DIMS, grads=DIMS, optim=DIMS), True, args.ep)
    experts = drop_dim(choice.sharding, "ep")
    searched = plan(args, ep="auto")
    print(f"partitioner (plan_state_sharding at ep={args.ep} on {mesh}, {args.bandwidth} B/s per "
          f"rank, budget {args.memory_budget:.3g} B, AdamW fp32): {choice.sharding}, "
          f"reshard_after_forward={choice.reshard_after_forward} (the experts: {experts}); "
          f"predicted {choice.choice.comm_seconds_total:.4f} s/step of communication against "
          f"{fsdp2.comm_seconds_total:.4f} s for FSDP2 + EP's point (zero3 over every rank, "
          f"reshard_after_forward=True): {fsdp2.comm_seconds_total / choice.choice.comm_seconds_total:.2f}x")
    print(f"with EP searched (ep='auto'): {searched.sharding} at ep {searched.ep}, predicted "
          f"{searched.choice.comm_seconds_total:.4f} s/step"
          + ("" if searched.ep == args.ep else
             f" (EP {searched.ep} spans both dims: not run here, where the ep dim is a node's "
             f"ranks and parallelize_moe takes one 2-D mesh)"))
    return {"sharding": str(choice.sharding), "reshard_after_forward": choice.reshard_after_forward,
            "predicted_s": choice.choice.comm_seconds_total, "fsdp2_predicted_s": fsdp2.comm_seconds_total,
            "searched_ep": searched.ep}


def _muon_rows(muon: list[dict]) -> dict:
    """Muon's step on ours and the choice: collectives per dim (rank 0) and what Muon sent (max
    over ranks)."""
    first = {rt: muon[0][rt] for rt in MUON}
    print(f"\n| Muon, one optimizer step (rank 0; MiB) | {' | '.join(LABELS[rt] for rt in MUON)} |")
    print("|---" * (1 + len(MUON)) + "|")
    keys = sorted({k for rt in MUON for k in first[rt]["comm"]},
                  key=lambda k: (KINDS.index(k.split()[0]), k))
    for key in keys:
        counts = [first[rt]["comm"].get(key, [0, 0, 0]) for rt in MUON]
        print(f"| in opt.step(): {key}: calls / MiB | "
              f"{' | '.join(f'{c[0]} / {_mib(c[1])}' for c in counts)} |")
    sent = {rt: max(rank[rt]["sent"] for rank in muon) for rt in MUON}
    nd = {rt: max(rank[rt]["nd_matrices"] for rank in muon) for rt in MUON}
    print(f"| Muon's exchange, bytes sent per rank (max; last_step_info) | "
          f"{' | '.join(str(sent[rt]) for rt in MUON)} |")
    print(f"| matrices moved by DTensor redistribution | {' | '.join(str(nd[rt]) for rt in MUON)} |")
    experts = {rt: first[rt]["comm"].get("all_to_all dp_mod_ep", [0, 0, 0])[1] for rt in MUON}
    print(f"| Muon's all-to-all over the experts' dim alone (dp_mod_ep), MiB | "
          f"{' | '.join(_mib(experts[rt]) for rt in MUON)} |")
    print("(FSDP2 + EP: torch.optim.Muon takes 2-D parameters only, and ours raises on FSDP2's "
          "(_StridedShard(0), Shard(0)) expert stacks)")
    return {"comm": {rt: first[rt]["comm"] for rt in MUON}, "sent": sent, "nd_matrices": nd,
            "experts": experts}


def report(per_rank: list[dict], args: argparse.Namespace, world: int) -> dict:
    """Print the table (markdown) and return its numbers."""
    runs = [rank["runs"] for rank in per_rank]
    first = {rt: runs[0][rt][0] for rt in RUNTIMES}
    tokens = args.batch * args.seq * world
    per_run = {rt: [tokens / r["time"] for r in runs[0][rt]] for rt in RUNTIMES}
    tps = {rt: statistics.median(v) for rt, v in per_run.items()}
    state = {rt: {k: max(rank[rt][0]["state"][k] for rank in runs) for k in first[rt]["state"]}
             for rt in RUNTIMES}
    peak = {rt: max(r["peak"] for rank in runs for r in rank[rt]) for rt in RUNTIMES}
    n_params = sum(p.numel() for p in MoETransformer(_config(args)).parameters())
    print(f"\nMoE {n_params / 1e6:.1f} M parameters ({args.layers} blocks x {args.width}, "
          f"{args.layers - args.dense_layers} MoE of {args.experts} experts, top {args.top_k}), "
          f"{world} gloo ranks as EP {args.ep} x FSDP {world // args.ep}, batch {args.batch} x "
          f"seq {args.seq} per rank, AdamW; {args.runs} runs of {args.steps} timed steps"
          f"{'; ours in FP8 (quant), FSDP2 + EP in bf16' if args.fp8 else ''}")
    chosen = _plan_lines(args)
    print()
    _header("per step, rank 0 (MiB; dims: dp_mod_ep, ep, or both: all ranks)")
    _comm_rows({rt: first[rt]["comm"] for rt in RUNTIMES})
    moved = {rt: moved_by_dim(first[rt]["comm"]) for rt in RUNTIMES}
    for d in DIMS:
        _row(f"MiB a rank moves over {d} (all-to-all, all-gather, reduce-scatter)",
             {rt: moved[rt][d] for rt in RUNTIMES})
    for kind in ("params", "grads", "optimizer"):
        _row(f"{kind} MiB per rank (max)", {rt: state[rt][kind] for rt in RUNTIMES})
    _row("heap peak in a step MiB per rank (max)", peak)
    link = {rt: max(rank[rt][0]["link"] for rank in runs) for rt in RUNTIMES}
    if any(link.values()):
        _row("MiB a node sent across the link in the counted step (max)", link)
    _row("tokens/s (median of runs)", tps, fmt=lambda t: f"{t:,.0f}")
    muon = _muon_rows([rank["muon"] for rank in per_rank]) if args.muon else None
    worse = {rt: [d for d in DIMS if moved[rt][d] > moved["fsdp2"][d]] for rt in RUNTIMES[1:]}
    print()
    for rt in RUNTIMES[1:]:
        print(f"target ({LABELS[rt]} moves no more bytes than FSDP2 + EP over any mesh dim): "
              f"{'met' if not worse[rt] else 'NOT met: ' + ', '.join(worse[rt])}")
    more_optim = state["choice"]["optimizer"] > state["fsdp2"]["optimizer"]
    print(f"target (the choice's optimizer state no more than FSDP2 + EP's): "
          f"{'NOT met' if more_optim else 'met'}")
    print(f"tokens/s choice/FSDP2 + EP: {tps['choice'] / tps['fsdp2']:.2f} (target >= 1.2 across "
          f"two nodes); per run: " + "; ".join(
              f"{LABELS[rt]} {', '.join(f'{t:,.0f}' for t in per_run[rt])}" for rt in RUNTIMES))
    return {"comm": {rt: first[rt]["comm"] for rt in RUNTIMES}, "moved": moved, "state": state,
            "peak": peak, "tokens_per_s": tps, "per_run": per_run, "worse": worse, "link": link,
            "plan": chosen, "muon": muon}


def _under_torchrun(args: argparse.Namespace) -> None:
    """One rank of the ``--two-nodes`` job (started by torchrun in scripts/two_nodes.sh)."""
    with one_worker_gloo():  # as run_gloo's ranks: one gloo worker thread per group
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
    ap.add_argument("--bandwidth", default="dp_mod_ep=6.25e7,ep=1e10",
                    help="the partitioner's bytes/s per rank per dim (default: a 1 Gbit/s link "
                         "shared by a node's 2 ranks across dp_mod_ep, 10 GB/s inside a node)")
    ap.add_argument("--memory-budget", type=float, default=1e9,
                    help="the partitioner's bytes per rank for parameters, gradients, "
                         "optimizer state and buffers")
    ap.add_argument("--no-muon", dest="muon", action="store_false",
                    help="skip the Muon step (one step per runtime, after the timed runs)")
    ap.add_argument("--fp8", action="store_true",
                    help="ours with quant=BlockFP8Config(), every runtime with bf16 all-gathers")
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
