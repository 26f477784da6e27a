"""FSDP2 behaviours that torch's own FSDP2 tests check (docs/conformance.md), ours side by side
with torch's ``fully_shard`` on the same model and data."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_threaded
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from ragged_placement.fsdp import FSDPModule, fully_shard
from ragged_placement.planner import Granularity

WORLD = 4
SHARD = {"ours": fully_shard, "fsdp2": torch_fully_shard}


class MLP(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, 4 * dim)
        self.out_proj = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.relu(self.in_proj(x)))


def _kinds(params) -> set[str]:
    return {"dtensor" if isinstance(p, DTensor) else "tensor" for p in params}


def _full(params) -> list[torch.Tensor]:
    return [p.full_tensor() if isinstance(p, DTensor) else p.detach().clone() for p in params]


def _registration(rank: int, ws: int, runtime: str) -> dict:
    """torch's ``test_param_registration_after_forward``: what ``parameters()`` gives after a
    forward (root only, then two inner units and the root), for each ``reshard_after_forward``,
    and after ``reshard()``; the values are the reference's throughout."""
    shard, mesh = SHARD[runtime], DeviceMesh("cpu", list(range(ws)))
    x = torch.randn(2, 8)
    seen = {}
    for raf in (True, False, 2, None):
        ref = nn.Sequential(MLP(), MLP())
        for p in ref.parameters():  # threaded ranks share one generator: rank 0's values
            dist.broadcast(p.detach(), src=0)
        model = copy.deepcopy(ref)
        shard(model[0].in_proj, mesh=mesh, reshard_after_forward=raf)
        shard(model[0].out_proj, mesh=mesh, reshard_after_forward=raf)
        shard(model, mesh=mesh, reshard_after_forward=raf)
        model(x)
        inner = list(model[0].in_proj.parameters()) + list(model[0].out_proj.parameters())
        root = [p for p in model.parameters() if all(p is not q for q in inner)]
        values_ok = all(
            torch.equal(a, b) for a, b in zip(_full(model.parameters()), ref.parameters())
        )
        for m in model.modules():
            if isinstance(m, (FSDPModule, torch.distributed.fsdp.FSDPModule)):
                m.reshard()
        seen[raf] = (_kinds(inner), _kinds(root), values_ok, _kinds(model.parameters()))
    return seen


def test_parameters_registered_after_forward_are_fsdp2s(one_torch_thread):
    """As FSDP2: after a forward, a unit with ``reshard_after_forward=False`` and a root left at
    the default ``None`` register their unsharded parameters (plain tensors), the others the
    sharded DTensors; ``reshard()`` registers the sharded ones again."""
    expected = {
        True: ({"dtensor"}, {"dtensor"}, True, {"dtensor"}),
        False: ({"tensor"}, {"tensor"}, True, {"dtensor"}),
        2: ({"dtensor"}, {"dtensor"}, True, {"dtensor"}),
        None: ({"dtensor"}, {"tensor"}, True, {"dtensor"}),
    }
    for runtime in ("fsdp2", "ours"):
        for seen in run_threaded(_registration, WORLD, runtime):
            assert seen == expected, runtime


def _optimizer_on_unsharded(rank: int, ws: int) -> tuple[bool, bool, str]:
    """An optimizer built from ``parameters()`` between forward and backward (the root's
    unsharded ones) refuses to step; ``state_dict()`` there gives the sharded parameters."""
    torch.manual_seed(0)
    model = MLP()
    fully_shard(model, mesh=DeviceMesh("cpu", list(range(ws))))
    loss = model(torch.randn(2, 8)).sum()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sd_sharded = all(isinstance(v, DTensor) for v in model.state_dict().values())
    loss.backward()  # state_dict() registered the sharded ones: backward registers again
    after = all(isinstance(p, DTensor) for p in model.parameters())
    with pytest.raises(ValueError, match="holds the unsharded parameter 'in_proj.weight'") as e:
        opt.step()
    return sd_sharded, after, str(e.value)


def test_optimizer_built_from_unsharded_parameters_raises(one_torch_thread):
    for sd_sharded, after, msg in run_threaded(_optimizer_on_unsharded, WORLD):
        assert sd_sharded and after
        assert "Build the optimizer before the first forward" in msg


class Experts(nn.Module):
    """A stack of 2 experts (fewer than the 4 ranks) and a router, as torchtitan's MoE."""

    def __init__(self, dim: int = 8, experts: int = 2) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.w = nn.Parameter(torch.randn(experts, dim, 2 * dim) / dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.softmax(self.router(x), dim=-1)
        return torch.einsum("be,beh->bh", gate, torch.einsum("bd,edh->beh", x, self.w).tanh())


def _shard_dim1(param: nn.Parameter):
    from torch.distributed.tensor import Shard

    return Shard(1) if param.ndim > 1 else Shard(0)


def _train_shard_dim1(rank: int, ws: int, runtime: str, make) -> dict:
    """torch's ``test_shard_placement_fn_contiguous_params_grads`` and a training run: every
    parameter ``Shard(1)`` (the 1-D ones ``Shard(0)``), 5 Adam steps."""
    model, gen = make(), torch.Generator().manual_seed(0)
    with torch.no_grad():  # the same values on every rank thread and in both runs
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    mesh = DeviceMesh("cpu", list(range(ws)))
    for m in model.modules():
        if isinstance(m, nn.Linear):
            SHARD[runtime](m, mesh=mesh, shard_placement_fn=_shard_dim1)
    SHARD[runtime](model, mesh=mesh, shard_placement_fn=_shard_dim1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(5):
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(100 + step * ws + rank))
        loss = model(x).sum()
        loss.backward()
        contiguous = all(
            t.is_contiguous()
            for p in model.parameters()
            for t in (p, p.to_local(), p.grad, p.grad.to_local())
        )
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    return {
        "losses": losses,
        "params": _full(model.parameters()),
        "contiguous": contiguous,
        "empty_ranks": [p.to_local().numel() == 0 for p in model.parameters()],
    }


@pytest.mark.parametrize("make", (MLP, Experts), ids=("mlp", "experts"))
def test_shard_placement_fn_shard_dim1_trains_as_fsdp2(make, one_torch_thread):
    """``Shard(1)`` from ``shard_placement_fn``: ours trains to FSDP2's losses and parameters,
    with contiguous parameters and gradients; an expert stack of fewer experts than ranks is
    spread over every rank (cut between the rows of each expert)."""
    theirs = run_threaded(_train_shard_dim1, WORLD, "fsdp2", make)
    ours = run_threaded(_train_shard_dim1, WORLD, "ours", make)
    for o, t in zip(ours, theirs):
        assert o["contiguous"] and t["contiguous"]
        assert o["losses"] == pytest.approx(t["losses"], abs=1e-5)
        for a, b in zip(o["params"], t["params"]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    if make is Experts:
        assert not any(o["empty_ranks"][1] for o in ours)  # w: a piece on every rank


def test_shard_placement_fn_shard_dim1_with_granularity_raises():
    with pytest.raises(AssertionError, match="granularity=.* is given too: .* pass one of them"):
        run_threaded(_shard_with_both, 2)


def _shard_with_both(rank: int, ws: int) -> None:
    fully_shard(
        MLP(), mesh=DeviceMesh("cpu", list(range(ws))), shard_placement_fn=_shard_dim1,
        granularity=Granularity.row(),
    )


def _accumulated_grads(rank: int, ws: int, runtime: str) -> list[torch.Tensor]:
    """bf16 compute, fp32 reduction, 4 micro-batches with gradient sync on the last only (torch's
    ``test_grad_acc_with_reduce_dtype``): the full gradients after the sync."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model, gen = nn.Sequential(MLP(16), MLP(16)), torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / 4)
    mesh, mp = DeviceMesh("cpu", list(range(ws))), MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32
    )
    for m in model:
        SHARD[runtime](m, mesh=mesh, mp_policy=mp)
    SHARD[runtime](model, mesh=mesh, mp_policy=mp)
    x = torch.randn(4, 3, 16, generator=torch.Generator().manual_seed(1 + rank))
    for i in range(4):
        model.set_requires_gradient_sync(i == 3)
        model(x[i]).sum().backward()
    return [p.grad.full_tensor() for p in model.parameters()]


def test_micro_batches_accumulate_in_reduce_dtype_as_fsdp2(one_torch_thread):
    """Without gradient sync, each micro-batch's bf16 gradients are added into an fp32
    accumulator (FSDP2's ``unsharded_accumulated_grad``), not summed in bf16 (7e-5 off)."""
    theirs = run_threaded(_accumulated_grads, 2, "fsdp2")[0]
    ours = run_threaded(_accumulated_grads, 2, "ours")[0]
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@dataclasses.dataclass
class _Batch:
    x: torch.Tensor


class _DataclassInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, batch: _Batch) -> torch.Tensor:
        return self.lin(batch.x)


def _dataclass_input_cast(rank: int, ws: int, runtime: str) -> torch.dtype:
    """torch's ``test_dataclass_input``: ``cast_forward_inputs`` reaches a dataclass's tensors."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = _DataclassInput()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=True)
    SHARD[runtime](model, mesh=DeviceMesh("cpu", list(range(ws))), mp_policy=mp)
    out = model(_Batch(torch.randn(2, 8)))
    out.sum().backward()
    return out.dtype


def test_forward_inputs_in_a_dataclass_are_cast_as_fsdp2(one_torch_thread):
    for runtime in ("fsdp2", "ours"):
        assert run_threaded(_dataclass_input_cast, 2, runtime) == [torch.bfloat16] * 2, runtime
