"""StateSharding (issue 25) and the partitioner ``plan_state_sharding``: validation, the named
points, the memory model against hand computations and the planner's padding, the
communication model's bytes per mesh dim against the formula, ranking, errors, and a short
``"profile"`` run on 4 gloo ranks (2x2)."""

from __future__ import annotations

import math
import time

import pytest
import torch
from torch import nn

from dist_utils import run_gloo, run_threaded
from ragged_placement.fsdp import StateSharding
from ragged_placement.planner import plan_segmented, plan_state_sharding
from ragged_placement.planner.models import fsdp_units

MESH = {"inter": 2, "intra": 2}
BW = {"inter": 1e9, "intra": 1e10}


# -- StateSharding ------------------------------------------------------------------------------
def test_named_points_equal_spelling_them_out():
    both = ("inter", "intra")
    assert StateSharding.zero1(MESH) == StateSharding(params=(), grads=(), optim=both)
    assert StateSharding.zero2(MESH) == StateSharding(params=(), grads=both, optim=both)
    assert StateSharding.zero3(MESH) == StateSharding(params=both, grads=both, optim=both)
    assert StateSharding.hsdp(MESH, "intra") == StateSharding(("intra",), ("intra",), ("intra",))
    assert StateSharding("intra", both, both) == StateSharding(("intra",), both, both)
    amsp = StateSharding(params=("intra",), grads=both, optim=both)
    assert amsp.degrees({"inter": 128, "intra": 8}) == (8, 1024, 1024)
    assert StateSharding.zero1(MESH).degrees(MESH) == (1, 1, 4)


def test_default_is_what_fully_shard_does_today():
    assert StateSharding.default({"dp": 4}) == StateSharding.zero3({"dp": 4})
    assert StateSharding.default(MESH) == StateSharding.hsdp(MESH, "intra")
    assert StateSharding.zero3({"dp": 4}).is_default({"dp": 4})
    assert StateSharding.hsdp(MESH, "intra").is_default(MESH)
    assert not StateSharding.hsdp(MESH, "inter").is_default(MESH)
    assert not StateSharding.zero3(MESH).is_default(MESH)
    mesh3 = {"nodes": 2, "groups": 2, "gpus": 2}
    assert not StateSharding.zero3(mesh3).is_default(mesh3)
    with pytest.raises(ValueError, match="1-D or 2-D"):
        StateSharding.default(mesh3)


def test_bad_state_sharding_raises_value_errors_naming_the_fix():
    with pytest.raises(ValueError, match=r"params=\('inter',\) names \['inter'\].*add \['inter'\] to grads"):
        StateSharding(params=("inter",), grads=("intra",), optim=("inter", "intra"))
    with pytest.raises(ValueError, match=r"grads=.*names \['inter'\].*add \['inter'\] to optim"):
        StateSharding(params=(), grads=("inter",), optim=("intra",))
    with pytest.raises(ValueError, match="twice"):
        StateSharding(params=(), grads=(), optim=("intra", "intra"))
    with pytest.raises(ValueError, match="tuple of mesh dim names"):
        StateSharding(params=(), grads=(), optim=(0,))
    zero1 = StateSharding(params=(), grads=(), optim=("inter", "intra"))  # empty params: fine
    zero1.validate(MESH)
    with pytest.raises(ValueError, match=r"names \['nodes'\], not a dim of the mesh"):
        StateSharding(("nodes",), ("nodes",), ("nodes",)).validate(MESH)
    with pytest.raises(ValueError, match=r"tensor-parallel dim\(s\) \['tp'\]"):
        StateSharding((), ("tp",), ("dp", "tp")).validate({"dp": 2, "tp": 2}, tp_dims=("tp",))
    with pytest.raises(ValueError, match=r"write \('inter', 'intra'\)"):
        StateSharding((), (), ("intra", "inter")).validate(MESH)
    with pytest.raises(ValueError, match="shard_dim 'x'"):
        StateSharding.hsdp(MESH, "x")
    with pytest.raises(ValueError, match="mesh"):
        StateSharding.zero3({"a": 0})


# -- the memory model ---------------------------------------------------------------------------
def _plan(units, memory_budget=math.inf, **kw):
    kw.setdefault("bandwidth", BW)
    kw.setdefault("param_dtype", None)
    return plan_state_sharding(units, MESH, memory_budget, **kw)


def _candidate(plan, sharding, reshard=True):
    return plan.find(sharding, reshard)


def test_memory_matches_a_hand_computation():
    # one fp32 unit of 128 elements, 8-element rows: 32 per rank at W=4, no padding
    units = [[("w", (16, 8))]]
    amsp = StateSharding(params=("intra",), grads=("inter", "intra"), optim=("inter", "intra"))
    plan = _plan(units)
    z3 = _candidate(plan, StateSharding.zero3(MESH))
    # params 32 x 4 B, grads 32 x 4, AdamW 2 x 32 x 4; buffers: the gathered unit (128 x 4),
    # its gradient buffer (128 x 4) and the reduce-scatter output (32 x 4)
    assert z3.memory_per_rank == {"params": 128, "grads": 128, "optim": 256,
                                  "buffers": 512 + 512 + 128}
    a = _candidate(plan, amsp)
    # params: the optimizer's 32-element chunk and the 64-element parameter chunk it refreshes;
    # grads: the optimizer chunk's part of the reduction
    assert a.memory_per_rank == {"params": 128 + 256, "grads": 128, "optim": 256,
                                 "buffers": 512 + 512 + 256}
    # reshard_after_forward=False holds every unit's gathered buffer: with two units both
    two = _plan([[("w", (16, 8))], [("v", (16, 8))]])
    assert _candidate(two, StateSharding.zero3(MESH), False).memory_per_rank["buffers"] == \
        2 * 512 + 512 + 128
    assert _candidate(two, StateSharding.zero3(MESH), True).memory_per_rank["buffers"] == \
        2 * 512 + 512 + 128  # the unit and the prefetched next one
    assert _candidate(two, StateSharding.zero3(MESH)).memory_per_rank["params"] == 256
    # mixed precision: bf16 gathers from fp32 storage, fp32 reduction
    mp = _plan(units, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    m = _candidate(mp, StateSharding.zero3(MESH)).memory_per_rank
    # gathered bf16 (256) + bf16 send buffer (32 x 2) + bf16 grads (256), their fp32 cast (512)
    # and the fp32 reduce-scatter output (128); the stored states stay fp32
    assert m == {"params": 128, "grads": 128, "optim": 256, "buffers": 256 + 64 + 256 + 512 + 128}


def test_memory_uses_the_planners_padding():
    # awkward shapes: the plan at W=4 pads (or goes uneven); the model must take its chunk
    unit = [("a", (5, 3)), ("b", (7,)), ("c", (9, 3))]
    plan = _plan([unit])
    for sharding in (StateSharding.zero3(MESH), StateSharding.hsdp(MESH, "intra")):
        w = sharding.degrees(MESH)[0]
        ref = plan_segmented([(n, s) for n, s in unit], w, dtype=torch.float32, uneven=True)
        mem = _candidate(plan, sharding).memory_per_rank
        assert mem["params"] == mem["grads"] == ref.chunk_numel * 4
        assert mem["optim"] == 2 * ref.chunk_numel * 4
        assert mem["buffers"] == 2 * ref.buffer_numel * 4 + ref.chunk_numel * 4
    # the nested layout: AMSP's params chunk is two consecutive chunks of the 4-rank plan
    ref4 = plan_segmented([(n, s) for n, s in unit], 4, dtype=torch.float32, uneven=True)
    if hasattr(ref4, "rank_starts"):
        starts = [int(x) for x in ref4.rank_starts]
        c_p = max(starts[2] - starts[0], starts[4] - starts[2])
        c_o = max(b - a for a, b in zip(starts, starts[1:]))
    else:
        c_p, c_o = 2 * ref4.chunk_numel, ref4.chunk_numel
    amsp = StateSharding(params=("intra",), grads=("inter", "intra"), optim=("inter", "intra"))
    assert _candidate(plan, amsp).memory_per_rank["params"] == (c_o + c_p) * 4


def _runtime_buffers(rank, world_size, mesh_shape):
    from torch.distributed.device_mesh import init_device_mesh

    from ragged_placement.fsdp import fully_shard
    from ragged_placement.models.gpt import GPT, GPTConfig

    names = ("inter", "intra")[-len(mesh_shape):]
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    with torch.device("meta"):  # awkward widths: the plans pad or go uneven
        model = GPT(GPTConfig(vocab_size=100, n_layer=3, n_head=2, n_embd=42))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # a sharded model's parameters are DTensors: the partitioner wants the unsharded shapes
    with pytest.raises(ValueError, match="is a DTensor"):
        plan_state_sharding(model, {"dp": 4}, math.inf, bandwidth={"dp": 1e9})
    return [(b.chunk_numel, b.plan.buffer_numel) for _, u in model.fsdp_units() for b in u.buffers]


def test_memory_matches_fully_shards_buffers():
    """The model's params chunks and gathered buffers are the ones fully_shard allocates, on a
    1-D mesh (zero3) and a 2x2 one (HSDP over intra)."""
    from ragged_placement.models.gpt import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=100, n_layer=3, n_head=2, n_embd=42))
    for shape, mesh, sharding in (((4,), {"intra": 4}, StateSharding.zero3({"intra": 4})),
                                  ((2, 2), MESH, StateSharding.hsdp(MESH, "intra"))):
        units = run_threaded(_runtime_buffers, 4, shape)[0]
        plan = plan_state_sharding(model, mesh, math.inf, bandwidth=dict.fromkeys(mesh, 1e9),
                                   param_dtype=None)
        mem = plan.find(sharding).memory_per_rank
        assert mem["params"] == mem["grads"] == sum(c for c, _ in units) * 4
        largest = sorted((b for _, b in units), reverse=True)
        chunk_of_largest = max(units, key=lambda u: u[1])[0]
        assert mem["buffers"] == (largest[0] + largest[1] + largest[0]) * 4 + chunk_of_largest * 4


def _nested_runtime_bytes(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    from ragged_placement.fsdp import MixedPrecisionPolicy, fully_shard
    from ragged_placement.models.gpt import GPT, GPTConfig

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("inter", "intra"))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    out = {}
    for name, sharding in (("amsp", AMSP), ("zero1", StateSharding.zero1(MESH))):
        with torch.device("meta"):
            model = GPT(GPTConfig(vocab_size=100, n_layer=3, n_head=2, n_embd=42))
        for module in (*model.layers, model):
            fully_shard(module, mesh=mesh, mp_policy=mp, state_sharding=sharding)
        model.to_empty(device="cpu")
        held = 0
        for _, unit in model.fsdp_units():
            for b in unit.buffers:
                kept = b.comm.param_chunk
                held += b.sharded.numel() * 4 + kept.numel() * kept.element_size()
        out[name] = held
    return out


AMSP = StateSharding(params=("intra",), grads=("inter", "intra"), optim=("inter", "intra"))


@pytest.mark.multiprocess
def test_memory_matches_the_state_sharded_runtime():
    """Parameter memory under AMSP and zero1 (bf16 gathers from fp32): the optimizer chunks and
    the parameter chunks (zero1: unsharded buffers) the runtime keeps, on rank 0 of 2x2."""
    from ragged_placement.models.gpt import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=100, n_layer=3, n_head=2, n_embd=42))
    plan = plan_state_sharding(model, MESH, math.inf, bandwidth=BW, param_dtype=torch.bfloat16)
    held = run_gloo(_nested_runtime_bytes, 4)[0]
    assert plan.find(AMSP).memory_per_rank["params"] == held["amsp"]
    assert plan.find(StateSharding.zero1(MESH)).memory_per_rank["params"] == held["zero1"]


def test_optimizer_state_per_optimizer():
    units = [[("m", (4, 2048)), ("n", (2048,))]]
    numel = 4 * 2048 + 2048
    one = {"dp": 1}  # one rank: everything whole
    zero = StateSharding.zero3(one)

    def plan(units, **kw):
        return plan_state_sharding(units, one, math.inf, bandwidth={"dp": 1e9}, **kw)

    got = {opt: plan(units, optimizer=opt, param_dtype=None).find(zero).memory_per_rank["optim"]
           for opt in ("adamw", "sgd", "muon", "shampoo")}
    assert got["adamw"] == 2 * numel * 4
    assert got["sgd"] == numel * 4
    assert got["muon"] == 4 * 2048 * 4 + 2 * 2048 * 4
    # Shampoo, blocks of at most 1024: the matrix is one 4-row span x two 1024-column spans,
    # each block holding L, L_root (4 x 4) and R, R_root (1024 x 1024) in fp32; Adam grafting
    # keeps 2 fp32 moments of every element
    blocks = 2 * (2 * 4 * 4 + 2 * 1024 * 1024) * 4
    assert got["shampoo"] == blocks + 2 * numel * 4
    bf16 = [[(n, s, torch.bfloat16) for n, s in units[0]]]
    assert plan(bf16, param_dtype=None).find(zero).memory_per_rank["optim"] == 2 * numel * 2


# -- the communication model --------------------------------------------------------------------
def test_comm_bytes_per_dim_match_the_formula():
    units = [[("w", (16, 8))]]  # 128 elements, chunk 32 at W=4
    plan = _plan(units, param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                 latency={"inter": 1e-3, "intra": 0.0})
    z3 = _candidate(plan, StateSharding.zero3(MESH))
    # one ring over 4 ranks, charged to inter: 2 all-gathers 3 x 32 x 2 B, reduce-scatter 3 x 32 x 4 B
    assert z3.comm_bytes == {"inter": 2 * 3 * 32 * 2 + 3 * 32 * 4, "intra": 0}
    assert z3.comm_seconds["inter"] == pytest.approx(768 / 1e9 + 1e-3 * 9)
    # each collective's own time: the reduce-scatter's 3 x 32 x 4 B and 3 ring steps
    (rs,) = [k for k in z3.collectives if k.op == "reduce_scatter"]
    assert rs.seconds == pytest.approx(384 / 1e9 + 1e-3 * 3)
    assert sum(k.seconds for k in z3.collectives) == pytest.approx(z3.comm_seconds["inter"])
    assert _candidate(plan, StateSharding.zero3(MESH), False).comm_bytes["inter"] == 3 * 32 * 2 + 3 * 32 * 4
    hsdp = _candidate(plan, StateSharding.hsdp(MESH, "intra"))
    # intra: 2 all-gathers 1 x 64 x 2 B + reduce-scatter 1 x 64 x 4 B; inter: all-reduce of
    # the 64-element fp32 shard over 2 ranks, 2 (n - 1) / n x 256 B, 2 ring steps
    assert hsdp.comm_bytes == {"inter": 256, "intra": 256 + 256}
    assert hsdp.comm_seconds["inter"] == pytest.approx(256 / 1e9 + 2e-3)
    assert hsdp.comm_seconds["intra"] == pytest.approx(512 / 1e10)
    amsp = _candidate(plan, StateSharding(("intra",), ("inter", "intra"), ("inter", "intra")))
    # intra as HSDP; inter: reduce-scatter 1 x 32 x 4 B, then the all-gather of the updated
    # parameters in the gather dtype (bf16) 1 x 32 x 2 B: less than HSDP's all-reduce
    assert amsp.comm_bytes == {"inter": 128 + 64, "intra": 512}
    zero1 = _candidate(plan, StateSharding.zero1(MESH))
    # the whole fp32 gradient all-reduced over 4 ranks, the bf16 update all-gathered (chunk 32)
    assert zero1.comm_bytes == {"inter": int(2 * 3 / 4 * 128 * 4) + 3 * 32 * 2, "intra": 0}


def test_ranking_and_choice():
    units = [[("w", (64, 64))] for _ in range(4)]
    plan = _plan(units)
    cands = plan.candidates
    # 4**2 chains less all-replicated, 7 of them gather parameters (raf True/False)
    assert len(cands) == 15 + 7
    assert len({(c.sharding, c.reshard_after_forward) for c in cands}) == len(cands)
    totals = [c.comm_seconds_total for c in cands]
    assert totals == sorted(totals)
    # no budget: the least traffic; a flat all-reduce over both dims (DDP) crosses inter with
    # the whole gradient, AMSP's two-level reduction with a quarter each way
    amsp = StateSharding(("intra",), ("inter", "intra"), ("inter", "intra"))
    assert plan.sharding == amsp and plan.reshard_after_forward is False
    assert plan.comm_seconds == plan.choice.comm_seconds
    assert len(plan.table().splitlines()) == len(cands) + 2
    # a budget below the choice's memory picks the fastest candidate that fits
    ddp = plan.choice.memory_total
    tight = _plan(units, memory_budget=ddp - 1)
    fitting = [c for c in cands if c.memory_total <= ddp - 1]
    best = min(fitting, key=lambda c: (c.comm_seconds_total, c.memory_total))
    assert tight.choice.memory_total <= ddp - 1
    assert tight.choice.comm_seconds_total == best.comm_seconds_total
    assert [c.fits for c in tight.candidates] == sorted((c.fits for c in tight.candidates), reverse=True)


def test_partitioner_errors():
    units = [[("w", (16, 8))]]
    least = min(c.memory_total for c in _plan(units).candidates)
    with pytest.raises(ValueError, match=rf"memory_budget=.*least memory found is {least:.4g}"):
        _plan(units, memory_budget=least - 1)
    _plan(units, memory_budget=least)
    with pytest.raises(ValueError, match=r"optimizer 'lion'.*\('adamw', 'sgd', 'muon', 'shampoo'\)"):
        _plan(units, optimizer="lion")
    with pytest.raises(ValueError, match=r"bandwidth must give one value per mesh dim.*missing \['intra'\]"):
        _plan(units, bandwidth={"inter": 1e9})
    with pytest.raises(ValueError, match=r"bandwidth\['intra'\] must be a positive"):
        _plan(units, bandwidth={"inter": 1e9, "intra": 0})
    with pytest.raises(ValueError, match="latency"):
        _plan(units, latency=-1.0)
    with pytest.raises(ValueError, match="needs mesh to be a DeviceMesh"):
        _plan(units, bandwidth="profile")
    with pytest.raises(ValueError, match="memory_budget must be a positive"):
        _plan(units, memory_budget=0)
    with pytest.raises(ValueError, match=r"\(name, shape\)"):
        _plan([[("w", "16x8")]])
    with pytest.raises(ValueError, match="mesh"):
        plan_state_sharding(units, {"inter": 0}, 1e9)
    with pytest.raises(ValueError, match="units is for an nn.Module"):
        plan_state_sharding(units, MESH, 1e9, bandwidth=BW, units=[nn.Linear(2, 2)])


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 8)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(_Block() for _ in range(3))


class _MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(16, 4, bias=False)
        self.experts = nn.ModuleList(nn.Linear(16, 16, bias=False) for _ in range(4))


def _same_candidates(a, b) -> None:
    assert len(a.candidates) == len(b.candidates)
    for ca, cb in zip(a.candidates, b.candidates):
        assert (ca.sharding, ca.memory_per_rank, ca.comm_bytes) == \
            (cb.sharding, cb.memory_per_rank, cb.comm_bytes)


def test_module_input_groups_units_as_fully_shard():
    with torch.device("meta"):
        model = _Model()
    named = [[("lin.weight", (8, 16)), ("lin.bias", (8,))] for _ in range(3)]
    named.append([("emb.weight", (32, 16))])
    _same_candidates(_plan(model), _plan(named))
    # nested ModuleLists: each expert is a unit inside its layer's unit (innermost owns)
    with torch.device("meta"):
        moe = nn.Sequential(nn.Embedding(8, 16), nn.ModuleList(_MoE() for _ in range(2)))
    nested = [[("router.weight", (4, 16))] if k == 0 else [("weight", (16, 16))]
              for _ in range(2) for k in range(5)]
    _same_candidates(_plan(moe), _plan(nested + [[("emb.weight", (8, 16))]]))
    # a unit of two dtypes is planned per dtype, as the runtime's FSDPUnit (a FlatBuffer per dtype)
    mixed = _plan([[("w", (16, 8)), ("n", (8,), torch.bfloat16)]])
    z3 = mixed.find(StateSharding.zero3(MESH)).memory_per_rank
    assert z3["params"] == 32 * 4 + 2 * 2  # 32 fp32 and 2 bf16 elements per rank


KIMI_K2 = {"hidden": 7168, "layers": 61, "dense_layers": 1, "intermediate": 18432,
           "moe_intermediate": 2048, "experts": 384, "shared_experts": 1, "heads": 64,
           "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
           "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab": 163840}


def test_plans_a_1t_moe_on_16384_ranks():
    """The timing is a benchmark (benchmarks/state_sharding.py --planner); this checks it runs."""
    units = fsdp_units("kimi-k2", KIMI_K2)
    assert sum(math.prod(s) for _, u in units for _, s in u) > 1e12
    for mesh, bw in (({"inter": 2048, "intra": 8}, {"inter": 50e9, "intra": 450e9}),
                     ({"nodes": 2048, "groups": 2, "gpus": 4},
                      {"nodes": 50e9, "groups": 450e9, "gpus": 450e9})):
        t0 = time.perf_counter()
        plan = plan_state_sharding(units, mesh, math.inf, bandwidth=bw)
        print(f"kimi-k2 on {mesh}: {time.perf_counter() - t0:.3f} s")
        assert len(plan.candidates) > 4 ** len(mesh)


# -- "profile" on 4 gloo ranks ------------------------------------------------------------------
def _profile_rank(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("inter", "intra"))
    named = {"inter": 2, "intra": 2}
    same = all(getattr(StateSharding, f)(mesh) == getattr(StateSharding, f)(named)
               for f in ("zero1", "zero2", "zero3", "default"))
    plan = plan_state_sharding([[("w", (64, 64))]] * 2, mesh, math.inf, bandwidth="profile")
    return same, plan.bandwidth, plan.latency, str(plan.sharding), plan.profiled


@pytest.mark.multiprocess
def test_profile_fits_positive_finite_bandwidths_on_gloo():
    results = run_gloo(_profile_rank, 4)
    for same, bw, lat, _, profiled in results:
        assert same
        assert set(bw) == {"inter", "intra"}
        assert all(math.isfinite(v) and v > 0 for v in bw.values()), bw
        assert all(math.isfinite(v) and v >= 0 for v in lat.values()), lat
        # each dim and the pair, each a (bandwidth, latency) fit; the dims' are bw / lat
        assert set(profiled) == {("inter",), ("intra",), ("inter", "intra")}
        assert all(math.isfinite(b) and b > 0 and math.isfinite(t) and t >= 0
                   for b, t in profiled.values()), profiled
        assert {d: profiled[(d,)] for d in bw} == {d: (bw[d], lat[d]) for d in bw}
    # every rank fits the same numbers and plans the same
    assert len({(tuple(r[1].items()), tuple(r[2].items()), r[3]) for r in results}) == 1


def _shrinking_then_growing(bad_attempts: int):
    """A stand-in for ``profile._timed`` (installed once, for every rank thread): each thread's
    first ``bad_attempts`` measurements shrink with the bytes (a burst of load), later ones
    grow."""
    import threading

    from ragged_placement.planner import profile

    calls = threading.local()
    per_attempt = 2 * len(profile.PROFILE_NUMELS["cpu"])

    def timed(fn, device, reps):
        del fn, device, reps
        i = getattr(calls, "n", 0)
        calls.n = i + 1
        attempt, k = divmod(i, per_attempt)
        return 1.0 / (k + 1) if attempt < bad_attempts else 1e-4 * (k // 2 + 1)

    return timed


def _profile_rank_threads(rank, world_size):
    from torch.distributed.device_mesh import DeviceMesh

    from ragged_placement.planner import profile

    mesh = DeviceMesh("cpu", list(range(world_size)), mesh_dim_names=("dp",))
    try:
        return profile.profile_mesh(mesh)
    except RuntimeError as exc:
        return str(exc)


def test_profile_measures_again_when_a_burst_of_load_inverts_the_times(monkeypatch):
    """A measurement whose times shrink with the bytes (seen on a loaded 2-core machine, where
    it failed torchtitan's auto-planned run) is taken again; every rank retries alike (the
    times are all-reduced first), and only :data:`PROFILE_ATTEMPTS` bad ones in a row raise."""
    from ragged_placement.planner import profile

    monkeypatch.setattr(profile, "_timed", _shrinking_then_growing(profile.PROFILE_ATTEMPTS - 1))
    for fits in run_threaded(_profile_rank_threads, 2):
        assert not isinstance(fits, str), fits
        (bandwidth, latency), = fits.values()
        assert bandwidth > 0 and latency >= 0
    monkeypatch.setattr(profile, "_timed", _shrinking_then_growing(profile.PROFILE_ATTEMPTS))
    for msg in run_threaded(_profile_rank_threads, 2):
        assert "do not grow with the bytes" in msg and "pass bandwidth explicitly" in msg, msg
