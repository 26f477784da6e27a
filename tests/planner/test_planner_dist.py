"""The planner's placements on real process groups: a gloo round trip and the consistency check."""

from __future__ import annotations

import fnmatch

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_gloo, run_threaded
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor

import ragged_placement  # noqa: F401  (installs RaggedShard support into DTensor)
from ragged_placement._compat import all_gather_single
from ragged_placement.planner import Granularity, plan

UNIT = {
    "attn.qkv.weight": (24, 8),
    "attn.qkv.bias": (24,),
    "attn.out.weight": (8, 8),
    "norm.weight": (8,),
    "mlp.experts.w1": (3, 12, 8),  # stacked experts, 12 rows: bands of 8 rows are ragged
    "mlp.router.weight": (3, 8),
    "mlp.down.weight": (8, 20),
}
POLICY = {
    "*.experts.*": Granularity.block(8, 8),
    "*.router.*": Granularity.matrix(),
    "*.out.*": Granularity.rows(2, keep_dims_whole=(1,)),
    "*.weight": Granularity.block(4, 4),
}


def _policy(name, shape):
    """POLICY by pattern, skipping block granularity for 1-D tensors."""
    for pattern, g in POLICY.items():
        if fnmatch.fnmatchcase(name, pattern) and (g.kind != "block" or len(shape) >= 2):
            return g
    return Granularity.element()


def _round_trip(rank: int, world: int) -> dict[str, bool]:
    mesh = init_device_mesh("cpu", (world,))
    p = plan(UNIT, world, granularity=_policy, dtype=torch.float32)
    p.check_consistent()
    gen = torch.Generator().manual_seed(1234)
    full = {n: torch.randn(s, generator=gen) for n, s in UNIT.items()}
    # this rank's flat chunk, built from the full tensors at the planned offsets
    s = p.chunk_numel
    chunk = torch.full((s,), float("nan"))
    for n, t in full.items():
        o, flat = p.offsets[n], t.flatten()
        lo, hi = max(o, rank * s), min(o + flat.numel(), (rank + 1) * s)
        if lo < hi:
            chunk[lo - rank * s:hi - rank * s] = flat[lo - o:hi - o]
    views = p.local_views(chunk, rank)
    ok: dict[str, bool] = {}
    for n, t in full.items():
        pl = p.placements[n]
        dt = DTensor.from_local(views[n], mesh, [pl], shape=t.shape, stride=t.stride(), run_check=False)
        ok[f"{n}/view"] = torch.equal(dt.to_local(), pl.shard_local(t, rank).reshape(views[n].shape))
        ok[f"{n}/full_tensor"] = torch.equal(dt.full_tensor(), t)
        ok[f"{n}/distribute"] = torch.equal(distribute_tensor(t, mesh, [pl]).to_local(), views[n])
    # the flat buffer itself: all-gather the chunks and read every parameter at its offset
    gathered = torch.empty(s * world)
    all_gather_single(gathered, chunk.nan_to_num(0.0))
    for n, t in full.items():
        o = p.offsets[n]
        ok[f"{n}/flat"] = torch.equal(gathered[o:o + t.numel()].view(t.shape), t)
    return ok


@pytest.mark.multiprocess
def test_round_trip_on_four_gloo_ranks():
    results = run_gloo(_round_trip, 4)
    for rank, ok in enumerate(results):
        bad = [k for k, v in ok.items() if not v]
        assert not bad, f"rank {rank}: {bad}"
        assert len(ok) == 4 * len(UNIT)


def _consistency(rank: int, world: int):
    shapes = dict(UNIT)
    if rank == 2:
        shapes["norm.weight"] = (9,)  # one rank built its model differently
    p = plan(shapes, world, granularity=_policy)
    try:
        p.check_consistent(dist.group.WORLD)
    except ValueError as exc:
        return str(exc)
    return None


def test_check_consistent_names_the_odd_rank():
    messages = run_threaded(_consistency, 4)
    assert all(m is not None for m in messages)
    assert "ranks [2]" in messages[0] and "ranks [0, 1, 3]" in messages[0]
    agree = run_threaded(lambda r, w: plan(UNIT, w, granularity=_policy).check_consistent(), 4)
    assert agree == [None] * 4
