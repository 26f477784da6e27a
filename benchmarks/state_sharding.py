"""Per-state sharding (issue 25): the runtime and the partitioner against torch FSDP2's two points.

``--runtime``: ``fully_shard(..., state_sharding=...)`` on GPT 4x256 (each block, then the root;
AdamW; fp32, or ``--bf16`` gathers with fp32 reduction) on 2x2 and 2x4 ``(inter, intra)`` gloo
meshes (4 and 8 processes), at every named point (zero1, zero2, zero3, hsdp over ``intra``), AMSP's
(params ``intra``, grads and optimizer state over both) and the partitioner's choice
(``plan_state_sharding`` of the same model and mesh, ``memory_budget`` 28 MB, the bandwidths
below), against torch FSDP2 full-shard (a 1-D mesh) and FSDP2 HSDP in the same run, on the same
data. Per step, after 2 warm-up steps:

* collectives and the bytes each rank moves, per set of mesh dims the group spans, from one
  counter for both runtimes (:class:`~ragged_placement.testing.profiling.CollectiveMeter` wraps the
  c10d calls; ``by_dims`` names each group by the dims it spans): an all-gather's output less
  the rank's input, a reduce-scatter's input less its output, ``2 (n - 1) / n`` of an
  all-reduce (max over ranks). ``across inter``: over ``inter`` alone or with ``intra`` (the
  planner's ``inter`` column charges those to ``inter``). Checked against our units' own
  ``CommStats.by_dims`` on every state-sharded run (they do not count the unused-gradient flags'
  all-reduce, one byte per parameter);
* memory per rank (max over ranks) by state: parameters (the sharded parameters, our parameter
  chunk, the peak of the all-gathered parameters sampled after every op: ours the units'
  all-gather outputs, FSDP2's per-parameter outputs and its flat output until copy-out),
  gradients (after backward), optimizer state, and the heap's peak (``HeapPeakMeter``: all of it,
  activations included) over the measured steps;
* ``max|Δ|``: the parameters after the run against FSDP2 full-shard's.

Then the partitioner's memory model against the same runs, and the issue's targets with PASS or
MISS: AMSP moves at most FSDP2 HSDP's bytes + 5% across ``inter``, holds FSDP2 full-shard's
optimizer state (within one band: AdamW's state for one dim-0 row of every parameter) and FSDP2
HSDP's parameter memory (shard + chunk + unsharded peak).

``--planner``: :func:`ragged_placement.planner.plan_state_sharding` for Llama-3.1-70B and
DeepSeek-V3 (ragged_placement/planner/models.json) on 1,024 and 16,384 GPUs of 80 GB, 8 per node (mesh
``{"inter": W / 8, "intra": 8}``, 450 GB/s per direction inside a node, 50 GB/s per GPU across),
AdamW, parameters stored in fp32, gathered in bf16, gradients reduced in fp32 (torchtitan's
recipe), at ``fully_shard``'s default granularity (rows). For each: its choice, memory per GPU by
state (GB) and predicted communication seconds per step by mesh dim, beside FSDP2 full-shard
(zero3 over every GPU), FSDP2 HSDP (hsdp over ``intra``) and AMSP's point (params ``intra``,
grads and optimizer state over every GPU), all with ``reshard_after_forward=True``, on the same
model, from the same model of memory and communication. Units: the
embedding, each layer, the head (``planner.models.fsdp_units``, experts as separate matrices,
as Hugging Face's DeepSeek-V3); the experts of an MoE layer in units of ``--expert-units N``
(default 32) experts each (a whole 256-expert layer gathers 11.3 B parameters: its unsharded
buffers alone exceed 80 GB).
``plan ms``: the partitioner's wall time with its per-unit plan caches cleared (one run).

``--planner --moe``: the partitioner searching the expert-parallel degree with the sharding
(``plan_state_sharding(..., ep="auto")``) for DeepSeek-V3 (ragged_placement/planner/models.json) and Kimi K2
(benchmarks/planner.py's config), experts as stacked ``[E, out, in]`` tensors, one unit per layer
(plus the embedding and the head), on the same meshes and bandwidths; 4 x 4,096 = 16,384 tokens
per rank per step (torchtitan's deepseek_v3_671b config: local batch 4, sequence 4,096), top-8,
bf16 all-to-alls. Beside it FSDP2 + EP (zero3 over every data-parallel rank,
``reshard_after_forward=True``) at EP 1 (torchtitan's deepseek_v3_671b config; it adds TP 8,
not modelled here) and EP 64 (a Kimi K2 config of torchtitan's: 384 experts / 64). Per row:
memory per rank by state, predicted bytes and seconds per step by mesh dim, and the all-to-all's
share of the seconds.

``--timing``: the partitioner's cold wall and CPU time on the 1-trillion-parameter Kimi K2 (one
unit per layer, and separate experts in units of ``--expert-units``; 128x128 blocks) at 16,384
ranks, on a 2-D ``(inter, intra)`` and a 3-D ``(nodes, groups, gpus)`` mesh, and with the
expert-parallel degree searched (``ep='auto'``) on the 2-D one (median of 3).

``--profile``: the model's error against measured collective times on 4 gloo ranks (a 2x2
``(inter, intra)`` mesh, this machine): ``plan_state_sharding(..., bandwidth="profile")`` on
GPT 4x256 (fp32, no mixed precision) fits bandwidth and latency per dim, then every named
point (and AMSP) runs its step's collectives (``ShardingCandidate.collectives``: each kind
``calls`` times with its mean bytes per call) and the predicted seconds are set beside the
measured ones (median of ``--runs``, slowest rank).

``--full-table``: every candidate of every planned case, ranked (``StateShardingPlan.table``).

Usage: python benchmarks/state_sharding.py --runtime [--bf16]
       python benchmarks/state_sharding.py --planner [--timing] [--full-table] [--expert-units N]
       python benchmarks/state_sharding.py --planner --moe
       python benchmarks/state_sharding.py --profile [--runs 5]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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
            both = tuple(mesh)
            points = {"FSDP2 full": StateSharding.zero3(mesh),
                      "FSDP2 HSDP": StateSharding.hsdp(mesh, "intra"),
                      "AMSP": StateSharding(("intra",), both, both)}
            found = {label: _refit(plan.find(sh)) for label, sh in points.items()}
            ref = found["FSDP2 full"].comm_seconds_total
            rows.append(_row(model, world, chosen, _refit(plan.choice), ref, ms))
            rows += [_row(model, world, label, c, ref, "") for label, c in found.items()]
            fulls.append((model, world, plan))
    _print_table(head, rows)
    if full_table:
        for model, world, plan in fulls:
            print(f"\n{model} on {world:,} GPUs, every candidate ranked:")
            print(plan.table())


MOE_TOKENS_PER_RANK = 4 * 4096
MOE_TOP_K = 8
TORCHTITAN_EP = (1, 64)


def moe_plan(model: str, world: int):
    """``plan_state_sharding`` of ``model`` (stacked experts) at ``world`` ranks, every EP degree,
    planned without a budget (every candidate kept; :func:`_refit` marks the 80 GB ones)."""
    config = EXTRA_CONFIGS[model] if model in EXTRA_CONFIGS else load_configs(MODELS_JSON)[model]
    units = fsdp_units(model, config, stacked_experts=True)
    mesh = {"inter": world // PER_NODE, "intra": PER_NODE}
    return plan_state_sharding(units, mesh, math.inf, bandwidth=BANDWIDTH, optimizer="adamw",
                               param_dtype=torch.bfloat16, reduce_dtype=torch.float32, ep="auto",
                               tokens_per_rank=MOE_TOKENS_PER_RANK, top_k=MOE_TOP_K)


def moe_rows() -> list[tuple[str, int, str, object]]:
    """``(model, world, point, candidate)``: the partitioner's choice within 80 GB and FSDP2 + EP
    at torchtitan's degrees, for DeepSeek-V3 and Kimi K2 on 1,024 and 16,384 ranks."""
    out = []
    for model in ("deepseek-v3", "kimi-k2"):
        for world in WORLDS:
            plan = moe_plan(model, world)
            fitting = [c for c in map(_refit, plan.candidates) if c.fits]
            if fitting:
                out.append((model, world, "choice", fitting[0]))
            else:
                out.append((model, world, "least memory (nothing fits)",
                            _refit(min(plan.candidates, key=lambda c: c.memory_total))))
            zero3 = StateSharding.zero3(plan.mesh)
            out += [(model, world, f"FSDP2 + EP {ep}", _refit(plan.find(zero3, True, ep)))
                    for ep in TORCHTITAN_EP]
    return out


def moe_table() -> None:
    head = ["model", "GPUs", "point", "ep", "sharding", "raf", "params GB", "grads GB",
            "optim GB", "buffers GB", "total GB", "fits", "inter GB", "intra GB", "inter s",
            "intra s", "all-to-all s", "comm s"]
    rows = []
    for model, world, point, c in moe_rows():
        m = c.memory_per_rank
        a2a = sum(x.seconds for x in c.collectives if x.op == "all_to_all")
        rows.append([model, f"{world:,}", point, str(c.ep), str(c.sharding),
                     "T" if c.reshard_after_forward else "F",
                     *(f"{m[s] / 1e9:.2f}" for s in ("params", "grads", "optim", "buffers")),
                     f"{c.memory_total / 1e9:.2f}", "yes" if c.fits else "no",
                     *(f"{c.comm_bytes[d] / 1e9:.1f}" for d in ("inter", "intra")),
                     *(f"{c.comm_seconds[d]:.3f}" for d in ("inter", "intra")),
                     f"{a2a:.3f}", f"{c.comm_seconds_total:.3f}"])
    _print_table(head, rows)


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
    ep_search = {"ep": "auto", "tokens_per_rank": MOE_TOKENS_PER_RANK, "top_k": MOE_TOP_K}
    runs = [(label, units, mesh, bw, {}) for label, units in layouts for mesh, bw in meshes]
    runs.append(("one unit per layer, stacked experts, ep='auto'", layouts[0][1], *meshes[0],
                 ep_search))
    for label, units, mesh, bw, kwargs in runs:
        params = sum(math.prod(s) for _, ps in units for _, s in ps)
        tensors = sum(len(ps) for _, ps in units)
        times, cpu = [], []
        for _ in range(3):
            _clear_caches()
            t0, c0 = time.perf_counter(), time.process_time()
            plan = plan_state_sharding(units, mesh, GPU_BYTES * 100, bandwidth=bw,
                                       granularity=block_policy, **kwargs)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        print(f"kimi-k2 ({params / 1e12:.3f} T parameters, {tensors:,} tensors, {len(units)} "
              f"units, {label}) on {mesh}: {len(plan.candidates)} candidates, choice "
              f"{plan.sharding} raf={plan.reshard_after_forward} ep={plan.ep}, cold plan median "
              f"{statistics.median(times):.3f} s wall, {statistics.median(cpu):.3f} s CPU (runs "
              f"{', '.join(f'{t:.3f}' for t in times)} s wall)", flush=True)


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
    from ragged_placement.testing.launch import run_gloo

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


# -- --runtime: the runtime on gloo meshes against torch FSDP2 --------------------------------------
RUNTIME_MESHES = ((2, 2), (2, 4))  # (inter, intra): 4 and 8 gloo processes
RUNTIME_BUDGET = 28e6  # plan_state_sharding's memory_budget for GPT 4x256, bytes per rank
GPT_SHAPE = {"n_layer": 4, "n_embd": 256, "n_head": 4}
TARGET_SLACK = 0.05  # AMSP's bytes across inter: at most HSDP's + 5%


def _gpt_points(mesh) -> list[tuple[str, StateSharding]]:
    """Every named point of a 2-D ``(inter, intra)`` mesh and AMSP's (params intra)."""
    both = tuple(mesh.mesh_dim_names)
    return [("zero1", StateSharding.zero1(mesh)), ("zero2", StateSharding.zero2(mesh)),
            ("zero3", StateSharding.zero3(mesh)), ("hsdp", StateSharding.hsdp(mesh, "intra")),
            ("amsp", StateSharding(("intra",), both, both))]


def _gpt_plan(model, mesh, bf16: bool):
    """``plan_state_sharding`` for GPT 4x256 on ``mesh`` with the stated budget and bandwidths
    (the precision of the run: fp32, or bf16 gathers and fp32 reduction)."""
    return plan_state_sharding(model, mesh, RUNTIME_BUDGET, bandwidth=BANDWIDTH, optimizer="adamw",
                               param_dtype=torch.bfloat16 if bf16 else None,
                               reduce_dtype=torch.float32 if bf16 else None)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under ``tensors`` (DTensors: their local tensors), padding
    included: a flat buffer that parameters are views of counts once."""
    from torch.distributed.tensor import DTensor

    seen = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        seen[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(seen.values())


def _unsharded_bytes(model, runtime: str) -> int:
    """Bytes of the all-gathered parameters allocated now: ours, each unit's all-gather output
    (for ``params=()`` it stays allocated and :func:`_chunk_bytes` counts it instead); FSDP2's,
    each parameter's all-gather output and each group's flat all-gather output until it is
    copied out (and freed)."""
    if runtime == "ours":
        return sum(b.unsharded.untyped_storage().nbytes() for _, u in model.fsdp_units()
                   for b in u.buffers if not u.dp.keeps_params_unsharded)
    tensors = []
    for m in model.modules():
        group = m._get_fsdp_state()._fsdp_param_group if hasattr(m, "_get_fsdp_state") else None
        if group is None:
            continue
        tensors += [t for fp in group.fsdp_params for t in fp.all_gather_outputs]
        state = getattr(group.comm_ctx, "all_gather_state", None)  # set at FSDP2's lazy init
        for result in (group._all_gather_result, state and state.all_gather_result):
            if result:
                tensors.append(result.all_gather_output)
    return _storage_bytes(tensors)


def _chunk_bytes(model) -> int:
    """Bytes of our parameter chunks (:attr:`~ragged_placement.fsdp.mesh.BufferComm.param_chunk`:
    :class:`~ragged_placement.fsdp.nested.NestedBuffer`'s, the unsharded buffer itself for
    ``params=()``)."""
    chunks = [b.comm.param_chunk for _, unit in model.fsdp_units() for b in unit.buffers]
    return sum(c.untyped_storage().nbytes() for c in chunks if c is not None)


class _PeakOf(TorchDispatchMode):
    """The most ``fn()`` returned after any op dispatched inside the ``with`` block."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn, self.peak = fn, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.fn())
        return out


def _shard_gpt(model, runtime: str, mesh, sharding, raf: bool, bf16: bool) -> None:
    """Each block, then the root. Ours keeps the root's parameters gathered for backward
    (``reshard_after_forward`` applies to the other units); FSDP2 does so at its default
    (``None``), which it gets where ``raf`` is True."""
    if runtime == "ours":
        from ragged_placement.fsdp import MixedPrecisionPolicy, fully_shard

        kw = {"state_sharding": sharding}
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kw = {}
        raf = None if raf else raf
    if bf16:
        kw["mp_policy"] = MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=raf, **kw)
    fully_shard(model, mesh=mesh, reshard_after_forward=raf, **kw)


def _run_point(rank, ws, runtime, mesh, sharding, raf, dims_mesh, cfg, init, corpus, args) -> dict:
    """``args.warmup`` AdamW steps, then ``args.steps`` measured ones: the first under the
    collective counter; memory by state from the tensors, heap and unsharded peaks over all."""
    from ragged_placement.models import GPT
    from ragged_placement.testing.profiling import CollectiveMeter, HeapPeakMeter

    per, out = args.batch, {}
    with HeapPeakMeter() as heap:
        model = GPT(cfg)
        model.load_state_dict(init)
        _shard_gpt(model, runtime, mesh, sharding, raf, args.bf16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        out["n_params"] = len(list(model.parameters()))
        out["n_units"] = len(list(model.fsdp_units())) if runtime == "ours" else 0

        def step(i: int) -> None:
            x, y = corpus.batch(i, per * ws, cfg.block_size)
            model(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
            out["grads"] = _storage_bytes(p.grad for p in model.parameters())
            opt.step()
            opt.zero_grad()

        for i in range(args.warmup):
            step(i)
        unsharded = _PeakOf(lambda: _unsharded_bytes(model, runtime))
        for i in range(args.steps):
            units = [u for _, u in model.fsdp_units()] if runtime == "ours" else []
            for u in units:
                u.stats.reset()
            meter = CollectiveMeter() if i == 0 else contextlib.nullcontext()
            with heap.measure(), unsharded, meter:
                step(args.warmup + i)
            if i == 0:
                out["comm"] = meter.by_dims(dims_mesh)
                out["calls"] = sum(meter.counts[k] for k in ("all_gather", "reduce_scatter",
                                                             "all_reduce"))
                out["stats"] = _sum_by_dims(u.stats.by_dims for u in units)
        state = [t for s in opt.state.values() for t in s.values() if t.ndim]
        out |= {"params": _storage_bytes(model.parameters()), "optim": _storage_bytes(state),
                "chunk": _chunk_bytes(model) if runtime == "ours" else 0,
                "unsharded": unsharded.peak}
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        out["full"] = full if rank == 0 else None
    out["heap"] = heap.peak
    return out


def _sum_by_dims(per_unit) -> dict:
    out: dict = {}
    for by_dims in per_unit:
        for key, (n, nbytes) in by_dims.items():
            entry = out.setdefault(key, [0, 0])
            entry[0] += n
            entry[1] += nbytes
    return out


def _runtime_rank(rank: int, ws: int, shape: tuple[int, int], args) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh

    from ragged_placement.models import GPT, GPTConfig, StdlibCorpus

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("inter", "intra"))
    flat = init_device_mesh("cpu", (ws,))
    cfg = GPTConfig(block_size=args.seq, **GPT_SHAPE)
    torch.manual_seed(0)
    init = GPT(cfg).state_dict()
    corpus = StdlibCorpus(max_bytes=1 << 20)
    with torch.device("meta"):
        plan = _gpt_plan(GPT(cfg), mesh, args.bf16)
    runs = [("FSDP2 full", "fsdp2", flat, None, True), ("FSDP2 HSDP", "fsdp2", mesh, None, True)]
    runs += [(name, "ours", mesh, sh, True) for name, sh in _gpt_points(mesh)]
    runs.append(("choice", "ours", mesh, plan.sharding, plan.reshard_after_forward))
    rows = []
    for label, runtime, m, sharding, raf in runs:
        res = _run_point(rank, ws, runtime, m, sharding, raf, mesh, cfg, init, corpus, args)
        if res["stats"]:
            res["counted"] = _counter_matches(res["comm"], res["stats"], sharding, mesh,
                                              res["n_params"], res["n_units"])
        shown = sharding if sharding is not None else (StateSharding.zero3(mesh) if m is flat
                                                       else StateSharding.default(mesh))
        planned = plan.find(shown, raf)
        res |= {"label": label, "sharding": str(shown), "raf": raf,
                "planned": planned.comm_bytes, "planned_memory": planned.memory_per_rank}
        rows.append(res)
    return rows


def _kb(n: float) -> str:
    return f"{n / 1e3:.0f}"


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f}"


def _band_bytes(cfg) -> int:
    """AdamW's state (2 fp32 moments) for one dim-0 row of every parameter: "one band" of the
    optimizer state at ``fully_shard``'s default (row) granularity."""
    from ragged_placement.models import GPT

    with torch.device("meta"):
        model = GPT(cfg)
    return sum(8 * p.numel() // p.shape[0] for p in model.parameters())


def _meshes(text: str) -> tuple[tuple[int, int], ...]:
    """``--meshes 2x2,2x4`` -> ((2, 2), (2, 4))."""
    try:
        shapes = tuple(tuple(int(n) for n in m.split("x")) for m in text.split(","))
    except ValueError:
        shapes = ()
    if not shapes or any(len(m) != 2 or min(m) < 1 for m in shapes):
        raise argparse.ArgumentTypeError(f"expected inter x intra sizes such as 2x2,2x4, got {text!r}")
    return shapes


def runtime_table(args) -> None:
    from ragged_placement.models import GPTConfig
    from ragged_placement.testing.launch import run_gloo

    cfg = GPTConfig(block_size=args.seq, **GPT_SHAPE)
    precision = "bf16 gathers, fp32 reduction" if args.bf16 else "fp32"
    print(f"\nGPT {GPT_SHAPE['n_layer']}x{GPT_SHAPE['n_embd']} ({precision}, AdamW), seq "
          f"{args.seq}, batch {args.batch}/rank, per step after {args.warmup} warm-up steps; "
          f"choice: plan_state_sharding(memory_budget={RUNTIME_BUDGET:.3g}, bandwidth={BANDWIDTH})")
    head = ["mesh", "point", "sharding", "raf", "colls", "intra KB", "inter KB", "both KB",
            "across inter KB", "plan inter KB", "plan intra KB", "P shard MB", "P chunk MB",
            "P unsh. MB", "grads MB", "optim MB", "heap MB", "max|Δ| vs FSDP2"]
    rows, model_rows, targets, checks = [], [], [], []
    band = _band_bytes(cfg)
    for shape in args.meshes:
        ws = math.prod(shape)
        per_rank = run_gloo(_runtime_rank, ws, shape, args, timeout=600)
        results = {r["label"]: r for r in per_rank[0]}
        ref = results["FSDP2 full"]["full"]
        agg = {}
        for k, res in enumerate(per_rank[0]):
            ranks = [pr[k] for pr in per_rank]
            moved = {d: max(_moved(r["comm"], d) for r in ranks)
                     for d in (("intra",), ("inter",), ("inter", "intra"))}
            across = max(_moved(r["comm"], ("inter",)) + _moved(r["comm"], ("inter", "intra"))
                         for r in ranks)
            mem = {s: max(r[s] for r in ranks) for s in ("params", "chunk", "unsharded", "grads",
                                                          "optim", "heap")}
            delta = max(float((res["full"][n] - ref[n]).abs().max()) for n in ref)
            agg[res["label"]] = {"across": across, **mem}
            if res["label"] != "FSDP2 full":
                model_rows.append(_model_row(f"{shape[0]}x{shape[1]}", res, mem))
            rows.append([f"{shape[0]}x{shape[1]}", res["label"], res["sharding"],
                         "T" if res["raf"] else "F", str(res["calls"]),
                         *(_kb(moved[d]) for d in moved), _kb(across),
                         _kb(res["planned"]["inter"]), _kb(res["planned"]["intra"]),
                         *(_mb(mem[s]) for s in ("params", "chunk", "unsharded", "grads",
                                                 "optim", "heap")), f"{delta:.1e}"])
            checks += [r["counted"] for r in ranks if "counted" in r]
        targets += _targets(f"{shape[0]}x{shape[1]}", agg, band)
    _print_table(head, rows)
    print("\nthe partitioner's memory model against the same runs (MB per rank, measured / "
          "planned; params measured: shard + chunk)")
    _print_table(["mesh", "point", "params", "grads", "optim", "unsharded peak / buffers"],
                 model_rows)
    print(f"\nthe counter (CollectiveMeter.by_dims) == CommStats.by_dims plus the unused-gradient "
          f"and refresh-agreement flags' all-reduces, on {len(checks)} state-sharded runs x "
          f"ranks: "
          f"{'yes' if all(checks) else 'NO'}")
    for line in targets:
        print(line)


def _model_row(mesh: str, res: dict, mem: dict) -> list[str]:
    plan = res["planned_memory"]
    pairs = [(mem["params"] + mem["chunk"], plan["params"]), (mem["grads"], plan["grads"]),
             (mem["optim"], plan["optim"]), (mem["unsharded"], plan["buffers"])]
    return [mesh, res["label"], *(f"{_mb(a)} / {_mb(b)}" for a, b in pairs)]


def _moved(comm: dict, dims: tuple[str, ...]) -> int:
    """Bytes moved per rank over exactly ``dims`` (every kind of collective)."""
    return sum(v[2] for (kind, d), v in comm.items() if d == dims)


def _counter_matches(comm: dict, stats: dict, sharding, mesh, n_params: int,
                     n_units: int) -> bool:
    """Whether the counter's ``(kind, dims) -> [calls, bytes]`` is the units' own
    ``CommStats.by_dims`` plus the collectives they do not count, once per step, over the
    optimizer ranks (and over the replicated ones): ``drop_unused_grads``'s all-reduce of one
    byte per parameter and, where the units refresh (``params != optim``),
    ``agree_on_refreshes``'s of one byte per unit."""
    expected = {key: list(v) for key, v in stats.items()}
    replicated = tuple(d for d in mesh.mesh_dim_names if d not in sharding.optim)
    flags = [n_params] + ([n_units] if sharding.params != sharding.optim else [])
    for dims in (sharding.optim, replicated):
        for nbytes in flags if dims else ():
            entry = expected.setdefault(("all_reduce", dims), [0, 0])
            entry[0] += 1
            entry[1] += nbytes
    return {key: v[:2] for key, v in comm.items()} == expected


def _targets(mesh: str, agg: dict, band: int) -> list[str]:
    amsp, hsdp, full = agg["amsp"], agg["FSDP2 HSDP"], agg["FSDP2 full"]
    p_amsp = amsp["params"] + amsp["chunk"] + amsp["unsharded"]
    p_hsdp = hsdp["params"] + hsdp["chunk"] + hsdp["unsharded"]
    lines = [
        (amsp["across"] <= (1 + TARGET_SLACK) * hsdp["across"],
         (f"AMSP bytes across inter {_kb(amsp['across'])} KB <= FSDP2 HSDP's "
          f"{_kb(hsdp['across'])} KB + 5%")),
        (amsp["optim"] <= full["optim"] + band,
         (f"AMSP optimizer state {_mb(amsp['optim'])} MB <= FSDP2 full shard's "
          f"{_mb(full['optim'])} MB + one band ({_mb(band)} MB)")),
        (p_amsp <= p_hsdp,
         (f"AMSP parameter memory (shard + chunk + unsharded peak) {_mb(p_amsp)} MB <= FSDP2 "
          f"HSDP's {_mb(p_hsdp)} MB")),
    ]
    return [f"{mesh}: {'PASS' if ok else 'MISS'}  {text}" for ok, text in lines]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--planner", action="store_true")
    ap.add_argument("--timing", action="store_true")
    ap.add_argument("--moe", action="store_true",
                    help="--planner: search the expert-parallel degree (stacked experts)")
    ap.add_argument("--full-table", action="store_true")
    ap.add_argument("--expert-units", type=int, default=32)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--runtime", action="store_true")
    ap.add_argument("--bf16", action="store_true", help="--runtime: bf16 gathers, fp32 reduction")
    ap.add_argument("--seq", type=int, default=64, help="--runtime: sequence length")
    ap.add_argument("--batch", type=int, default=2, help="--runtime: sequences per rank per step")
    ap.add_argument("--warmup", type=int, default=2, help="--runtime: unmeasured steps")
    ap.add_argument("--steps", type=int, default=2, help="--runtime: measured steps")
    ap.add_argument("--meshes", type=_meshes, default=RUNTIME_MESHES,
                    help="--runtime: inter x intra meshes, e.g. 2x2,2x4 (the default)")
    args = ap.parse_args()
    print("$ python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]))
    if not (args.runtime or args.planner or args.timing or args.profile):
        ap.error("choose --runtime, --planner, --timing and/or --profile")
    if args.runtime:
        runtime_table(args)
    if args.planner and args.moe:
        moe_table()
    elif args.planner:
        planner_table(args.expert_units, args.full_table)
    if args.timing:
        timing(args.expert_units)
    if args.profile:
        profile_error(args.runs)


if __name__ == "__main__":
    main()
