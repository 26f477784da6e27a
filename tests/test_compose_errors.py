"""fully_shard rejects meshes and plans it cannot compose with, naming the argument (4 threaded ranks)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_threaded
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
            lambda: fully_shard(_colwise(8, mesh), mesh=mesh["tp"]), r"mesh .* must be disjoint"
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
