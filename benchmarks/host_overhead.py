"""The runtime's own host cost: a plain module, torch FSDP2 and ours, with communication and
compute taken away.

One process joins torch's fake process group (``FakeStore``, backend ``"fake"``) at world size
``--world`` (8), so every collective returns at once without moving data: what is left of a step
is the host work of the runtime (hooks, views, allocations, the Python around each collective)
next to the model's own tiny compute. The model is ``--depth`` blocks of width ``--dim`` (64):
two LayerNorms and five Linears with biases, 14 parameters per block, and a final LayerNorm
(``Blocks``); each block is a ``fully_shard`` unit and the root one more (FSDP2's recipe). The
plain module (no FSDP, no process group in its step) is the limit.

Per depth (``--depths``, default 48, 192 and 768 blocks) and optimizer (``--optims``:
``adamw-foreach`` is ``torch.optim.AdamW(model.parameters(), foreach=True)`` as users write it,
``adamw-fused`` the same with ``fused=True``, ``muon`` our :class:`ragged_placement.optim.Muon`
with its matrices on Muon and the rest on its AdamW group), three fresh models (same init) run
``--runs`` interleaved rounds of plain, FSDP2, ours; a round times ``--steps`` steps of each
(after ``--warmup``), split into forward + backward (``loss.backward()``) and ``opt.step()``
(``zero_grad()`` untimed), on this process's CPU time (``--clock cpu``, the default: on a shared
machine the time other processes hold the cores does not count) or the wall clock. Reported: the median over all timed steps of each part, ours over
plain (forward + backward) and ours over FSDP2 (``opt.step()``), and per unit of depth (ms per
block: flat if the cost per unit does not grow with the model).

Counted, machine-independent, for one training step of each runtime (forward, backward,
``opt.step()``): the collectives by kind, calls and bytes (:class:`~ragged_placement.testing.
profiling.CollectiveMeter`, which sees both runtimes' c10d calls, all-reduces and all-to-alls
included: our runtime's agreement on unused gradients would show as an ``all_reduce``), and the
Python function calls of forward + backward (``cProfile``'s count; the host work the hooks add,
independent of the machine's speed).

``--profile``: where ours spends its host time, the top ``cProfile`` entries of a few steps of
forward + backward at the first depth (by own time).

Run: ``.venv/bin/python benchmarks/host_overhead.py`` (``--help`` for the knobs). Timing on a
shared machine is noisy: the rounds interleave the runtimes and the ratios are of medians.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import statistics
import time

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from _one_process import one_process_world  # benchmarks/ is the script directory
from ragged_placement.fsdp import fully_shard as ours_fully_shard
from ragged_placement.optim import Muon
from ragged_placement.testing.profiling import CollectiveMeter

RUNTIMES = ("plain", "fsdp2", "ours")
OPTIMS = ("adamw-foreach", "adamw-fused", "muon")
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
# the CPU time of this process (what the host spends, whatever else shares the cores), or the
# wall clock
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


class Block(nn.Module):
    """Seven modules with weight and bias (14 parameters): two norms, five ``dim x dim``
    linears."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.o(self.q(h) * self.k(h).sigmoid() + self.v(h))
        return x + self.fc(self.norm2(x)).relu()


class Blocks(nn.Module):
    """``depth`` blocks and a final norm; ``forward(x)`` is the output's mean square."""

    def __init__(self, depth: int, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x).square().mean()


def build_model(runtime: str, depth: int, dim: int, mesh) -> nn.Module:
    """The model of ``runtime`` (same init for all three): each block a unit, then the root."""
    torch.manual_seed(0)
    model = Blocks(depth, dim)
    if runtime == "plain":
        return model
    if runtime == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        fully_shard = ours_fully_shard
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def build_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    params = list(model.parameters())
    if name == "adamw-foreach":
        return torch.optim.AdamW(params, lr=1e-3, foreach=True)
    if name == "adamw-fused":
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    matrices = [p for p in params if p.ndim == 2]
    rest = [p for p in params if p.ndim != 2]
    return Muon([{"params": matrices}, {"params": rest, "algorithm": "adamw"}], lr=0.02)


class Trainer:
    """One runtime's model, optimizer and input; ``step()`` times one training step."""

    def __init__(self, runtime: str, optim: str, args, mesh) -> None:
        self.model = build_model(runtime, args.depth_now, args.dim, mesh)
        self.opt = build_optimizer(optim, self.model)
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(args.batch, args.seq, args.dim, generator=g)
        self.clock = args.clock
        self.fwd_bwd: list[float] = []
        self.opt_step: list[float] = []

    def forward_backward(self) -> None:
        self.model(self.x).backward()

    def step(self, timed: bool) -> None:
        clock = CLOCKS[self.clock]
        t0 = clock()
        self.forward_backward()
        t1 = clock()
        self.opt.step()
        t2 = clock()
        self.opt.zero_grad()
        if timed:
            self.fwd_bwd.append(t1 - t0)
            self.opt_step.append(t2 - t1)


def count_collectives(trainer: Trainer) -> dict[str, tuple[int, int]]:
    """``kind -> (calls, bytes)`` of one training step."""
    with CollectiveMeter(all_to_all=True) as meter:
        trainer.step(timed=False)
    return {k: (meter.counts[k], meter.counts[f"{k}_bytes"]) for k in KINDS}


def python_calls(trainer: Trainer) -> int:
    """Python function calls of one forward + backward (``cProfile``'s count)."""
    prof = cProfile.Profile()
    prof.enable()
    trainer.forward_backward()
    prof.disable()
    trainer.opt.zero_grad()
    return pstats.Stats(prof).total_calls


def profile_ours(trainer: Trainer, steps: int, top: int) -> str:
    prof = cProfile.Profile()
    for _ in range(steps):
        prof.enable()
        trainer.forward_backward()
        prof.disable()
        trainer.opt.zero_grad()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def measure(depth: int, optim: str, args, mesh) -> dict:
    args.depth_now = depth
    trainers = {rt: Trainer(rt, optim, args, mesh) for rt in RUNTIMES}
    for t in trainers.values():
        for _ in range(args.warmup):
            t.step(timed=False)
    gc.collect()
    for _ in range(args.runs):  # rounds interleave the runtimes: slow phases hit all three
        for t in trainers.values():
            for _ in range(args.steps):
                t.step(timed=True)
    out = {
        rt: {
            "fwd_bwd": statistics.median(t.fwd_bwd),
            "opt_step": statistics.median(t.opt_step),
            "collectives": count_collectives(t),
            "calls": python_calls(t),
        }
        for rt, t in trainers.items()
    }
    if args.profile and depth == args.depths[0] and optim == args.optims[0]:
        out["profile"] = profile_ours(trainers["ours"], args.steps, args.profile_top)
    return out


def _ms(t: float) -> str:
    return f"{t * 1e3:.1f}"


def print_times(results: dict, args) -> None:
    print(f"\nHost time per step ({args.clock} clock), fake world {args.world}, dim {args.dim}, "
          f"batch {args.batch} x seq {args.seq}, median of {args.runs} interleaved rounds x "
          f"{args.steps} steps\n")
    print("| blocks (parameters) | optimizer | fwd+bwd ms: plain / FSDP2 / ours | ours vs plain "
          "| FSDP2 vs plain | ours ms per block | opt.step ms: plain / FSDP2 / ours | ours vs FSDP2 |")
    print("|---|---|---|---|---|---|---|---|")
    for (depth, optim), r in results.items():
        fb = [r[rt]["fwd_bwd"] for rt in RUNTIMES]
        st = [r[rt]["opt_step"] for rt in RUNTIMES]
        per_block = (fb[2] - fb[0]) / depth
        print(f"| {depth} ({depth * 14 + 2:,}) | {optim} | {' / '.join(map(_ms, fb))} "
              f"| {fb[2] / fb[0]:.2f}x | {fb[1] / fb[0]:.2f}x | {per_block * 1e3:.3f} over plain "
              f"| {' / '.join(map(_ms, st))} | {st[2] / st[1]:.2f}x |")


def print_counts(results: dict) -> None:
    print("\nCollectives per training step (calls / bytes) and Python calls per forward + "
          "backward\n")
    print("| blocks | optimizer | runtime | " + " | ".join(KINDS) + " | Python calls |")
    print("|---|---|---|" + "---|" * len(KINDS) + "---|")
    for (depth, optim), r in results.items():
        for rt in RUNTIMES:
            c = r[rt]["collectives"]
            cells = " | ".join(f"{n} / {b:,}" for n, b in (c[k] for k in KINDS))
            print(f"| {depth} | {optim} | {rt} | {cells} | {r[rt]['calls']:,} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[48, 192, 768])
    ap.add_argument("--optims", nargs="+", choices=OPTIMS, default=list(OPTIMS))
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--runs", type=int, default=5, help="interleaved rounds")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per runtime and round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                    help="cpu: this process's CPU time (default: on a shared machine, the time "
                         "other processes hold the cores does not count); wall: elapsed time")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile of ours' forward + backward at the first depth")
    ap.add_argument("--profile-top", type=int, default=30)
    args = ap.parse_args()
    if args.world < 2:
        ap.error("--world must be at least 2 (a fake world of that many ranks)")
    torch.set_num_threads(1)
    results = {}
    with one_process_world("cpu", args.world):
        mesh = init_device_mesh("cpu", (args.world,))
        for depth in args.depths:
            for optim in args.optims:
                results[(depth, optim)] = measure(depth, optim, args, mesh)
                gc.collect()
    print_times(results, args)
    print_counts(results)
    for r in results.values():
        if "profile" in r:
            print("\nWhere ours spends its host time (forward + backward, cProfile, by own "
                  "time):\n")
            print(r["profile"])


if __name__ == "__main__":
    main()
