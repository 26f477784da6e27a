"""FSDP2's per-parameter mesh (``shard_placement_fn`` returning ``ShardPlacementResult``), the
call torchtitan's MoE recipe makes under expert parallelism: the experts of a block sharded over
the ``efsdp`` dim beside ``ep``, the rest of the block over ``fsdp``, in one ``fully_shard`` call.

Ours against torch FSDP2 on the same model, data and calls (4 threaded ranks, EP 2 x efsdp 2),
with ``AdamW(fused=True)`` (torchtitan's default), whose one kernel call then takes parameters of
both meshes.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_threaded
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ragged_placement.fsdp import FSDPModule, fully_shard

# FSDP2's per-parameter result (torch 2.13, in its private module, where torchtitan imports it)
ShardPlacementResult = getattr(
    pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_common"),
    "ShardPlacementResult", None,
)

pytestmark = pytest.mark.skipif(ShardPlacementResult is None, reason="torch < 2.13")

WORLD, EP = 4, 2
E, D, STEPS, PER_RANK = 4, 8, 3, 2
_GEN = torch.Generator().manual_seed(0)
X = torch.randn(STEPS, WORLD * PER_RANK, D, generator=_GEN)


def _init(linear: nn.Linear, seed: int) -> nn.Linear:
    """The same weights on every rank thread (the global generator is shared between them)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(linear.weight.shape, generator=gen) / 3)
        linear.bias.copy_(torch.randn(linear.bias.shape, generator=gen) / 3)
    return linear


class Experts(nn.Module):
    """``E`` stacked ``[D, D]`` experts; every token goes through this rank's local ones."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(E, D, D, generator=torch.Generator().manual_seed(1)) / 3)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        w = self.w.to_local() if isinstance(self.w, DTensor) else self.w  # torchtitan's EP
        return torch.einsum("bd,edf->bf", h, w)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(D, D)
        _init(self.dense, 2)
        self.experts = Experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dense(x)
        return h + self.experts(h)


def _placement_fn(experts: set, expert_mesh, dense_mesh, expert_dim: int = 0):
    """torchtitan's (``apply_fsdp_to_decoder`` with ``ep_degree > 1``): FSDP2's mesh infos;
    ``expert_dim=1`` when efsdp x ep > experts."""
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info

    expert_info, dense_info = _get_mesh_info(expert_mesh, None), _get_mesh_info(dense_mesh, None)
    return lambda p: (
        ShardPlacementResult(Shard(expert_dim), expert_info) if p in experts
        else ShardPlacementResult(Shard(0), dense_info)
    )


def _train(rank: int, ws: int, runtime: str, expert_dim: int = 0):
    sparse = init_device_mesh("cpu", (ws // EP, EP), mesh_dim_names=("efsdp", "ep"))
    dense = init_device_mesh("cpu", (ws,), mesh_dim_names=("fsdp",))
    block = Block()
    block.experts.w = nn.Parameter(distribute_tensor(block.experts.w.data, sparse["ep"], [Shard(0)]))
    model = nn.Sequential(block, _init(nn.Linear(D, 3), 3))
    shard = fully_shard if runtime == "ours" else torch_fully_shard
    fn = _placement_fn({block.experts.w}, sparse["efsdp"], dense, expert_dim)
    shard(block, mesh=dense, shard_placement_fn=fn)
    shard(model, mesh=dense)
    for m in model.modules():  # torchtitan's disable_fsdp_gradient_division; plain sums (the
        if isinstance(m, TorchFSDPModule):  # threaded group has no PREMUL_SUM)
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    expert_w = block.experts.w
    layout = (expert_w.device_mesh.mesh_dim_names, isinstance(block.experts, FSDPModule))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    losses = []
    for s in range(STEPS):
        loss = model(X[s, rank * PER_RANK:(rank + 1) * PER_RANK]).square().sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {k: v.full_tensor().detach().clone() for k, v in model.named_parameters()}
    return losses, params, layout


def test_per_parameter_mesh_trains_as_fsdp2_with_fused_adamw():
    """Experts on (efsdp, ep), the rest on fsdp, in one call: losses and every full parameter
    after 3 fused-AdamW steps equal FSDP2's. Ours used to refuse the ShardPlacementResult, and
    the fused step over both meshes raised IndexError in the pointwise rule."""
    ours = run_threaded(_train, WORLD, "ours")
    fsdp2 = run_threaded(_train, WORLD, "fsdp2")
    for rank, ((losses, params, layout), (ref_losses, ref_params, _)) in enumerate(zip(ours, fsdp2)):
        # ours: the experts are their own unit on the (efsdp, ep) mesh, nested in the block's
        assert layout == (("efsdp", "ep"), True), rank
        assert losses == pytest.approx(ref_losses, abs=1e-6, rel=0), rank
        for k, v in params.items():
            torch.testing.assert_close(v, ref_params[k], atol=1e-6, rtol=0, msg=f"{rank} {k}")


def _refused(rank: int, ws: int, case: str) -> str:
    sparse = init_device_mesh("cpu", (ws // EP, EP), mesh_dim_names=("efsdp", "ep"))
    dense = init_device_mesh("cpu", (ws,), mesh_dim_names=("fsdp",))
    block = Block()
    if case == "root":  # a parameter of the module being sharded itself, on another mesh
        fn = _placement_fn({block.dense.weight}, sparse["efsdp"], dense)
        with pytest.raises(ValueError, match=r"parameter 'weight'.*must belong to a submodule"):
            fully_shard(block.dense, mesh=dense, shard_placement_fn=fn)
    elif case == "mixed":  # one module with parameters on two meshes
        fn = _placement_fn({block.dense.weight}, sparse["efsdp"], dense)
        with pytest.raises(ValueError, match=r"'dense.bias'.*a module's parameters must all be "
                                             r"on one mesh"):
            fully_shard(block, mesh=dense, shard_placement_fn=fn)
    elif case == "dims":  # a 2-D mesh read as 1-D sharding over its dim 1: not fully_shard's
        from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

        info = FSDPMeshInfo(mesh=sparse, shard_mesh_dim=1)
        fn = lambda p: ShardPlacementResult(Shard(0), info) if p is block.experts.w else None
        with pytest.raises(ValueError, match=r"\(shard_mesh_dim, replicate_mesh_dim\) = "
                                             r"\(1, 0\), not \(1, None\)"):
            fully_shard(block, mesh=dense, shard_placement_fn=fn)
    else:  # Shard(1) of the EP-sharded experts (torchtitan's when efsdp x ep > experts)
        block.experts.w = nn.Parameter(
            distribute_tensor(block.experts.w.data, sparse["ep"], [Shard(0)])
        )
        fn = _placement_fn({block.experts.w}, sparse["efsdp"], dense, expert_dim=1)
        with pytest.raises(ValueError, match=r"Shard\(dim=1\) for parameter 'w'.*between whole "
                                             r"dim-0 rows only"):
            fully_shard(block, mesh=dense, shard_placement_fn=fn)
    return case


def test_per_parameter_mesh_that_splits_a_module_raises():
    for case in ("root", "mixed", "dims", "shard1"):
        assert run_threaded(_refused, WORLD, case) == [case] * WORLD
