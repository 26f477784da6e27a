"""3-D meshes on 8 gloo ranks, against one process: (pp=2, dp=2, tp=2) with ScheduleGPipe,
HSDP x TP on (replicate=2, shard=2, tp=2), and AMSP (``state_sharding``) x TP on (inter=2,
intra=2, tp=2). One spawn runs all three (8 processes on a small machine)."""

from __future__ import annotations

import pytest
import torch
from common.compose import (
    llama_batches,
    llama_init_state,
    llama_model,
    mean_over_ranks,
    pipeline_losses,
    train_llama,
)
from dist_utils import run_gloo
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import ScheduleGPipe
from torch.distributed.tensor import Replicate, Shard

from ragged_placement.fsdp import StateSharding, fully_shard
from ragged_placement.parallelize import parallelize_llama
from ragged_placement.placement import RaggedShard

pytestmark = pytest.mark.multiprocess


def _pp_dp_tp(rank: int, state) -> list[float]:
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    return pipeline_losses(mesh, state, ScheduleGPipe, 1e-2, tp_mesh=mesh["tp"])


def _dp_tp(state, names: tuple[str, str, str], sharding: StateSharding | None) -> dict:
    """Data parallel over the first two dims of a 2x2x2 ``names`` mesh (``sharding``, or the
    default: HSDP) beside tensor parallel over the last: layout and losses."""
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=names)
    model = llama_model(state)
    parallelize_llama(model, mesh[names[2]])
    dp = mesh[names[0], names[1]]
    for block in model.layers.values():
        fully_shard(block, mesh=dp, state_sharding=sharding)
    fully_shard(model, mesh=dp, state_sharding=sharding)
    r = dp.get_local_rank(0) * 2 + dp.get_local_rank(1)
    wq = model.layers["0"].attention.wq.weight
    return {
        "placements": tuple(wq.placements),
        "mesh": wq.device_mesh.mesh_dim_names,
        # Both tp ranks of a dp rank see its sample: the world mean is the mean over dp.
        "losses": mean_over_ranks(train_llama(model, [b[r : r + 1] for b in llama_batches()], clip=True)),
    }


# AMSP: parameters sharded inside a node, gradients and optimizer state over both
# data-parallel dims; the optimizer ranks are params-major (intra before inter)
AMSP = StateSharding(params=("intra",), grads=("inter", "intra"), optim=("inter", "intra"))


def _worker(rank: int, world_size: int, state) -> dict:
    torch.set_num_threads(1)
    return {"pp_dp_tp": _pp_dp_tp(rank, state),
            "hsdp_tp": _dp_tp(state, ("replicate", "shard", "tp"), None),
            "amsp_tp": _dp_tp(state, ("inter", "intra", "tp"), AMSP)}


def test_pp_dp_tp_hsdp_tp_and_amsp_tp_equal_one_process():
    state = llama_init_state()
    ref_clip = train_llama(llama_model(state), llama_batches(), clip=True)
    ref_noclip = train_llama(llama_model(state), llama_batches(), clip=False)
    ranks = run_gloo(_worker, 8, state)
    last = [r["pp_dp_tp"] for r in ranks if r["pp_dp_tp"]]
    assert len(last) == 4  # the (dp, tp) ranks of the last stage
    for losses in last:
        assert max(abs(a - b) for a, b in zip(losses, ref_noclip)) < 1e-5, (losses, ref_noclip)
    for r in ranks:
        h = r["hsdp_tp"]
        assert h["mesh"] == ("replicate", "shard", "tp")
        assert h["placements"][0] == Replicate() and h["placements"][2] == Shard(0)
        assert isinstance(h["placements"][1], RaggedShard) and h["placements"][1].split_factor == 2
        assert max(abs(a - b) for a, b in zip(h["losses"], ref_clip)) < 1e-5, (
            h["losses"],
            ref_clip,
        )
        a = r["amsp_tp"]
        assert a["mesh"] == ("optim", "tp")  # the optimizer ranks, then tensor parallel
        assert isinstance(a["placements"][0], RaggedShard) and a["placements"][1] == Shard(0)
        assert max(abs(x - y) for x, y in zip(a["losses"], ref_clip)) < 1e-5, (
            a["losses"], ref_clip)
