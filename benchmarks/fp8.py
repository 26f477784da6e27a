"""Bytes all-gathered and bytes of amax traffic per step for block-wise FP8 training.

For one FSDP unit of ``--layers-per-unit`` transformer layers (default 1) of every model in
ragged_placement/planner/models.json (MoE experts as separate ``nn.Linear`` matrices, as in Hugging Face's
Mixtral and DeepSeek-V3) and of the small GPT of ``ragged_placement.models`` (width 128, the
tests' model), at the world sizes given, three ways of all-gathering a unit whose Linear weights
train in 128x128-block FP8:

* ``ours``: ``fully_shard(unit, quant=BlockFP8Config((128, 128)), mp_policy=bf16)``, the real
  runtime: the planner places every FP8 weight at 128-row granularity (RaggedShard), each rank
  quantizes its own blocks with no communication (amax traffic: 0), and one all-gather moves
  the FP8 bytes, one fp32 scale per block and the other parameters (norms, biases, routers) in
  bf16. The planner cuts the unit into equal or uneven per-rank chunks (uneven where equal ones
  would pad), and the all-gather pads every rank's send to the largest only where that adds at
  most 1% (``planner.gather_starts``); else it is uneven (``gather``: ``uneven``, W broadcasts).
* ``fsdp2_bf16``: torch FSDP2's ``fully_shard(unit, mp_policy=bf16)`` (``Shard(0)``, each
  parameter's dim 0 padded to a multiple of the world size, 2 bytes per element).
* ``fsdp2_fp8_cut``: FSDP2's ``Shard(0)`` with FP8 weights (a model: torch has no FSDP2 FP8
  block-wise all-gather): 1 byte per (padded) element, each rank's scales for the blocks it
  touches (equal-size all-gather, so padded to the largest rank), other parameters in bf16. A
  128-row band that a rank boundary ``r * ceil(m / W)`` cuts needs a cross-rank amax before
  quantizing: ``amax B`` is that all-reduce's payload (4 bytes per cut block, one extra
  collective per unit per step, counted once per step; a ring moves ~2x the payload per rank).

``ours`` and ``fsdp2_bf16`` are measured (``src = run``): each runtime shards the unit over a
fake process group of ``W`` ranks in this process (collectives move no data, their sizes are
real; an uneven gather, which the fake group cannot run, is a no-op of the same output) and the
bytes come from :class:`~ragged_placement.testing.profiling.CollectiveMeter` around the unit's
real ``unshard()``. A step gathers a unit twice (forward, and again in backward after
``reshard_after_forward``) in both runtimes. Units with more than ``--max-run-params``
parameters do not fit in this machine's memory (the runtime takes the full fp32 unit as input):
their rows (``src = plan``) give the byte count of the same (segmented) plan and per-segment
``FP8GatherLayout`` the runtime builds, which equals the measured count on every unit that runs (asserted).

``ratio`` is against ``fsdp2_bf16`` (target for ours: <= 0.51). ``plan pad%`` is the planner's
padding of the flat buffer, ``payload`` what ours would send with no padding at all (FP8 +
scales + bf16 others, over ``fsdp2_bf16``): the gap between the two ratios is padding and
16-byte alignment, not the FP8 format. ``max/mean`` is the largest rank's send over the mean
send (uneven chunks: within one 128-row band of the mean). FSDP2 pads each parameter's dim 0 to
a multiple of ``W``; where ``W`` exceeds a parameter's rows that padding makes even the payload
ratio fall below 0.5. The script ends with one line: the rows above 0.51 and the worst.

A CPU timing follows (medians of 5): quantizing a rank's chunk into the FP8 send buffer
(the runtime's ``FP8UnitGather.pack``, torch reference) vs the bf16 cast FSDP's mixed precision does before
its all-gather, on the same chunk. GPU timings (Triton quantize kernel GB/s against the copy
bandwidth, FP8 vs bf16 Linear step time, FSDP2 + torchao's block-wise FP8 Linear) need a CUDA
device, which this task did not have: they are not measured here.

``--train-steps N`` also trains the small GPT of ``ragged_placement.models`` (2 layers, width
128) on the stdlib byte corpus for N AdamW steps in fp32, bf16 autocast and FP8 (CPU emulation of
the FP8 Linear) in one process and prints the validation losses (tests/quant/test_fsdp_fp8.py trains
FP8 vs bf16 under ``fully_shard`` on 4 ranks for 200 steps).

Usage: python benchmarks/fp8.py [--models a,b] [--worlds 8,64,256] [--layers-per-unit 4]
       [--max-run-params 1e9] [--no-cpu-timing] [--train-steps 200 --lr 1e-3]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from ragged_placement.planner import plan_segmented
from ragged_placement.planner.models import MODELS_JSON, fsdp_units, load_configs
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2MixedPrecision
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from ragged_placement.fsdp import MixedPrecisionPolicy, collectives, fully_shard
from ragged_placement.fsdp.fp8 import FP8UnitGather, fp8_granularity
from ragged_placement.testing.profiling import CollectiveMeter
from ragged_placement.models import Block, GPTConfig
from ragged_placement.quant import BlockFP8Config

BLOCK = 128
QUANT = BlockFP8Config(block=(BLOCK, BLOCK))
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
GATHERS_PER_STEP = 2  # forward, and backward after reshard_after_forward (both runtimes)
TEST_GPT = GPTConfig(n_layer=1, n_embd=128, n_head=4, block_size=64)

Params = list[tuple[str, tuple[int, ...], bool]]  # (name, shape, trains in FP8)


def build_unit(shapes: list[tuple[str, tuple[int, ...]]]) -> nn.Module:
    """A module holding ``shapes`` as the runtime sees them: every 2-D weight an ``nn.Linear``
    (a name without ``.weight``, e.g. a per-expert matrix, is the Linear itself), with its bias
    if listed; MoE routers (``mlp.gate.weight``), norms and other tensors plain parameters."""
    names = {n for n, _ in shapes}
    root = nn.Module()

    def at(path: list[str]) -> nn.Module:
        m = root
        for part in path:
            if part not in m._modules:
                m.add_module(part, nn.Module())
            m = m._modules[part]
        return m

    linears = set()
    for name, shape in shapes:
        parts = name.split(".")
        if len(shape) == 2 and not name.endswith("mlp.gate.weight") and parts[-1] != "bias":
            path = parts[:-1] if parts[-1] == "weight" else parts
            bias = ".".join([*path, "bias"]) in names
            at(path[:-1]).add_module(path[-1], nn.Linear(shape[1], shape[0], bias=bias))
            linears.add(".".join([*path, "bias"]))
        elif name not in linears:
            at(parts[:-1]).register_parameter(parts[-1], nn.Parameter(torch.empty(shape)))
    return root


def runtime_params(module: nn.Module) -> Params:
    """The unit's parameters in the order ``fully_shard`` collects them, with FP8 flags."""
    fp8 = {id(m.weight) for m in module.modules() if type(m) is nn.Linear}
    return [(n, tuple(p.shape), id(p) in fp8) for n, p in module.named_parameters()]


def ours_gather(params: Params, world: int, kernel: str = "auto") -> tuple[FP8UnitGather, object]:
    """The plan and FP8 gather ``fully_shard(quant=QUANT, mp_policy=BF16)`` builds for a unit
    (buffers on the meta device for byte counts; on the CPU with ``kernel="torch"``)."""
    fp8_shapes = {n: s for n, s, q in params if q}
    policy = fp8_granularity(None, fp8_shapes, QUANT.block)
    shapes = [(n, s) for n, s, _ in params]
    plan = plan_segmented(shapes, world, granularity=policy, dtype=torch.float32, uneven=True)
    return FP8UnitGather(
        plan,
        [n for n, _, _ in params],
        [torch.Size(s) for _, s, _ in params],
        [q for _, _, q in params],
        [True] * len(params),
        BlockFP8Config(QUANT.block, kernel=kernel),
        torch.bfloat16,
        torch.device("meta" if kernel == "auto" else "cpu"),
    ), plan


def fsdp2_bf16(params: Params, world: int) -> int:
    return sum(2 * math.ceil(s[0] / world) * world * math.prod(s[1:]) for _, s, _ in params)


def fsdp2_fp8_cut(params: Params, world: int) -> tuple[int, int]:
    """(all-gather bytes, amax all-reduce payload bytes) of Shard(0) FP8 with cut blocks."""
    data = 0
    scale_per_rank = [0] * world
    cut_blocks = 0
    for _, s, fp8 in params:
        c = math.ceil(s[0] / world)  # rows (dim-0 slices) per rank, FSDP2's Shard(0)
        if not fp8:
            data += 2 * c * world * math.prod(s[1:])
            continue
        data += c * world * s[1]
        m, n = s
        nb = math.ceil(n / BLOCK)
        cut_bands = set()
        for r in range(world):
            lo, hi = r * c, min((r + 1) * c, m)
            if lo >= hi:
                continue
            scale_per_rank[r] += 4 * nb * ((hi - 1) // BLOCK - lo // BLOCK + 1)
            if lo % BLOCK:
                cut_bands.add(lo // BLOCK)
        cut_blocks += len(cut_bands) * nb
    return data + world * max(scale_per_rank), 4 * cut_blocks


@contextlib.contextmanager
def fake_world(world: int) -> Iterator[DeviceMesh]:
    """Rank 0 of a ``world``-rank fake process group (collectives are no-ops of real size)."""
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def fake_uneven_gathers() -> Iterator[None]:
    """The fake process group rejects torch's list ``all_gather`` of uneven sizes; its
    collectives move no data anyway, so the uneven gather becomes a no-op with the same output
    (which :class:`CollectiveMeter` counts)."""
    saved = collectives._all_gather_uneven
    collectives._all_gather_uneven = lambda *args: collectives.Works([])
    try:
        yield
    finally:
        collectives._all_gather_uneven = saved


def measure(make: Callable[[], nn.Module], world: int) -> tuple[int, int, Params]:
    """All-gather bytes per step of ours and of FSDP2 bf16, measured on a fake ``world``."""
    with fake_world(world) as mesh:
        with torch.device("meta"):
            theirs = make()
        fsdp2_fully_shard(theirs, mesh=mesh, mp_policy=FSDP2MixedPrecision(torch.bfloat16))
        theirs.to_empty(device="cpu")
        with CollectiveMeter() as m2:
            for _ in range(GATHERS_PER_STEP):
                theirs.unshard()
                theirs.reshard()
        del theirs
        with torch.device("meta"):
            module = make()
        params = runtime_params(module)
        module.to_empty(device="cpu")
        with torch.no_grad():
            for p in module.parameters():
                p.zero_()
        fully_shard(module, mesh=mesh, quant=QUANT, mp_policy=BF16)
        with fake_uneven_gathers(), CollectiveMeter() as m1:
            for _ in range(GATHERS_PER_STEP):
                module.unshard()
                module.reshard()
        assert m1.counts["all_gather"] == m2.counts["all_gather"] == GATHERS_PER_STEP
        return m1.all_gather_bytes, m2.all_gather_bytes, params


def units(models: dict, layers_per_unit: int) -> list[tuple[str, Callable[[], nn.Module], int]]:
    """``(label, module factory, numel)`` of the benchmarked units: the first
    ``layers_per_unit`` layers of each model (for DeepSeek-V3 also the last ones: its first
    layers are dense, the rest MoE) and as many blocks of the tests' small GPT."""
    out = []
    for name, cfg in models.items():
        layers = [
            u for u in fsdp_units(name, cfg, stacked_experts=False) if u[0].startswith("layers.")
        ]
        groups = [layers[:layers_per_unit]]
        if name.startswith("deepseek"):
            groups.append(layers[-layers_per_unit:])
        for g in groups:
            label = g[0][0] if len(g) == 1 else f"{g[0][0]}-{g[-1][0].split('.')[-1]}"
            shapes = [(n, tuple(s)) for _, p in g for n, s in p]
            numel = sum(math.prod(s) for _, s in shapes)
            out.append((f"{name}/{label}", lambda shapes=shapes: build_unit(shapes), numel))
    n = layers_per_unit
    gpt = lambda: nn.Sequential(*(Block(TEST_GPT) for _ in range(n)))
    with torch.device("meta"):
        numel = sum(p.numel() for p in gpt().parameters())
    out.append((f"small-gpt(w128)/layers.0{f'-{n - 1}' if n > 1 else ''}", gpt, numel))
    return out


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


def byte_table(models: dict, worlds: list[int], layers_per_unit: int, max_run: float) -> str:
    """Print the table; returns the summary line (rows above 0.51 and the worst)."""
    print(f"all-gather bytes per step ({GATHERS_PER_STEP} gathers of the unit), 128x128 FP8 blocks")
    hdr = (
        f"{'unit':<36}{'W':>5} {'src':>4}  {'fsdp2_bf16':>11}  {'ours':>11} {'ratio':>6} "
        f"{'gather':>6} {'max/mean':>8} {'amax B':>6} {'plan pad%':>9} {'payload':>7}  "
        f"{'fsdp2_fp8_cut':>13} {'ratio':>6} {'cut blk':>8} {'amax B':>9}"
    )
    print(hdr)
    print("-" * len(hdr))
    worst, above = (0.0, ""), []
    for label, make, numel in units(models, layers_per_unit):
        for w in worlds:
            with torch.device("meta"):
                params = runtime_params(make())
            gather, plan = ours_gather(params, w)
            plan_pad = plan.padding_fraction
            a = GATHERS_PER_STEP * gather.gathered_nbytes
            b = GATHERS_PER_STEP * fsdp2_bf16(params, w)
            src = "plan"
            if numel <= max_run:
                ours_run, theirs_run, run_params = measure(make, w)
                assert run_params == params
                assert (ours_run, theirs_run) == (a, b), (label, w, ours_run, a, theirs_run, b)
                src = "run"
            payload = GATHERS_PER_STEP * (gather.gathered_nbytes - gather.padding_nbytes)
            sends = [sum(lay.rank_nbytes[r] for lay in gather.layouts) for r in range(w)]
            c, amax_c = fsdp2_fp8_cut(params, w)
            c *= GATHERS_PER_STEP
            kind = "uneven" if gather.segment.rank_starts is not None else "equal"
            print(
                f"{label:<36}{w:>5} {src:>4}  {fmt_bytes(b):>11}  {fmt_bytes(a):>11} "
                f"{a / b:>6.3f} {kind:>6} {max(sends) * w / sum(sends):>8.3f} {0:>6} "
                f"{100 * plan_pad:>9.2f} {payload / b:>7.3f}  "
                f"{fmt_bytes(c):>13} {c / b:>6.3f} {amax_c // 4:>8,} {amax_c:>9,}"
            )
            if a / b > 0.51 and label.split("/")[0] in models:
                above.append(f"{label} W={w}: {a / b:.3f} (payload {payload / b:.3f})")
            worst = max(worst, (a / b, f"{label}, W={w}"))
    print("\nours: 0 bytes of amax traffic on every unit (each rank owns whole blocks).")
    for line in above:
        print(f"  above 0.51: {line}")
    return (f"FP8 gather bytes / FSDP2 bf16: {len(above)} rows above 0.51, worst "
            f"{worst[0]:.3f} ({worst[1]})")


def cpu_timing(models: dict, world: int = 64, reps: int = 5) -> None:
    model = "llama-3.1-8b" if "llama-3.1-8b" in models else next(iter(models))
    unit, make, _ = units({model: models[model]}, 1)[0]
    with torch.device("meta"):
        params = runtime_params(make())
    gather, plan = ours_gather(params, world, kernel="torch")
    sends = [b - a for a, b in itertools.pairwise(gather.send_starts)]
    rank = sends.index(max(sends))  # the largest send; its elements are what bf16 would cast
    send_nbytes, chunk_numel = sends[rank], plan.rank_numel(rank)
    chunk = torch.randn(plan.chunk_numel)
    bf16 = torch.empty(chunk_numel, dtype=torch.bfloat16)

    def med(fn) -> float:
        fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    t_pack = med(lambda: gather.pack(rank, chunk))
    t_cast = med(lambda: bf16.copy_(chunk[:chunk_numel]))
    print(
        f"\nCPU ({torch.get_num_threads()} threads), {unit} at W={world}: rank {rank}'s chunk "
        f"(the largest send), {chunk_numel:,} fp32 elements"
    )
    print(
        f"  FP8 pack (runtime's FP8UnitGather.pack, torch ref): {1e3 * t_pack:8.2f} ms  "
        f"-> sends {fmt_bytes(send_nbytes)}"
    )
    print(
        f"  bf16 cast (FSDP mixed-precision all-gather input): {1e3 * t_cast:6.2f} ms  "
        f"-> sends {fmt_bytes(2 * chunk_numel)}"
    )
    print(
        f"  pack / cast time: {t_pack / t_cast:.1f}x (medians of {reps}); "
        f"send bytes ratio {send_nbytes / (2 * chunk_numel):.3f}"
    )


def train_gpt(mode: str, steps: int, lr: float) -> tuple[float, float]:
    """Validation loss and median step time of the small GPT trained ``steps`` steps in ``mode``."""
    from ragged_placement.models import GPT, GPTConfig, StdlibCorpus
    from ragged_placement.quant import convert_to_fp8_linear

    corpus = StdlibCorpus(max_bytes=1 << 20)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=128))
    if mode == "fp8":
        convert_to_fp8_linear(model.layers)  # embeddings, norms and the tied head stay fp32
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    times = []
    for step in range(steps):
        x, y = corpus.batch(step, 16, 64)
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16"):
            loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    with torch.no_grad():
        val = [model(*corpus.batch(10_000 + i, 32, 64, split="val")).item() for i in range(8)]
    return sum(val) / len(val), statistics.median(times)


def train_table(steps: int, lr: float) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = {mode: train_gpt(mode, steps, lr) for mode in ("fp32", "bf16", "fp8")}
    finally:
        torch.set_num_threads(threads)
    print(f"\nGPT (2 layers, width 128), {steps} steps, AdamW lr {lr}, batch 16x64, 1 CPU thread")
    for mode, (val, t) in results.items():
        rel = (val - results["bf16"][0]) / results["bf16"][0]
        print(
            f"  {mode:<5} val loss {val:.4f}  ({100 * rel:+.2f}% vs bf16)  step {1e3 * t:6.1f} ms"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="", help="comma-separated subset of models.json")
    ap.add_argument("--worlds", default="8,64,256")
    ap.add_argument("--models-json", default=MODELS_JSON)
    ap.add_argument(
        "--layers-per-unit", type=int, default=1, help="transformer layers per FSDP unit"
    )
    ap.add_argument(
        "--max-run-params",
        type=float,
        default=1e9,
        help="units up to this many parameters run through both runtimes; larger ones: plan",
    )
    ap.add_argument("--train-steps", type=int, default=0, help="also train the small GPT")
    ap.add_argument("--no-cpu-timing", dest="cpu_timing", action="store_false",
                    help="skip the FP8 pack vs bf16 cast timing")
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()
    models = load_configs(args.models_json)
    if args.models:
        models = {k: models[k] for k in args.models.split(",")}
    worlds = [int(w) for w in args.worlds.split(",")]
    summary = byte_table(models, worlds, args.layers_per_unit, args.max_run_params)
    if args.cpu_timing:
        cpu_timing(models)
    if args.train_steps:
        train_table(args.train_steps, args.lr)
    print(summary)


if __name__ == "__main__":
    main()
