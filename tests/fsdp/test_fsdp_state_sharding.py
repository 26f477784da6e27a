"""``fully_shard(state_sharding=...)`` (issue 25's runtime) on 4 gloo ranks as a 2x2 mesh: every
named point and AMSP train to one process's parameters (and FSDP2's, where FSDP2 has the
configuration), hold 1/|state dims| of each state, never read a stale parameter, and issue the
collectives of :mod:`ragged_placement.fsdp.nested` per mesh dim."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from common.state_sharding import (
    BATCH,
    BOTH,
    MLP,
    SHARDINGS,
    STEPS,
    TOL,
    mlp_adamw,
    mlp_data,
    mlp_reference,
)
from common_fsdp import train_steps
from dist_utils import run_gloo
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

from ragged_placement.fsdp import StateSharding, fully_shard

AFTER_FORWARD = ("zero1", "zero2", "zero3", "hsdp", "amsp")


def _shard(m: MLP, mesh, runtime: str, sharding: StateSharding | None) -> None:
    for sub in (m.a, m.b, m):
        if runtime == "ours":
            fully_shard(sub, mesh=mesh, state_sharding=sharding)
        else:
            fsdp2_fully_shard(sub, mesh=mesh)


def _train(rank: int, ws: int, mesh, runtime: str, sharding: StateSharding | None,
           after_forward: bool = False):
    """``STEPS`` AdamW steps on this rank's share of the batch, then, with no backward: the
    eval output on ``x[STEPS]`` and the full state dict (both right after ``step()``). With
    ``after_forward``, the optimizer is built after a forward with grad enabled whose output
    is dropped (a validation forward: it changes nothing on one process)."""
    init, x, y = mlp_data()
    m = MLP()
    m.load_state_dict(init)
    _shard(m, mesh, runtime, sharding)
    if after_forward:
        m(x[STEPS])
    opt = mlp_adamw(m.parameters())
    per = BATCH // ws
    rows = slice(rank * per, (rank + 1) * per)
    for s in range(STEPS):
        F.mse_loss(m(x[s, rows]), y[s, rows]).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        out = m(x[STEPS])
    full = {k: v.full_tensor() for k, v in m.state_dict().items()}
    local = {k: v.to_local().numel() for k, v in m.named_parameters()}
    return m, opt, out, full, local


def _counts(m: MLP) -> dict[tuple[str, tuple[str, ...]], int]:
    """Collectives per mesh-dim set over the whole run, summed over the units."""
    out: dict[tuple[str, tuple[str, ...]], int] = {}
    for unit in (m.a._fsdp_state.unit, m.b._fsdp_state.unit, m._fsdp_state.unit):
        for key, (n, _) in unit.stats.by_dims.items():
            out[key] = out.get(key, 0) + n
    return out


def _one_rank_touches(m: MLP, rank: int) -> torch.Tensor:
    """Rank 0 alone takes a state dict and writes a parameter (with its own value): the ranks
    agree to refresh at the next forward (no rank left waiting), whose output is returned."""
    x = mlp_data()[1][STEPS]
    with torch.no_grad():
        m(x)  # refreshes after the state dict _train took on every rank
        if rank == 0:
            m.state_dict()
            m.b.weight.mul_(1.0)
        return m(x)


def _every_point(rank: int, ws: int):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=BOTH)
    results = {}
    for name, sharding in SHARDINGS.items():
        m, opt, out, full, local = _train(rank, ws, mesh, "ours", sharding)
        state = [t.to_local().numel() for st in opt.state.values() for t in st.values() if t.ndim]
        results[name] = (out, full, local, sum(state), _counts(m))
        if name == "amsp":
            results["amsp_one_rank"] = _one_rank_touches(m, rank)
    for name in AFTER_FORWARD:
        results[f"{name}_after_forward"] = _train(rank, ws, mesh, "ours", SHARDINGS[name],
                                                  after_forward=True)[2:5]
    results["fsdp2_after_forward"] = _train(rank, ws, mesh, "fsdp2", None, after_forward=True)[2:5]
    results["fsdp2"] = _train(rank, ws, init_device_mesh("cpu", (4,)), "fsdp2", None)[2:5]
    results["fsdp2_hsdp"] = _train(rank, ws, mesh, "fsdp2", None)[2:5]
    return results


def _expected_counts(sharding: StateSharding) -> dict[tuple[str, tuple[str, ...]], int]:
    """Collectives per dim set over ``STEPS`` steps plus one eval forward, for the 3 units:
    all-gathers over params in forward and backward (none for params=(); the root keeps its
    parameters for backward), a refresh over optim \\ params before each step's first forward
    and the eval forward, and the reductions once per step."""
    p = sharding.params
    g = tuple(d for d in sharding.grads if d not in p)
    refresh = tuple(d for d in sharding.optim if d not in p)
    rest = tuple(d for d in BOTH if d not in sharding.grads)
    out = {}
    if p:
        out[("all_gather", p)] = (2 * 2 + 1) * STEPS + 3  # a, b twice, root once; eval: 3
        out[("reduce_scatter", p)] = 3 * STEPS
    if refresh:
        out[("all_gather", refresh)] = 3 * (STEPS + 1)
    if g:
        out[("reduce_scatter", g)] = 3 * STEPS
    if rest:
        out[("all_reduce", rest)] = 3 * STEPS
    return out


def test_expected_counts_cover_every_point():
    # a non-default point records what it issues (checked on 4 ranks by the test below)
    assert _expected_counts(SHARDINGS["amsp"]) == {
        ("all_gather", ("intra",)): 28, ("reduce_scatter", ("intra",)): 15,
        ("all_gather", ("inter",)): 18, ("reduce_scatter", ("inter",)): 15,
    }


@pytest.fixture(scope="module")
def every_point():
    return run_gloo(_every_point, 4)


@pytest.mark.multiprocess
def test_an_optimizer_built_after_a_forward_trains_as_one_process_on_every_point(every_point):
    """An AdamW built from ``model.parameters()`` after a forward with grad and before any
    backward (a validation forward) holds the sharded parameters on every point, and trains
    them exactly as one process (the root kept its gather from that forward: the next forward
    re-gathers). FSDP2's HSDP holds the root's unsharded copies there and never trains them."""
    ref, ref_out = mlp_reference()
    for name in AFTER_FORWARD:
        for results in every_point:
            out, full, *_ = results[f"{name}_after_forward"]
            torch.testing.assert_close(out, ref_out, atol=TOL, rtol=0, msg=f"{name} eval out")
            for k, v in ref.items():
                torch.testing.assert_close(full[k], v, atol=TOL, rtol=0, msg=f"{name} {k}")
    for results in every_point:
        _, full, *_ = results["fsdp2_after_forward"]
        assert (full["c.weight"] - ref["c.weight"]).abs().max() > 1e-3  # the root's own


@pytest.mark.multiprocess
def test_every_point_matches_one_process_and_fsdp2_on_2x2(every_point):
    """Parameters after 5 AdamW steps, an eval forward and the state dict right after
    step(), the optimizer shard's size and the collectives per mesh dim, for every point."""
    ref, ref_out = mlp_reference()
    numel = sum(v.numel() for v in ref.values())
    ranks = every_point
    for results in ranks:
        torch.testing.assert_close(results["amsp_one_rank"], ref_out, atol=TOL, rtol=0)
    for name in [*SHARDINGS, "fsdp2", "fsdp2_hsdp"]:
        for rank, results in enumerate(ranks):
            out, full, *_ = results[name]
            torch.testing.assert_close(out, ref_out, atol=TOL, rtol=0, msg=f"{name} eval out")
            for k, v in ref.items():
                torch.testing.assert_close(full[k], v, atol=TOL, rtol=0, msg=f"{name} {k}")
    # each rank's optimizer shard: a 1/|optim| share of the parameters (summed over the ranks
    # of one optim group: every element once); AdamW's two moments per element
    for name, sharding in SHARDINGS.items():
        groups = 4 // (2 ** len(sharding.optim))
        local = sum(sum(r[name][2].values()) for r in ranks)
        assert local == numel * groups, name
        assert sum(r[name][3] for r in ranks) == 2 * numel * groups, name
        if not sharding.is_default({"inter": 2, "intra": 2}):
            assert all(r[name][4] == _expected_counts(sharding) for r in ranks), name


# -- FP8 units: the refresh and the all-gathers move FP8 blocks and scales ----------------------
def _fp8_rank(rank: int, ws: int, steps: int) -> dict[str, tuple[list[float], dict]]:
    from common.fp8 import QUANT, SEQ, fp8_corpus, fp8_gpt

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=BOTH)
    out = {}
    for name in ("amsp", "zero2"):
        m = fp8_gpt()
        for sub in (*m.layers, m):
            fully_shard(sub, mesh=mesh, quant=QUANT, state_sharding=SHARDINGS[name])
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        batches = (fp8_corpus().batch(s, 8, SEQ) for s in range(steps))
        losses = train_steps(m, opt, batches, rank, ws)
        unit = m.layers[0]._fsdp_state.unit
        b = unit.buffers[0]
        chunk = b.comm.chunk.numel() if b.comm.chunk is not None else None
        out[name] = (losses, dict(unit.stats.by_dims), b.gather.gathered_nbytes, chunk)
    return out


@pytest.mark.multiprocess
def test_fp8_units_under_amsp_and_zero2_match_one_process_fp8():
    from common.fp8 import GRAD_TOL, LOSS_TOL, fp8_reference

    steps = 4
    ref, _ = fp8_reference(steps, 8)
    for results in run_gloo(_fp8_rank, 4, steps):
        for name, (losses, by_dims, nbytes, chunk) in results.items():
            assert losses[0] == pytest.approx(ref[0], abs=GRAD_TOL), name  # same FP8 weights
            assert losses == pytest.approx(ref, abs=LOSS_TOL), name
            # every parameter all-gather of the block moves its FP8 bytes and scales: over
            # intra (forward, backward) for AMSP, and the refreshes (before the first forward,
            # then issued by each step) assemble a
            # parameter chunk (AMSP: half of the sends, as large as the larger half; uneven
            # chunks) or the whole buffer (zero2)
            gathers = {dims: v for (kind, dims), v in by_dims.items() if kind == "all_gather"}
            if name == "amsp":
                assert gathers[("intra",)] == [2 * steps, 2 * steps * nbytes]
                assert gathers[("inter",)] == [steps + 1, (steps + 1) * chunk]
                assert nbytes // 2 <= chunk <= 1.01 * nbytes / 2
            else:
                assert gathers == {BOTH: [steps + 1, (steps + 1) * nbytes]}


# -- process groups in the nested layout's rank order on torch without sort_ranks (2.11) --------
def _group_in_order_without_sort_ranks(rank: int, ws: int) -> tuple[list[int], list[int]]:
    import torch.distributed as dist

    from ragged_placement import _compat

    real = dist.new_group

    def old_new_group(ranks=None, use_local_synchronization=False):  # torch 2.11's signature
        return real(ranks, use_local_synchronization=use_local_synchronization)

    dist.new_group = old_new_group
    keeps_order = _compat._NEW_GROUP_SORT_RANKS  # read from c10d's own new_group, not this one
    _compat._NEW_GROUP_SORT_RANKS = False
    try:
        group = _compat.new_group_in_order([0, 2, 1, 3])
    finally:
        dist.new_group = real
        _compat._NEW_GROUP_SORT_RANKS = keeps_order
    out = [torch.zeros(1) for _ in range(ws)]
    dist.all_gather(out, torch.tensor([float(rank)]), group=group)
    return dist.get_process_group_ranks(group), [int(x) for x in out]


@pytest.mark.multiprocess
def test_groups_keep_the_given_rank_order_without_sort_ranks():
    for ranks, gathered in run_gloo(_group_in_order_without_sort_ranks, 4):
        assert ranks == gathered == [0, 2, 1, 3]
