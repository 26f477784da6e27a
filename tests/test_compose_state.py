"""load_state_dict into FSDP x TP parameters on (dp=2, tp=2), 4 threaded ranks: from full tensors
(each rank cuts its TP shard, then its RaggedShard run) and from DTensors of another 2-D layout
(redistributed); ``full_tensor()`` of every parameter must give the loaded values back."""

from __future__ import annotations

import torch
from dist_utils import run_threaded
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor

from ragged_placement.fsdp import fully_shard
from ragged_placement.models.llama import Llama, LlamaConfig, parallelize_llama

CFG = LlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, hidden_dim=24)


def _load(rank: int, world_size: int, init, full, replicated) -> dict[str, list[bool]]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = Llama(CFG)
    model.load_state_dict(init)
    parallelize_llama(model, mesh["tp"])
    for block in model.layers.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])

    def matches(expected):
        got = model.state_dict()
        return [torch.equal(got[k].full_tensor(), v) for k, v in expected.items()]

    out = {"init": matches(init)}
    model.load_state_dict(full)
    out["full"] = matches(full)
    model.load_state_dict(
        {k: distribute_tensor(v, mesh, [Replicate(), Replicate()]) for k, v in replicated.items()}
    )
    out["dtensor"] = matches(replicated)
    return out


def test_load_full_and_redistributed_state_into_fsdp_tp():
    states = []
    for seed in range(3):
        torch.manual_seed(seed)
        states.append(Llama(CFG).state_dict())
    for r in run_threaded(_load, 4, *states):
        assert all(r["init"]) and all(r["full"]) and all(r["dtensor"]), r
