"""fully_shard rejects meshes and plans it cannot compose with, naming the argument (4 threaded ranks)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import COLLECTIVES, recording_collectives, run_threaded
from ragged_placement.planner import Granularity
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from ragged_placement.fsdp import fully_shard
from ragged_placement.placement import RaggedShard


def _mesh():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _colwise(out_features: int, mesh) -> nn.Module:
    lin = nn.Linear(8, out_features, bias=False)
    parallelize_module(lin, mesh["tp"], ColwiseParallel())
    return lin


def _raises(fn, match: str) -> str:
    with pytest.raises(ValueError, match=match) as info:
        fn()
    return str(info.value)


def _cases(rank: int, world_size: int) -> list[str]:
    torch.manual_seed(0)
    mesh = _mesh()
    msgs = []
    # The planner's 24-row bands of the 32-row TP-local shard straddle the TP shards.
    msgs.append(
        _raises(
            lambda: fully_shard(
                _colwise(64, mesh), mesh=mesh["dp"], granularity=Granularity.rows(24)
            ),
            r"granularity rows\(24\).* of parameter weight: its 24-row blocks straddle",
        )
    )
    # 33 output rows do not split evenly over tp=2.
    msgs.append(
        _raises(
            lambda: fully_shard(_colwise(33, mesh), mesh=mesh["dp"]),
            r"parameter weight .* unevenly",
        )
    )
    # A RaggedShard already on the tp dim: not a dim the planner planned.
    lin = nn.Linear(8, 8, bias=False)
    lin.weight = nn.Parameter(
        distribute_tensor(lin.weight.detach(), mesh["tp"], [RaggedShard((0,), (1, 3))])
    )
    msgs.append(
        _raises(
            lambda: fully_shard(lin, mesh=mesh["dp"]), r"parameter weight has RaggedShard.*'tp'"
        )
    )
    # Partial TP parameters are not a layout fully_shard composes with.
    lin = nn.Linear(8, 8, bias=False)
    lin.weight = nn.Parameter(
        DTensor.from_local(lin.weight.detach(), mesh["tp"], [Partial()], run_check=False)
    )
    msgs.append(
        _raises(
            lambda: fully_shard(lin, mesh=mesh["dp"]), r"parameter weight has placement Partial"
        )
    )
    # The TP mesh and the FSDP mesh must be disjoint sub-meshes of one root.
    msgs.append(
        _raises(
            lambda: fully_shard(_colwise(8, mesh), mesh=mesh["tp"]),
            r"tensor-parallel over mesh dim\(s\) \['tp'\].* cannot be a data-parallel",
        )
    )
    other = init_device_mesh("cpu", (4,), mesh_dim_names=("flat",))
    msgs.append(
        _raises(lambda: fully_shard(_colwise(8, mesh), mesh=other), r"mesh .* must be disjoint")
    )
    # Meshes of more than 2 dims.
    cube = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("a", "b", "c"))
    msgs.append(
        _raises(lambda: fully_shard(nn.Linear(4, 4), mesh=cube), r"mesh must be a 1-D .* or 2-D")
    )
    # Two TP meshes in one unit.
    seq = nn.Sequential(_colwise(8, mesh), nn.Linear(8, 8, bias=False))
    alt = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp2"))
    parallelize_module(seq[1], alt["tp2"], ColwiseParallel())
    msgs.append(
        _raises(lambda: fully_shard(seq, mesh=mesh["dp"]), r"different tensor-parallel meshes")
    )
    return msgs


def test_bad_meshes_and_plans_raise_value_error():
    msgs = run_threaded(_cases, 4)
    assert all(m == msgs[0] for m in msgs)  # every rank raises the same errors


def _before_any_collective(rank: int, world_size: int, record) -> list[str]:
    """fully_shard of a block tensor-parallel over ``tp`` on the whole ``(dp, tp)`` mesh
    (plain, and with a state_sharding over both dims or over ``dp``), and on a meta-device
    mesh: each a ``ValueError`` before this rank issued any collective or created a group."""
    from torch.distributed.device_mesh import DeviceMesh

    from ragged_placement.fsdp import StateSharding

    mesh = _mesh()
    meta = DeviceMesh("meta", list(range(world_size)))
    cases = [
        (lambda: fully_shard(_colwise(8, mesh), mesh=mesh), "tensor-parallel over mesh dim"),
        (lambda: fully_shard(_colwise(8, mesh), mesh=mesh,
                             state_sharding=StateSharding.zero1(mesh)), "mesh=mesh\\['dp'\\]"),
        (lambda: fully_shard(_colwise(8, mesh), mesh=mesh, state_sharding=StateSharding(
            params=("dp",), grads=("dp",), optim=("dp", "tp"))), "cannot be a data-parallel"),
        (lambda: fully_shard(nn.Linear(4, 4), mesh=meta), "device type 'meta'"),
    ]
    msgs = []
    for fn, match in cases:
        before = sum(r == rank for calls in record.calls.values() for r in calls)
        msgs.append(_raises(fn, match))
        assert sum(r == rank for calls in record.calls.values() for r in calls) == before, match
    return msgs


def test_tp_dim_as_sharding_dim_and_meta_mesh_raise_before_any_collective():
    with recording_collectives((*COLLECTIVES, "new_group")) as record:
        msgs = run_threaded(_before_any_collective, 4, record)
    assert all(m == msgs[0] for m in msgs)
    assert "a tensor-parallel dim cannot be a data-parallel (sharding) dim" in msgs[0][0]
    assert "use a mesh on 'cpu' or an accelerator" in msgs[0][3]
