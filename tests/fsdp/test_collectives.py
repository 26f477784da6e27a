"""The segment collectives of :mod:`ragged_placement.fsdp.collectives` on real gloo ranks.

A unit of several equal segments is reduce-scattered on gloo as one packed collective (a staging
buffer filled by FSDP2's copy-in op, :func:`ragged_placement.fsdp.collectives._packed_sizes`) instead of
one per segment; all-gathers stay coalesced and zero-copy. Every gloo reduce-scatter (a sum) is
an all-to-all and a local sum (``_gloo.reduce_scatter_by_all_to_all``: gloo's own
reduce-scatter is a whole all-reduce), checked against gloo's at an odd world size.
Both paths must give the same results (the gathers bitwise; the reductions up to the rounding of
the summation order): each is compared with the other on the same inputs, and
the packed one issues one c10d op per call and counts its copies in ``LayoutCopyMeter``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from dist_utils import run_gloo
from ragged_placement.fsdp import collectives
from ragged_placement.testing.profiling import LayoutCopyMeter
from ragged_placement.planner.plan import Segment

pytestmark = pytest.mark.multiprocess

WORLD = 2  # the packing does not depend on the world size; 2 processes start twice as fast
# three equal segments tiling the chunk in order (the shape of a GPT block's plan), and the same
# segments listed out of chunk order (not packed: the staging layout needs the chunk order)
SIZES = (3, 7, 2)
TILED = tuple(
    Segment(sum(SIZES[:k]), WORLD * sum(SIZES[:k]), c) for k, c in enumerate(SIZES)
)
SHUFFLED = (TILED[1], TILED[0], TILED[2])


def _inputs(rank: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(rank)
    chunk = torch.randn(sum(SIZES), generator=gen)
    grads = [torch.randn(WORLD * c, generator=gen) for c in SIZES]
    return chunk, grads


def _run(segments, packed: bool, async_op: bool):
    rank = dist.get_rank()
    chunk, grads = _inputs(rank)
    by_segment = {id(s): g for s, g in zip(TILED, grads)}
    inputs = [by_segment[id(s)] for s in segments]
    gathered = torch.full((WORLD * sum(SIZES),), float("nan"))
    reduced = torch.full((sum(SIZES),), float("nan"))
    original = collectives._packed_sizes
    if not packed:
        collectives._packed_sizes = lambda segments, group: None
    try:
        with CommDebugMode() as comm, LayoutCopyMeter() as copies:
            work = collectives.all_gather_segments(gathered, chunk, segments, WORLD, async_op=async_op)
            if async_op:
                work.wait()
            work = collectives.reduce_scatter_segments(reduced, inputs, segments, WORLD,
                                                   async_op=async_op)
            if async_op:
                work.wait()
    finally:
        collectives._packed_sizes = original
    ops = {str(k).rsplit(".", 1)[-1]: v for k, v in comm.get_comm_counts().items()}
    return gathered, reduced, ops, copies.total


def _compare(rank: int, ws: int):
    out = {}
    for name, segments in (("tiled", TILED), ("shuffled", SHUFFLED)):
        for async_op in (False, True):
            packed = _run(segments, True, async_op)
            coalesced = _run(segments, False, async_op)
            assert torch.equal(packed[0], coalesced[0]), (name, async_op, packed[0], coalesced[0])
            # gloo's two reduce-scatters sum in different orders: equal up to rounding
            torch.testing.assert_close(packed[1], coalesced[1], rtol=1e-6, atol=1e-6)
            out[(name, async_op)] = (packed[2], packed[3])
    # the reference: every rank's chunk in place, the sum of every rank's gradient chunk
    chunks = [_inputs(r)[0] for r in range(ws)]
    expect = torch.cat([
        torch.cat([c[s.chunk_offset:s.chunk_offset + s.chunk_numel] for c in chunks])
        for s in TILED
    ])
    gathered, reduced, _, _ = _run(TILED, True, False)
    assert torch.equal(gathered, expect)
    mine = [sum(_inputs(r)[1][k].view(ws, -1)[rank] for r in range(ws)) for k in range(len(SIZES))]
    torch.testing.assert_close(reduced, torch.cat(mine))
    out["mixed"] = _mixed_parts(rank, ws)
    out["gloo"] = _gloo_reduce_scatter(rank, ws)
    out["threads"] = _gloo_threads(ws)
    return out


# dtype pairs of a unit with several dtypes, both orders: gloo's coalesced all-gather corrupts
# mixed element sizes unless the largest comes first, so the parts are gathered as bytes
MIXED = ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
         (torch.float32, torch.float64), (torch.float64, torch.float32))


def _mixed_parts(rank: int, ws: int) -> dict:
    """Per dtype pair: the c10d ops of ``all_gather_parts`` / ``reduce_scatter_parts`` over two
    parts of those dtypes (the first of TILED's segments, the second one segment), and whether
    their results equal one ``*_segments`` call per part, bitwise."""
    out = {}
    for d1, d2 in MIXED:
        gen = torch.Generator().manual_seed(rank)
        chunks = [torch.randn(sum(SIZES), generator=gen).to(d1),
                  torch.randn(5, generator=gen).to(d2)]
        grads = [[torch.randn(WORLD * c, generator=gen).to(d1) for c in SIZES],
                 [torch.randn(WORLD * 5, generator=gen).to(d2)]]
        segments = [TILED, (Segment(0, 0, 5),)]
        results = []
        for coalesced in (True, False):
            gathered = [torch.full((WORLD * c.numel(),), float("nan"), dtype=c.dtype)
                        for c in chunks]
            reduced = [torch.full_like(c, float("nan")) for c in chunks]
            with CommDebugMode() as comm:
                if coalesced:
                    collectives.all_gather_parts(list(zip(gathered, chunks, segments)), WORLD)
                    collectives.reduce_scatter_parts(list(zip(reduced, grads, segments)), WORLD)
                else:
                    for args in zip(gathered, chunks, segments):
                        collectives.all_gather_segments(*args, WORLD)
                    for args in zip(reduced, grads, segments):
                        collectives.reduce_scatter_segments(*args, WORLD)
            results.append((gathered + reduced, comm.get_comm_counts()))
        (ours, ops), (theirs, _) = results
        ops = {str(k).rsplit(".", 1)[-1]: v for k, v in ops.items()}
        out[(d1, d2)] = (ops, [torch.equal(a, b) for a, b in zip(ours, theirs)])
    return out


def test_packed_segments_match_coalesced_ones_with_one_op_and_counted_copies():
    results = run_gloo(_compare, WORLD)
    numel = WORLD * sum(SIZES)
    for out in results:
        for async_op in (False, True):
            ops, copied = out[("tiled", async_op)]
            assert ops == {"allgather_into_tensor_coalesced_": 1, "alltoall_base_": 1}
            assert copied == numel * 4  # the reduce-scatter's staging: its input, once
            ops, copied = out[("shuffled", async_op)]
            # not packed: one all-to-all per segment (no coalescing manager holds them)
            assert ops == {"allgather_into_tensor_coalesced_": 1, "alltoall_base_": 3}
            assert copied == 0
        # two parts of different dtypes: one coalesced all-gather, one all-to-all per part (the
        # first part packed), the same results as a call per part
        for pair, (ops, equal) in out["mixed"].items():
            assert ops == {"allgather_into_tensor_coalesced_": 1, "alltoall_base_": 2}, pair
            assert equal == [True] * 4, pair
        _check_gloo_reduce_scatter(out["gloo"])
        # gloo groups created inside one_worker_gloo (run_gloo's ranks) run one worker thread
        # (torch's two race on a string and free it twice); fully_shard warns on a group that
        # runs two
        ours, theirs, warned = out["threads"]
        assert ours == [1, 1, 1] and theirs == 2
        assert len(warned) == 1 and "inside `with ragged_placement.one_worker_gloo():`" in warned[0]


def _gloo_reduce_scatter(rank: int, ws: int) -> dict:
    """``reduce_scatter_single`` (an all-to-all on gloo) against gloo's own reduce-scatter
    (``_compat._reduce_scatter``) on the same inputs; the meter's and CommDebugMode's view."""
    from ragged_placement import _compat
    from ragged_placement.testing.profiling import CollectiveMeter

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(ws * 1000, generator=gen).to(dtype)
        before = x.clone()
        theirs = torch.empty(1000, dtype=dtype)
        _compat._reduce_scatter(theirs, x, group=None)
        for async_op in (False, True):
            ours = torch.full((1000,), float("nan"), dtype=dtype)
            with CommDebugMode() as comm, CollectiveMeter() as meter:
                work = _compat.reduce_scatter_single(ours, x, async_op=async_op)
                if async_op:
                    assert not work.is_completed()  # the sum waits for wait()
                    work.wait()
                    assert work.is_completed() and work.wait()
            ops = {str(k).rsplit(".", 1)[-1]: v for k, v in comm.get_comm_counts().items()}
            out[(dtype, async_op)] = (ours, theirs, torch.equal(x, before), ops,
                                      meter.counts["reduce_scatter"],
                                      meter.counts["reduce_scatter_bytes"])
        # the exact sum of this rank's chunk over ranks (the inputs as they were), in float64
        inputs = [torch.randn(ws * 1000, generator=torch.Generator().manual_seed(r)).to(dtype)
                  for r in range(ws)]
        out[dtype] = sum(c.double().view(ws, -1)[rank] for c in inputs)
    return out


def _gloo_threads(ws: int) -> tuple[list[int | None], int | None, list[str]]:
    """The worker threads of gloo groups created inside ``one_worker_gloo`` (the default group,
    a ``new_group``, a mesh's), of one built with torch's own class (as outside it), and the
    warnings ``fully_shard`` gives on a mesh of each (see ``_gloo.one_worker_gloo``)."""
    import warnings

    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    from ragged_placement import _gloo
    from ragged_placement.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (ws,))
    ours = [_gloo.gloo_worker_threads(g)
            for g in (dist.group.WORLD, dist.new_group(list(range(ws))), mesh.get_group())]
    shim, c10d.ProcessGroupGloo = c10d.ProcessGroupGloo, _gloo._GLOO
    try:
        theirs = dist.new_group(list(range(ws)))
    finally:
        c10d.ProcessGroupGloo = shim
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fully_shard(torch.nn.Linear(4, 4), mesh=mesh)
        for _ in range(2):  # once per group
            fully_shard(torch.nn.Linear(4, 4), mesh=DeviceMesh.from_group(theirs, "cpu"))
    warned = [str(w.message) for w in caught if "worker threads" in str(w.message)]
    return ours, _gloo.gloo_worker_threads(theirs), warned


def _check_gloo_reduce_scatter(out: dict) -> None:
    """gloo's sum reduce-scatter: one all-to-all, counted by the meter as one reduce-scatter of
    its input, the input untouched, the sum equal to gloo's own and to the exact one."""
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        for async_op in (False, True):
            ours, theirs, untouched, ops, calls, nbytes = out[(dtype, async_op)]
            assert untouched
            assert ops == {"alltoall_base_": 1}
            assert (calls, nbytes) == (1, WORLD * 1000 * ours.element_size())
            # gloo sums in its ring's order, ours in rank order: equal to rounding (two fp32
            # addends: bitwise)
            torch.testing.assert_close(ours, theirs, rtol=tol, atol=tol)
            assert dtype != torch.float32 or torch.equal(ours, theirs)
            torch.testing.assert_close(ours.double(), out[dtype], rtol=tol, atol=tol)


def _coalescing_decisions(rank: int, ws: int) -> tuple[bool, bool]:
    from ragged_placement._gloo import coalesces_all_gathers

    return (coalesces_all_gathers(None, torch.device("cpu")),
            coalesces_all_gathers(None, torch.device("cuda")))


@pytest.mark.multiprocess
def test_gloo_never_coalesces_all_gathers_of_cuda_tensors():
    """On gloo, several all-gathers of CPU tensors run as one coalesced collective, of CUDA
    tensors one by one: gloo's coalesced all-gather has no CUDA work staging them through host
    memory (CONTRIBUTING.md, "Several ranks on one GPU")."""
    assert run_gloo(_coalescing_decisions, 2) == [(True, False)] * 2


def _groups_outside_the_opt_in(rank: int, ws: int) -> dict:
    """A program that never enters ``one_worker_gloo``: its own groups keep torch's threads,
    the groups this runtime creates run one, torch's class stays in place throughout."""
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.device_mesh import init_device_mesh

    from ragged_placement import _compat, _gloo, one_worker_gloo
    from ragged_placement.fsdp import fully_shard

    torch_class = c10d.ProcessGroupGloo
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    users = [_gloo.gloo_worker_threads(g) for g in (dist.group.WORLD, *mesh.get_all_groups())]
    ordered = _compat.new_group_in_order([3, 2, 1, 0])  # per-state sharding's kind of group
    with one_worker_gloo():
        with one_worker_gloo():  # re-entrant
            inner = dist.new_group(list(range(ws)))
        still_inside = c10d.ProcessGroupGloo is not torch_class
    flat = init_device_mesh("cpu", (ws,))
    model = fully_shard(torch.nn.Linear(8, 8), mesh=flat, reshard_after_forward=2)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()  # the post-forward groups of reshard_after_forward=2 are ours
    from ragged_placement.fsdp.mesh import _POST_FORWARD_GROUPS

    post_forward = [_gloo.gloo_worker_threads(g)
                    for _, groups in _POST_FORWARD_GROUPS.values() for g in groups.values()]
    t = torch.ones(2) * rank
    dist.all_reduce(t, group=ordered)
    return {"users": users, "ordered": _gloo.gloo_worker_threads(ordered), "inner": _gloo.gloo_worker_threads(inner),
            "post_forward": post_forward, "still_inside": still_inside, "sum": t.tolist(),
            "class_restored": c10d.ProcessGroupGloo is torch_class,
            "ordered_ranks": dist.get_process_group_ranks(ordered)}


@pytest.mark.multiprocess
def test_groups_this_runtime_creates_run_one_gloo_worker_and_the_users_keep_torchs():
    for out in run_gloo(_groups_outside_the_opt_in, 4, one_worker=False):
        assert out["users"] == [2, 2, 2], out  # torch's default, untouched
        assert out["ordered"] == 1 and out["inner"] == 1 and out["post_forward"] == [1], out
        assert out["ordered_ranks"] == [3, 2, 1, 0] and out["sum"] == [6.0, 6.0]
        assert out["still_inside"] and out["class_restored"]
