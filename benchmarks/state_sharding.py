"""Per-state sharding (issue 25): the partitioner's choice against torch FSDP2's two points.

``--planner``: :func:`ragged_placement.planner.plan_state_sharding` for Llama-3.1-70B and
DeepSeek-V3 (shared/models.json) on 1,024 and 16,384 GPUs of 80 GB, 8 per node (mesh
``{"inter": W / 8, "intra": 8}``, 450 GB/s per direction inside a node, 50 GB/s per GPU across),
AdamW, parameters stored in fp32, gathered in bf16, gradients reduced in fp32 (torchtitan's
recipe), at ``fully_shard``'s default granularity (rows). For each: its choice, memory per GPU by state (GB) and predicted communication seconds
per step by mesh dim, beside FSDP2 full-shard (zero3 over every GPU) and FSDP2 HSDP (hsdp over
``intra``) on the same model, from the same model of memory and communication. Units: the
embedding, each layer, the head (``planner.models.fsdp_units``, experts as separate matrices,
as Hugging Face's DeepSeek-V3); the experts of an MoE layer in units of ``--expert-units N``
(default 32) experts each (a whole 256-expert layer gathers 11.3 B parameters: its unsharded
buffers alone exceed 80 GB).
``plan ms``: the partitioner's wall time with its per-unit plan caches cleared (one run).

``--timing``: the partitioner's cold wall time on the 1-trillion-parameter Kimi K2 (one unit
per layer, 128x128 blocks) at 16,384 ranks, on a 2-D ``(inter, intra)`` and a 3-D ``(nodes, groups, gpus)`` mesh (median of 3).

``--profile``: the model's error against measured collective times on 4 gloo ranks (a 2x2
``(inter, intra)`` mesh, this machine): ``plan_state_sharding(..., bandwidth="profile")`` on
GPT 4x256 (fp32, no mixed precision) fits bandwidth and latency per dim, then every named
point (and AMSP) runs its step's collectives (``ShardingCandidate.collectives``: each kind
``calls`` times with its mean bytes per call) and the predicted seconds are set beside the
measured ones (median of ``--runs``, slowest rank).

``--full-table``: every candidate of every planned case, ranked (``StateShardingPlan.table``).

Usage: python benchmarks/state_sharding.py --planner [--timing] [--full-table] [--expert-units N]
       python benchmarks/state_sharding.py --profile [--runs 5]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
import time

import torch

torch.set_num_threads(1)

from ragged_placement.planner import plan_state_sharding
from ragged_placement.planner import state_sharding as _ss
from ragged_placement.planner.models import fsdp_units, load_configs

from planner import EXTRA_CONFIGS, MODELS_JSON, block_policy
from ragged_placement.fsdp import StateSharding

GPU_BYTES = 80e9
PER_NODE = 8
BANDWIDTH = {"inter": 50e9, "intra": 450e9}
WORLDS = (1024, 16384)
MODELS = ("llama-3.1-70b", "deepseek-v3")
EXPERT = re.compile(r"\.experts\.(\d+)\.")


def split_experts(units, per_unit: int):
    """``units`` with the experts of each MoE layer moved into units of ``per_unit`` experts
    (parameters named ``...experts.<i>....``); the rest of the layer stays one unit."""
    out = []
    for name, params in units:
        groups: dict[int, list] = {}
        rest = []
        for n, s in params:
            m = EXPERT.search(n)
            if m:
                groups.setdefault(int(m.group(1)) // per_unit, []).append((n, s))
            else:
                rest.append((n, s))
        out.append((name, rest))
        out += [(f"{name}.experts.group{g}", ps) for g, ps in sorted(groups.items())]
    return out


def _clear_caches() -> None:
    """Every planner cache: the partitioner's per-unit ones and the layout planner's."""
    from ragged_placement.planner.granularity import _resolve
    from ragged_placement.planner.plan import _planned, _rotated
    from ragged_placement.planner.segments import _choose
    from ragged_placement.planner.uneven import cached_uneven_cuts

    for fn in (_ss._layout, _ss._chunk, _ss._traffic, _ss._optim_bytes, _resolve, _planned,
               _rotated, _choose, cached_uneven_cuts):
        fn.cache_clear()


def _plan(units, mesh, budget):
    return plan_state_sharding(units, mesh, budget, bandwidth=BANDWIDTH, optimizer="adamw",
                               param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _row(model, world, label, c, ref_seconds, ms):
    m = c.memory_per_rank
    return [model, f"{world:,}", label, str(c.sharding), "T" if c.reshard_after_forward else "F",
            *(f"{m[s] / 1e9:.2f}" for s in ("params", "grads", "optim", "buffers")),
            f"{c.memory_total / 1e9:.2f}", "yes" if c.fits else "no",
            f"{c.comm_seconds['inter']:.3f}", f"{c.comm_seconds['intra']:.3f}",
            f"{c.comm_seconds_total:.3f}", f"{c.comm_seconds_total / ref_seconds:.2f}", ms]


def _print_table(head, rows) -> None:
    widths = [max(len(str(r[k])) for r in [head] + rows) for k in range(len(head))]
    print("  ".join(str(h).rjust(w) for h, w in zip(head, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(str(x).rjust(w) for x, w in zip(r, widths)))


def planner_table(expert_units: int, full_table: bool) -> None:
    configs = load_configs(MODELS_JSON)
    head = ["model", "GPUs", "point", "sharding", "raf", "params GB", "grads GB", "optim GB",
            "buffers GB", "total GB", "fits", "inter s", "intra s", "comm s", "/FSDP2", "plan ms"]
    rows, fulls = [], []
    for model in MODELS:
        units = split_experts(fsdp_units(model, configs[model], stacked_experts=False),
                              expert_units)
        for world in WORLDS:
            mesh = {"inter": world // PER_NODE, "intra": PER_NODE}
            _clear_caches()
            t0 = time.perf_counter()
            try:
                plan = _plan(units, mesh, GPU_BYTES)
                chosen = "choice"
            except ValueError as e:
                print(f"{model} on {world}: {e}")
                plan, chosen = _plan(units, mesh, math.inf), "least comm (nothing fits)"
            ms = f"{1e3 * (time.perf_counter() - t0):.0f}"
            full = plan.find(StateSharding.zero3(mesh))
            hsdp = plan.find(StateSharding.hsdp(mesh, "intra"))
            if chosen != "choice":  # candidates were ranked without a budget: recompute fits
                full, hsdp = (_refit(c) for c in (full, hsdp))
            ref = full.comm_seconds_total
            rows.append(_row(model, world, chosen, _refit(plan.choice), ref, ms))
            rows.append(_row(model, world, "FSDP2 full", full, ref, ""))
            rows.append(_row(model, world, "FSDP2 HSDP", hsdp, ref, ""))
            fulls.append((model, world, plan))
    _print_table(head, rows)
    if full_table:
        for model, world, plan in fulls:
            print(f"\n{model} on {world:,} GPUs, every candidate ranked:")
            print(plan.table())


def _refit(c):
    """``c`` with ``fits`` against 80 GB (plans made without a budget mark everything fitting)."""
    from dataclasses import replace

    return replace(c, fits=c.memory_total <= GPU_BYTES)


def timing(expert_units: int) -> None:
    config = EXTRA_CONFIGS["kimi-k2"]
    layouts = [("one unit per layer, stacked experts", fsdp_units("kimi-k2", config)),
               (f"separate experts in units of {expert_units}",
                split_experts(fsdp_units("kimi-k2", config, stacked_experts=False), expert_units))]
    meshes = [({"inter": 2048, "intra": 8}, BANDWIDTH),
              ({"nodes": 2048, "groups": 2, "gpus": 4},
               {"nodes": 50e9, "groups": 450e9, "gpus": 450e9})]
    for label, units in layouts:
        params = sum(math.prod(s) for _, ps in units for _, s in ps)
        for mesh, bw in meshes:
            times = []
            for _ in range(3):
                _clear_caches()
                t0 = time.perf_counter()
                plan = plan_state_sharding(units, mesh, GPU_BYTES * 100, bandwidth=bw,
                                           granularity=block_policy)
                times.append(time.perf_counter() - t0)
            print(f"kimi-k2 ({params / 1e12:.3f} T parameters, {len(units)} units, {label}) on "
                  f"{mesh}: {len(plan.candidates)} candidates, cold plan median "
                  f"{statistics.median(times):.3f} s (runs {', '.join(f'{t:.3f}' for t in times)})")


def _group(mesh, dims):
    import torch.distributed as dist

    if len(dims) == mesh.ndim:
        return dist.group.WORLD
    if len(dims) == 1:
        return mesh.get_group(dims[0])
    raise NotImplementedError(f"a collective over {dims} of a {mesh.ndim}-D mesh")


def _step_collectives(candidate, mesh):
    """A callable running ``candidate``'s step collectives (fp32, mean size per call)."""
    import torch.distributed as dist

    from ragged_placement._compat import all_gather_single, reduce_scatter_single

    calls = []
    for c in candidate.collectives:
        group, n, per_call = _group(mesh, c.dims), c.ranks, c.bytes / c.calls
        if c.op == "all_reduce":
            buf = torch.ones(max(1, round(per_call * n / (2 * (n - 1)) / 4)))
            calls += [lambda b=buf, g=group: dist.all_reduce(b, group=g)] * c.calls
            continue
        small = torch.ones(max(1, round(per_call / (n - 1) / 4)))
        big = torch.ones(small.numel() * n)
        fn = all_gather_single if c.op == "all_gather" else reduce_scatter_single
        args = (big, small) if c.op == "all_gather" else (small, big)
        calls += [lambda f=fn, a=args, g=group: f(*a, group=g)] * c.calls

    def run():
        for call in calls:
            call()
    return run


def _profile_rank(rank, world, runs):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ragged_placement.models.gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("inter", "intra"))
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=4, n_embd=256, n_head=4))
    plan = plan_state_sharding(model, mesh, math.inf, bandwidth="profile", param_dtype=None)
    points = [("zero1", StateSharding.zero1(mesh)), ("zero2", StateSharding.zero2(mesh)),
              ("zero3", StateSharding.zero3(mesh)), ("hsdp", StateSharding.hsdp(mesh, "intra")),
              ("amsp", StateSharding(("intra",), ("inter", "intra"), ("inter", "intra")))]
    rows = []
    for name, sharding in points:
        cand = plan.find(sharding)
        run = _step_collectives(cand, mesh)
        run()  # warm-up
        times = []
        for _ in range(runs):
            dist.barrier()
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        t = torch.tensor([statistics.median(times)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        rows.append((name, str(sharding), sum(c.calls for c in cand.collectives),
                     cand.comm_bytes, cand.comm_seconds_total, float(t)))
    return plan.profiled, rows


def profile_error(runs: int) -> None:
    from ragged_placement.launch import run_gloo

    fits, rows = run_gloo(_profile_rank, 4, runs, timeout=600)[0]
    print("fitted: " + ", ".join(f"{'+'.join(d)}: {bw / 1e6:.1f} MB/s, {lat * 1e6:.0f} us/step"
                                 for d, (bw, lat) in fits.items()))
    head = ["point", "sharding", "collectives", "inter KB", "intra KB", "predicted ms",
            "measured ms", "error"]
    table = [[name, sh, str(calls), f"{b['inter'] / 1e3:.0f}", f"{b['intra'] / 1e3:.0f}",
              f"{1e3 * pred:.2f}", f"{1e3 * meas:.2f}", f"{100 * (pred - meas) / meas:+.0f}%"]
             for name, sh, calls, b, pred, meas in rows]
    _print_table(head, table)
    errs = [abs(p - m) / m for *_, p, m in rows]
    print(f"mean |error| {100 * statistics.mean(errs):.0f}%, max {100 * max(errs):.0f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--planner", action="store_true")
    ap.add_argument("--timing", action="store_true")
    ap.add_argument("--full-table", action="store_true")
    ap.add_argument("--expert-units", type=int, default=32)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    print("$ python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]))
    if not (args.planner or args.timing or args.profile):
        ap.error("choose --planner, --timing and/or --profile")
    if args.planner:
        planner_table(args.expert_units, args.full_table)
    if args.timing:
        timing(args.expert_units)
    if args.profile:
        profile_error(args.runs)


if __name__ == "__main__":
    main()
