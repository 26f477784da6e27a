"""Padding, balance and planning time of ragged_placement.planner on real model shapes.

For every model in shared/models.json, world sizes 8 ... 65536, and two granularity policies
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

Usage: python benchmarks/planner.py [--models a,b] [--worlds 8,64] [--policies block128,matrix]
       [--separate-experts]
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

from ragged_placement.planner import Granularity, plan, plan_segmented, plan_units  # noqa: E402
from ragged_placement.planner.models import fsdp_units, load_configs  # noqa: E402
from ragged_placement.planner.plan import _planned, _rotated  # noqa: E402

MODELS_JSON = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "models.json")
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=None, help="comma-separated model names (default: all)")
    ap.add_argument("--worlds", default=",".join(map(str, WORLDS)))
    ap.add_argument("--policies", default="block128,matrix",
                    help=f"comma-separated, from {','.join(POLICIES)}")
    ap.add_argument("--separate-experts", action="store_true",
                    help="also plan MoE models with one matrix per expert")
    args = ap.parse_args()
    configs = load_configs(MODELS_JSON)
    models = args.models.split(",") if args.models else list(configs)
    run(models, [int(w) for w in args.worlds.split(",")], args.separate_experts,
        args.policies.split(","))


if __name__ == "__main__":
    main()
