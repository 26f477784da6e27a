"""Padding, balance and planning time of ragged_placement.planner on real model shapes.

For every model in ragged_placement/planner/models.json, world sizes 8 ... 65536, and two granularity policies
(128x128 quantization blocks; whole matrices, one Muon owner each), every FSDP unit (embedding,
each transformer layer, head) is planned and compared with:

* FSDP2 ``Shard(0)`` per parameter: dim 0 padded to a multiple of the world size;
* block-respecting ``Shard(0)`` (block policy only): dim 0 padded to a multiple of
  ``world * 128`` rows, so every rank holds whole 128-row bands (a stacked ``[E, out, in]``
  expert tensor: ``E`` padded to a multiple of the world, whole experts per rank);
* FSDP1: one flat buffer padded to a multiple of the world size (cuts blocks anywhere);
* ``LB``: the planner's proven lower bound on padding for a zero-copy flat layout (every
  uncuttable piece inside one chunk, and the chunk a multiple of the band of every parameter
  longer than two chunks).

Padding is reported as a percentage of the buffer bytes (padding / (params + padding)), summed
over units. ``load`` is max/mean per-rank optimizer work summed over the model's units as
``plan_units`` spreads them (elements for blocks, Newton-Schulz FLOPs m*n*min(m,n) for whole
matrices); ``unit`` is the same inside the largest unit alone. ``plan ms`` is the median of 3 cold runs (cache cleared) of
``plan_units`` over every unit of the model on one core (identical layers packed once);
``pl ms`` is the time to then build every RaggedShard of every unit with ``plan`` (each holds
one unit count per rank, O(world); identical layers share theirs).

``ours/S0`` compares with the matching Shard(0) baseline: block-respecting for blocks, FSDP2's
for rows and elements (none for whole matrices).

Issue 16 (uneven per-rank chunks, ``plan_segmented(uneven=True)`` as ``fully_shard`` plans):

* ``--issue16``: for every model of models.json and the public MoE configs in ``EXTRA_CONFIGS``
  (stacked and separate experts), the last 1 and 4 layers as one unit with 128x128 blocks, at
  W = 64, 256, 1024, 4096: padding before (equal chunks) and after, in % of the parameters, the
  block-respecting Shard(0) baseline, the largest chunk over the mean, and whether the target
  (padding <= 1%, largest chunk <= mean + one band) is met where the unit holds >= 4 bands per rank;
* ``--grouping``: ``layers_per_unit`` (smallest consecutive-layer grouping) per model and mesh;
* ``--timing``: cold planning time of the 1-trillion-parameter kimi-k2 at 65,536 ranks, then
  ``plan_state_sharding`` of it at 16,384 ranks (2048 x 8), the EP search included
  (``benchmarks/state_sharding.py --timing``);
* ``--collectives``: equal vs uneven all-gather / reduce-scatter on 4 gloo ranks;
* ``--options``: padding of each design option weighed in docs/planner-options.md.

Usage: python benchmarks/planner.py [--models a,b] [--worlds 8,64] [--policies block128,matrix]
       [--separate-experts] [--issue16 [--unit-layers 1,4]] [--grouping] [--timing] [--collectives]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import numpy as np
import torch

torch.set_num_threads(1)

from ragged_placement.planner import (  # noqa: E402
    Granularity,
    layers_per_unit,
    plan,
    plan_segmented,
    plan_units,
    shard0_padding,
)
from ragged_placement.planner.models import MODELS_JSON as PACKAGE_MODELS_JSON  # noqa: E402
from ragged_placement.planner.models import fsdp_units, load_configs  # noqa: E402
from ragged_placement.planner.plan import _planned, _rotated  # noqa: E402

MODELS_JSON = os.environ.get("MODELS_JSON", PACKAGE_MODELS_JSON)
# Public MoE configs not in models.json (issue 16): two band widths (hidden 4096, expert FFN 1536,
# attention out 8192), stacked experts whose rows are not a multiple of 128 (H = F = 2880, fused
# [E, 2F, H] gate/up), MLA attention with 384 experts (the 1-trillion-parameter model).
EXTRA_CONFIGS = {
    "qwen3-235b-a22b": {"hidden": 4096, "layers": 94, "intermediate": 1536, "heads": 64,
                        "kv_heads": 4, "head_dim": 128, "vocab": 151936, "experts": 128},
    "gpt-oss-120b": {"hidden": 2880, "layers": 36, "intermediate": 2880, "heads": 64,
                     "kv_heads": 8, "head_dim": 64, "vocab": 201088, "experts": 128},
    "kimi-k2": {"hidden": 7168, "layers": 61, "dense_layers": 1, "intermediate": 18432,
                "moe_intermediate": 2048, "experts": 384, "shared_experts": 1, "heads": 64,
                "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab": 163840},
}
WORLDS = (8, 64, 512, 4096, 16384, 65536)
BLOCK = 128


_BLOCK, _ELEMENT = Granularity.block(BLOCK, BLOCK), Granularity.element()
_MATRIX, _MATRICES = Granularity.matrix(), Granularity.matrices()


def block_policy(name: str, shape: tuple[int, ...]) -> Granularity:
    return _BLOCK if len(shape) >= 2 else _ELEMENT


def matrix_policy(name: str, shape: tuple[int, ...]) -> Granularity:
    if len(shape) >= 3:
        return _MATRICES  # one Muon owner per expert of a stacked tensor
    return _MATRIX if len(shape) == 2 else _ELEMENT


def row_policy(name: str, shape: tuple[int, ...]) -> Granularity:
    return Granularity.row() if len(shape) >= 2 else _ELEMENT


POLICIES = {
    "block128": block_policy,
    "matrix": matrix_policy,
    "row": row_policy,
    "element": lambda name, shape: _ELEMENT,
}


def fsdp2_padding(shapes, world: int) -> int:
    return sum((-(-s[0] // world) * world - s[0]) * math.prod(s[1:]) for s in shapes)


def block_shard0_padding(shapes, world: int) -> int:
    pad = 0
    for s in shapes:
        if len(s) == 1:
            pad += -(-s[0] // world) * world - s[0]
        elif len(s) == 2:
            step = world * BLOCK
            pad += (-(-s[0] // step) * step - s[0]) * s[1]
        else:
            pad += (-(-s[0] // world) * world - s[0]) * math.prod(s[1:])
    return pad


def fsdp1_padding(shapes, world: int) -> int:
    total = sum(math.prod(s) for s in shapes)
    return -(-total // world) * world - total


def plan_model(units, world: int, policy):
    return plan_units([params for _, params in units], world, granularity=policy)


def pct(pad: int, total: int) -> float:
    return 100.0 * pad / (total + pad)


def run(models, worlds, separate: bool, policies) -> None:
    configs = load_configs(MODELS_JSON)
    header = (
        f"{'model':<22}{'world':>6} {'gran':<9}{'ours%':>9}{'seg%':>9}{'LB%':>9}{'blkS0%':>9}"
        f"{'FSDP2%':>9}{'FSDP1%':>9}{'ours/S0':>9}{'seg/S0':>9}{'load':>9}{'unit':>9}{'plan ms':>9}"
        f"{'pl ms':>9}"
    )
    print(header)
    print("-" * len(header))
    for name in models:
        variants = [(name, True)]
        if separate and configs[name].get("experts"):
            variants.append((name + "/sep", False))
        for label, stacked in variants:
            units = fsdp_units(name, configs[name], stacked_experts=stacked)
            shapes = [s for _, params in units for _, s in params]
            total = sum(math.prod(s) for s in shapes)
            unit_shapes = [[s for _, s in params] for _, params in units]
            biggest = max(range(len(units)), key=lambda i: sum(math.prod(s) for s in unit_shapes[i]))
            for world in worlds:
                for gname in policies:
                    policy = POLICIES[gname]
                    times = []
                    for _ in range(3):
                        _planned.cache_clear()
                        _rotated.cache_clear()
                        t0 = time.perf_counter()
                        plans = plan_model(units, world, policy)
                        times.append(time.perf_counter() - t0)
                    ours = sum(p.padding_numel for p in plans)
                    lb = sum(
                        p.chunk_lower_bound * world - p.numel for p in plans
                    )
                    f2 = sum(fsdp2_padding(us, world) for us in unit_shapes)
                    f1 = sum(fsdp1_padding(us, world) for us in unit_shapes)
                    bs0 = sum(block_shard0_padding(us, world) for us in unit_shapes)
                    work = np.zeros(world)
                    for p in plans:
                        work += p.rank_work()
                    uw = plans[biggest].rank_work()
                    _planned.cache_clear()
                    _rotated.cache_clear()
                    shared = [plan(params, world, granularity=policy) for _, params in units]
                    t0 = time.perf_counter()
                    for p in shared:
                        for n in p.names:
                            p.placements[n]
                    pl_ms = 1e3 * (time.perf_counter() - t0)
                    # segmented units (plan_segmented): one coalesced collective per unit
                    seg = sum(plan_segmented(params, world, granularity=policy).padding_numel
                              for _, params in units)
                    bs0_txt = f"{pct(bs0, total):9.3f}" if gname == "block128" else f"{'-':>9}"
                    base = {"block128": bs0, "row": f2, "element": f2}.get(gname)

                    def ratio_of(x: int) -> str:
                        if base is None:
                            return f"{'-':>9}"
                        if base:
                            return f"{x / base:9.3f}"
                        return f"{'=':>9}" if not x else f"{'inf':>9}"

                    ratio, seg_ratio = ratio_of(ours), ratio_of(seg)
                    print(
                        f"{label:<22}{world:>6} {gname:<9}{pct(ours, total):9.3f}{pct(seg, total):9.3f}"
                        f"{pct(lb, total):9.3f}"
                        f"{bs0_txt}{pct(f2, total):9.3f}{pct(f1, total):9.3f}{ratio}{seg_ratio}"
                        f"{work.max() / work.mean():9.1f}{uw.max() / uw.mean():9.1f}"
                        f"{1e3 * statistics.median(times):9.1f}{pl_ms:9.0f}",
                        flush=True,
                    )


def _configs() -> dict:
    return {**load_configs(MODELS_JSON), **EXTRA_CONFIGS}


def issue16(models, worlds, unit_layers) -> None:
    """Before (equal chunks) / after (uneven chunks allowed) padding of the last ``k`` layers as
    one unit, in % of the parameters' elements, and the issue-16 targets."""
    configs = _configs()
    header = (f"{'model':<24}{'unit':>6}{'world':>6}{'bands/rk':>9}{'before%':>10}{'after%':>9}"
              f"{'S0%':>9}{'max/mean':>9}{'mean+band':>10}{'kind':>9}{'target':>8}")
    print(header)
    print("-" * len(header))
    for name in models:
        cfg = configs[name]
        variants = [(name, True)] + ([(name + "/sep", False)] if cfg.get("experts") else [])
        for label, stacked in variants:
            all_units = fsdp_units(name, cfg, stacked_experts=stacked)
            layers = [p for n, p in all_units if n.startswith("layers.")]
            others = [(n, p) for n, p in all_units if not n.startswith("layers.")]
            for k, unit in [(k, [e for layer in layers[-k:] for e in layer]) for k in unit_layers] \
                    + others:
                shapes = [s for _, s in unit]
                total = sum(math.prod(s) for s in shapes)
                band = BLOCK * max((s[-1] for s in shapes if len(s) >= 2), default=1)
                for world in worlds:
                    before = plan_segmented(unit, world, granularity=block_policy)
                    after = plan_segmented(unit, world, granularity=block_policy, uneven=True)
                    s0 = shard0_padding([after.specs[n] for n, _ in unit], world)
                    mean = total / world
                    applies = total >= 4 * band * world
                    met = after.padding_numel <= 0.01 * total and after.chunk_numel <= mean + band
                    assert after.padding_numel <= s0, (label, k, world)
                    kind = type(after).__name__.replace("Plan", "") or "Equal"
                    print(f"{label:<24}{k:>6}{world:>6}{total / band / world:9.1f}"
                          f"{100 * before.padding_numel / total:10.2f}"
                          f"{100 * after.padding_numel / total:9.2f}{100 * s0 / total:9.1f}"
                          f"{after.chunk_numel / mean:9.3f}{(mean + band) / mean:10.3f}{kind:>11}"
                          f"{('met' if met else 'MISSED') if applies else '-':>8}", flush=True)


def grouping(models, worlds) -> None:
    """``layers_per_unit``: the smallest number of consecutive layers per unit for each mesh."""
    configs = _configs()
    print(f"{'model':<24}" + "".join(f"{'W=' + str(w):>9}" for w in worlds))
    for name in models:
        cfg = configs[name]
        for label, stacked in [(name, True)] + ([(name + "/sep", False)] if cfg.get("experts") else []):
            layers = [p for n, p in fsdp_units(name, cfg, stacked_experts=stacked)
                      if n.startswith("layers.")][-16:]
            ks = [layers_per_unit(layers, w, block_policy) for w in worlds]
            print(f"{label:<24}" + "".join(f"{k or '>16':>9}" for k in ks), flush=True)


def timing(world: int = 65536, repeats: int = 3) -> None:
    """Cold planning time of the whole 1-trillion-parameter MoE (kimi-k2: 61 layers, 384
    experts) with ``plan_segmented(uneven=True)``, every unit, one core."""
    from state_sharding import _clear_caches, timing as state_sharding_timing  # script dir

    cfg = EXTRA_CONFIGS["kimi-k2"]
    for stacked in (False, True):
        units = fsdp_units("kimi-k2", cfg, stacked_experts=stacked)
        params = sum(math.prod(s) for _, p in units for _, s in p)
        times = []
        for _ in range(repeats):
            _clear_caches()  # every planner cache
            t0 = time.perf_counter()
            plans = [plan_segmented(p, world, granularity=block_policy, uneven=True) for _, p in units]
            times.append(time.perf_counter() - t0)
        pad = sum(p.padding_numel for p in plans)
        print(f"kimi-k2 ({params / 1e12:.3f}T params, {len(units)} units, "
              f"{'stacked' if stacked else 'separate'} experts) at W={world}: "
              f"{statistics.median(times):.2f} s median of {repeats} cold runs "
              f"({', '.join(f'{t:.2f}' for t in times)}), padding {pad} elements", flush=True)
    # the whole partitioner, the state sharding and expert-parallel search included
    state_sharding_timing(expert_units=32)


def _set_partitions(items):
    """Every partition of ``items`` into non-empty groups (Bell(n) of them)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _set_partitions(rest):
        yield [[first]] + part
        for i in range(len(part)):
            yield part[:i] + [[first] + part[i]] + part[i + 1:]


def _exact_grouping_padding(unit, world: int, max_classes: int = 7) -> int | None:
    """Least equal-chunk padding over every grouping of the unit's parameter classes (same
    shape) into segments, each spanning all ranks; parameters never cut join the largest
    segment. Exhaustive (Bell(#classes) segmentations), each segment packed by the planner;
    ``None`` beyond ``max_classes`` classes (Bell(8) = 4,140 plans per unit)."""
    from ragged_placement.planner.granularity import resolve

    classes: dict[tuple, list[str]] = {}
    small = []
    for n, shape in unit:
        spec = resolve(n, shape, block_policy(n, shape))
        if spec.whole or spec.numel <= spec.band_numel:
            small.append(n)
        else:
            classes.setdefault(tuple(shape), []).append(n)
    if len(classes) > max_classes:
        return None
    shapes = dict(unit)
    best = None
    for part in _set_partitions(list(classes)):
        groups = [[n for c in g for n in classes[c]] for g in part]
        largest = max(range(len(groups)), key=lambda k: sum(math.prod(shapes[n]) for n in groups[k]))
        groups[largest] += small
        pad = sum(plan([(n, shapes[n]) for n in g], world, granularity=block_policy).padding_numel
                  for g in groups)
        best = pad if best is None else min(best, pad)
    return best


def _stride_padded(unit):
    """The unit with each stacked expert's rows padded to a multiple of 128 (the stride-padded
    view): the shapes the buffer would hold, and the padding rows cost in elements."""
    out, extra = [], 0
    for n, s in unit:
        if len(s) == 3 and s[1] % BLOCK:
            padded = (s[0], -(-s[1] // BLOCK) * BLOCK, s[2])
            extra += math.prod(padded) - math.prod(s)
            out.append((n, padded))
        else:
            out.append((n, s))
    return out, extra


def options(worlds=(256, 1024, 4096)) -> None:
    """Padding of each design option on the issue's configurations, one layer per unit (four
    for grouping), in % of the parameters' elements."""
    configs = _configs()
    cases = [("qwen3-235b-a22b", False), ("gpt-oss-120b", True), ("kimi-k2", False)]
    print(f"{'configuration':<22}{'world':>6}{'equal':>9}{'exact grp':>10}{'stride':>9}"
          f"{'4 layers':>9}{'uneven':>8}{'max/mean':>9}")
    for name, stacked in cases:
        layers = [p for n, p in fsdp_units(name, configs[name], stacked_experts=stacked)
                  if n.startswith("layers.")]
        unit = layers[-1]
        total = sum(math.prod(s) for _, s in unit)
        four = [e for layer in layers[-4:] for e in layer]
        padded, extra = _stride_padded(unit)
        for world in worlds:
            equal = plan_segmented(unit, world, granularity=block_policy).padding_numel
            exact = _exact_grouping_padding(unit, world)
            stride = (plan_segmented(padded, world, granularity=block_policy).padding_numel + extra
                      if extra else None)
            grouped = plan_segmented(four, world, granularity=block_policy).padding_numel / 4
            un = plan_segmented(unit, world, granularity=block_policy, uneven=True)
            fmt = lambda x: f"{'-':>9}" if x is None else f"{100 * x / total:9.2f}"  # noqa: E731
            print(f"{name + ('' if stacked else '/sep'):<22}{world:>6}{fmt(equal)}"
                  f"{fmt(exact)[1:]:>10}{fmt(stride)}{fmt(grouped)}"
                  f"{100 * un.padding_numel / total:8.2f}{un.chunk_numel * world / total:9.3f}",
                  flush=True)


def _collective_times(rank: int, world: int, numel: int, repeats: int) -> dict[str, float]:
    import torch.distributed as dist

    from ragged_placement.fsdp.collectives import all_gather_segments, reduce_scatter_segments
    from ragged_placement.planner import Segment

    s = numel // world
    # uneven: chunks alternate s + s/8 and s - s/8, as a unit within one band of the mean would
    sizes = [s + (s // 8 if r % 2 == 0 else -(s // 8)) for r in range(world)]
    starts = tuple(int(x) for x in np.concatenate([[0], np.cumsum(sizes)]))
    cases = {"equal": Segment(0, 0, s), "uneven": Segment(0, 0, max(sizes), starts)}
    out = {}
    for kind, seg in cases.items():
        buf = torch.zeros(seg.buffer_numel(world))
        chunk = torch.randn(seg.chunk_numel)
        for op in ("all-gather", "reduce-scatter"):
            ts = []
            for _ in range(repeats):
                dist.barrier()
                t0 = time.perf_counter()
                if op == "all-gather":
                    all_gather_segments(buf, chunk, [seg], world)
                else:
                    reduce_scatter_segments(chunk, [buf], [seg], world)
                ts.append(time.perf_counter() - t0)
            out[f"{op} {kind}"] = statistics.median(ts[1:])
    return out


def collectives(world: int = 4, numels=(1 << 20, 1 << 24), repeats: int = 7) -> None:
    """Equal vs uneven all-gather / reduce-scatter through the runtime's ``_compat`` wrappers on
    spawned gloo ranks (medians; rank 0's view)."""
    from ragged_placement.testing.launch import run_gloo

    for numel in numels:
        t = run_gloo(_collective_times, world, numel, repeats)[0]
        print(f"gloo W={world}, {numel * 4 / 2**20:.0f} MiB fp32 unit: "
              + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in t.items()), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=None, help="comma-separated model names (default: all)")
    ap.add_argument("--worlds", default=",".join(map(str, WORLDS)))
    ap.add_argument("--policies", default="block128,matrix",
                    help=f"comma-separated, from {','.join(POLICIES)}")
    ap.add_argument("--separate-experts", action="store_true",
                    help="also plan MoE models with one matrix per expert")
    ap.add_argument("--issue16", action="store_true",
                    help="before/after padding of 1- and 4-layer units at 64-4096 ranks (uneven chunks)")
    ap.add_argument("--unit-layers", default="1,4")
    ap.add_argument("--grouping", action="store_true", help="layers_per_unit for each model and mesh")
    ap.add_argument("--timing", action="store_true",
                    help="plan the 1T MoE at 65,536 ranks, then its state sharding at 2048 x 8")
    ap.add_argument("--collectives", action="store_true", help="equal vs uneven collectives on gloo")
    ap.add_argument("--options", action="store_true", help="padding of each issue-16 design option")
    args = ap.parse_args()
    if args.options:
        return options()
    if args.timing:
        return timing()
    if args.collectives:
        return collectives()
    if args.issue16 or args.grouping:
        models = args.models.split(",") if args.models else list(_configs())
        worlds = [int(w) for w in args.worlds.split(",")] if args.worlds != ",".join(map(str, WORLDS)) \
            else [64, 256, 1024, 4096]
        if args.grouping:
            return grouping(models, worlds)
        return issue16(models, worlds, [int(k) for k in args.unit_layers.split(",")])
    configs = load_configs(MODELS_JSON)
    models = args.models.split(",") if args.models else list(configs)
    run(models, [int(w) for w in args.worlds.split(",")], args.separate_experts,
        args.policies.split(","))


if __name__ == "__main__":
    main()
