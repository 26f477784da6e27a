"""The RaggedShard type, its errors, and upstream DTensor redistribute-test patterns.

The second half follows the assertion patterns of PyTorch's own
``test/distributed/tensor/test_redistribute.py`` (shard/replicate/partial round trips with
autograd, uneven sizes), with RaggedShard in place of Shard.
"""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor

from dist_utils import run_threaded
from ragged_placement import RaggedShard

warnings.filterwarnings("ignore", category=FutureWarning)


def test_is_a_placement_immutable_hashable():
    p = RaggedShard((0,), (1, 2, 1, 0))
    assert isinstance(p, Placement)
    assert not (p.is_shard() or p.is_replicate() or p.is_partial())
    assert p == RaggedShard([0], [1, 2, 1, 0]) and hash(p) == hash(RaggedShard((0,), (1, 2, 1, 0)))
    assert p != RaggedShard((0,), (1, 2, 0, 1)) and p != Shard(0)
    assert repr(p) == "RaggedShard(dims=(0,), local_units=(1, 2, 1, 0))"
    assert pickle.loads(pickle.dumps(p)) == p and copy.deepcopy(p) is p
    with pytest.raises(AttributeError):
        p.local_units = (4,)
    assert {p: 1}[RaggedShard((0,), (1, 2, 1, 0))] == 1


def test_geometry_matches_the_definition():
    p = RaggedShard((0,), (1, 2, 1, 0))
    assert p.row_ranges((8, 5)) == [(0, 2), (2, 6), (6, 8), (8, 8)]
    assert p.local_shape((8, 5), 1) == (4, 5) and p.local_shape((8, 5), 3) == (0, 5)
    q = RaggedShard((0, 1), (1, 1))  # every local shard's numel is a multiple of k
    assert [q.local_shape((3, 4, 7), r) for r in range(2)] == [(6, 7), (6, 7)]


@pytest.mark.parametrize(
    "dims, units, match",
    [
        ((1,), (1, 1), "dims must be a non-empty prefix"),
        ((0, 2), (1, 1), "dims must be a non-empty prefix"),
        ((), (1,), "dims must be a non-empty prefix"),
        ((0,), (), "local_units must have one entry per rank"),
        ((0,), (1, -1), "local_units must be non-negative"),
        ((0,), (0, 0), "local_units must have at least one positive entry"),
        ((0,), (1.5, 1), "local_units must contain only ints"),
        ("x", (1,), "dims must contain only ints"),
    ],
)
def test_bad_arguments_raise_value_error(dims, units, match):
    with pytest.raises(ValueError, match=match):
        RaggedShard(dims, units)


def _bad_inputs(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    t = torch.randn(6, 3)
    errors = {}
    cases = {
        "units length vs mesh": lambda: distribute_tensor(t, mesh, [RaggedShard((0,), (1, 1, 1))]),
        "prefix not divisible": lambda: distribute_tensor(t, mesh, [RaggedShard((0,), (1, 1, 1, 1))]),
        "dims longer than tensor": lambda: distribute_tensor(t, mesh, [RaggedShard((0, 1, 2), (1, 1, 1, 1))]),
        "placements vs mesh ndim": lambda: distribute_tensor(t, mesh, [RaggedShard((0,), (1, 1, 1, 3)), Replicate()]),
        "from_local without shape and zero units": lambda: DTensor.from_local(
            t[:2] if rank == 0 else t[:0], mesh, [RaggedShard((0,), (2, 0, 0, 0))]),
        "from_local units vs mesh": lambda: DTensor.from_local(t, mesh, [RaggedShard((0,), (1, 1))], shape=(6, 3),
                                                               stride=(3, 1)),
    }
    for name, fn in cases.items():
        try:
            fn()
        except ValueError as e:
            errors[name] = str(e)
    d = distribute_tensor(torch.randn(8, 3), mesh, [RaggedShard((0,), (1, 1, 1, 1))])
    try:
        torch.cumsum(d, 0)  # a scan over the ragged rows: no rule (matmul has one now)
    except (NotImplementedError, RuntimeError) as e:
        errors["op without rule"] = str(e)
    try:
        d.redistribute(mesh, [RaggedShard((0,), (3, 3, 3))])
    except (ValueError, RuntimeError) as e:
        errors["redistribute units vs mesh"] = str(e)
    return errors


def test_bad_inputs_raise_clear_errors_on_every_rank_without_hanging():
    results = run_threaded(_bad_inputs, 4, timeout=60)
    for errors in results:  # every rank raises (before any collective): nothing hangs
        assert set(errors) == {
            "units length vs mesh", "prefix not divisible", "dims longer than tensor", "placements vs mesh ndim",
            "from_local without shape and zero units", "from_local units vs mesh", "op without rule",
            "redistribute units vs mesh",
        }, errors
        assert "local_units has 3 entries but the mesh dim (mesh dim 0) has 4 ranks" in errors["units length vs mesh"]
        assert "not divisible by sum(local_units)=4" in errors["prefix not divisible"]
        assert "needs shape= and stride=" in errors["from_local without shape and zero units"]
        assert "aten.cumsum" in errors["op without rule"] and "RaggedShard" in errors["op without rule"]


# ---- upstream test_redistribute.py patterns, RaggedShard in place of Shard ----------------------
def _upstream_patterns(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(0)  # the same tensors on every rank, as upstream's seeded ranks
    # shard -> replicate, forward and backward, including uneven sizes (zero units on a rank)
    for rows in (8, 12, 16):
        units = (1, 2, 1, 0) if rows == 8 else (rows // 4, 0, rows // 4, rows // 2)
        expected = torch.randn(rows, 3, generator=g).requires_grad_()
        placement = RaggedShard((0,), units)
        sharded = distribute_tensor(expected, mesh, [placement])
        assert sharded.placements == (placement,)
        replica = sharded.redistribute(mesh, [Replicate()])
        assert replica.size() == expected.size()
        assert torch.equal(replica.to_local(), expected)
        replica.to_local().sum().backward()
        # distribute_tensor makes a new leaf; the gradient comes back in the leaf's placement
        assert sharded.grad is not None and sharded.grad.placements == (placement,)
        assert torch.equal(sharded.grad.full_tensor(), torch.ones_like(expected))
    # replicate -> shard: a local slice, no communication; gradient flows back as Replicate
    local = torch.randn(12, 3, generator=g).requires_grad_()
    replica = DTensor.from_local(local, mesh, [Replicate()], run_check=False)
    placement = RaggedShard((0,), (3, 0, 2, 1))
    sharded = replica.redistribute(mesh, [placement])
    assert torch.equal(sharded.to_local(), local[placement.local_row_range((12, 3), rank)[0]:
                                                placement.local_row_range((12, 3), rank)[1]])
    sharded.to_local().sum().backward()
    assert torch.equal(local.grad, torch.ones_like(local))
    # partial -> replicate and partial -> shard (reduce-scatter)
    partial_local = torch.ones(12, 3)
    partial = DTensor.from_local(partial_local, mesh, [Partial()])
    assert torch.equal(partial.redistribute(mesh, [Replicate()]).to_local(), partial_local * world_size)
    sharded = partial.redistribute(mesh, [placement])
    start, end = placement.local_row_range((12, 3), rank)
    assert torch.equal(sharded.to_local(), torch.full((end - start, 3), float(world_size)))
        # shard <-> RaggedShard with autograd in both directions
    x = torch.randn(12, 3, generator=g).requires_grad_()
    s = distribute_tensor(x, mesh, [Shard(0)])
    r = s.redistribute(mesh, [placement])
    (r * r).sum().backward()
    assert s.grad.placements == (Shard(0),)  # back through the all-to-all to Shard(0)
    torch.testing.assert_close(s.grad.full_tensor(), 2 * x.detach())
    return True


def test_upstream_redistribute_patterns_with_ragged_shard():
    assert all(run_threaded(_upstream_patterns, 4))
