"""load_state_dict into FSDP x TP parameters on (dp=2, tp=2), 4 threaded ranks: from full tensors
(each rank cuts its TP shard, then its RaggedShard run) and from DTensors of another 2-D layout
(redistributed); ``full_tensor()`` of every parameter must give the loaded values back."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_threaded
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor

from ragged_placement.fsdp import fully_shard
from ragged_placement.models.llama import Llama, LlamaConfig
from ragged_placement.parallelize import parallelize_llama

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


def _state_sharded_tp(rank: int, world_size: int, init, sharding: str | None) -> tuple:
    """4 AdamW steps of the Llama, tensor parallel over ``tp`` and ``fully_shard`` over
    ``mesh["dp"]`` with ``StateSharding.<sharding>(mesh["dp"])`` (``None``: without one):
    the losses (mean over the ranks) and the full parameters."""
    from common.compose import CFG as TRAIN_CFG
    from common.compose import full_state_of, llama_batches, mean_over_ranks, train_llama

    from ragged_placement.fsdp import StateSharding

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = Llama(TRAIN_CFG)
    model.load_state_dict(init)
    parallelize_llama(model, mesh["tp"])
    dp = mesh["dp"]
    kwargs = {} if sharding is None else {"state_sharding": getattr(StateSharding, sharding)(dp)}
    for block in model.layers.values():
        fully_shard(block, mesh=dp, **kwargs)
    fully_shard(model, mesh=dp, **kwargs)
    d, half = dp.get_local_rank(), 2
    losses = train_llama(model, [b[d * half:(d + 1) * half] for b in llama_batches()[:4]], clip=False)
    return mean_over_ranks(losses), full_state_of(model)


def test_zero1_and_zero2_over_dp_compose_with_tensor_parallel_exactly():
    """``state_sharding`` zero1 / zero2 on ``mesh["dp"]`` of a ``(dp, tp)`` mesh, the blocks
    tensor parallel over ``tp``: the losses and parameters of the plain FSDP x TP run (bitwise)
    and of one process (losses within 1e-5, parameters 1e-4: Adam's normalized update turns
    summation-order noise in near-zero gradients into ~lr*1e-3, as in tests/compose/test_compose.py)."""
    from common.compose import CFG as TRAIN_CFG
    from common.compose import llama_batches, train_llama

    torch.manual_seed(0)
    init = Llama(TRAIN_CFG).state_dict()
    ref_model = Llama(TRAIN_CFG)
    ref_model.load_state_dict(init)
    ref_losses = train_llama(ref_model, llama_batches()[:4], clip=False)
    plain = run_threaded(_state_sharded_tp, 4, init, None)
    for sharding in ("zero1", "zero2"):
        for (losses, full), (plain_losses, plain_full) in zip(
            run_threaded(_state_sharded_tp, 4, init, sharding), plain
        ):
            assert losses == pytest.approx(ref_losses, abs=1e-5), sharding
            assert losses == plain_losses, sharding
            for k, v in ref_model.state_dict().items():
                torch.testing.assert_close(full[k], v, atol=1e-4, rtol=0, msg=f"{sharding} {k}")
                assert torch.equal(full[k], plain_full[k]), (sharding, k)
