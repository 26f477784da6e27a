"""FSDP2 behaviours that torch's own FSDP2 tests check (docs/conformance.md), ours side by side
with torch's ``fully_shard`` on the same model and data."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from common_fsdp import train_steps
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
    """torch's ``test_param_registration_after_forward`` and more: what ``parameters()`` and an
    attribute read give after a forward (two inner units and the root), for each
    ``reshard_after_forward``, and after ``reshard()``; the values are the reference's
    throughout; whether the kept units still hold their gathered storage."""
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
        # what the forward computes with: a kept unit's attribute reads give its gathered one
        attrs = [model[1].in_proj.weight, model[0].in_proj.weight]
        attrs_ok = all(torch.equal(_full([a])[0], b) for a, b in zip(
            attrs, [ref[1].in_proj.weight, ref[0].in_proj.weight]))
        held = [a.untyped_storage().size() > 0 for a in attrs if not isinstance(a, DTensor)]
        for m in model.modules():
            if isinstance(m, (FSDPModule, torch.distributed.fsdp.FSDPModule)):
                m.reshard()
        seen[raf] = (_kinds(inner), _kinds(root), values_ok, _kinds(model.parameters()),
                     _kinds(attrs[:1]), _kinds(attrs[1:]), attrs_ok, all(held),
                     _kinds([model[1].in_proj.weight]))
    return seen


def test_parameters_between_forward_and_backward_are_the_sharded_ones(one_torch_thread):
    """After a forward, ``parameters()`` gives the sharded DTensors for every unit, whatever its
    ``reshard_after_forward``; a unit keeping its gathered buffer (the root, and the units with
    ``False``) keeps it in memory, as FSDP2's does, and shows its unsharded parameters to
    attribute reads (a loss computed after forward from them). FSDP2 registers those unsharded
    parameters in ``parameters()`` (torch's ``test_param_registration_after_forward``), where an
    optimizer built from them never trains (the test below). ``reshard()`` leaves the sharded
    ones to both."""
    dtensor, tensor = {"dtensor"}, {"tensor"}
    # (inner parameters(), root parameters(), values, after reshard(), root attribute, inner
    # attribute, attribute values, kept storage allocated, root attribute after reshard())
    fsdp2 = {
        True: (dtensor, dtensor, True, dtensor, dtensor, dtensor, True, True, dtensor),
        False: (tensor, tensor, True, dtensor, tensor, tensor, True, True, dtensor),
        2: (dtensor, dtensor, True, dtensor, dtensor, dtensor, True, True, dtensor),
        None: (dtensor, tensor, True, dtensor, tensor, dtensor, True, True, dtensor),
    }
    ours = {
        True: (dtensor, dtensor, True, dtensor, tensor, dtensor, True, True, dtensor),
        False: (dtensor, dtensor, True, dtensor, tensor, tensor, True, True, dtensor),
        2: (dtensor, dtensor, True, dtensor, tensor, dtensor, True, True, dtensor),
        None: (dtensor, dtensor, True, dtensor, tensor, dtensor, True, True, dtensor),
    }
    for runtime, expected in (("fsdp2", fsdp2), ("ours", ours)):
        for seen in run_threaded(_registration, WORLD, runtime):
            assert seen == expected, runtime


def _two_mlps() -> nn.Sequential:
    """Two MLPs with the same weights every call, drawn once in the importing thread."""
    model = nn.Sequential(MLP(), MLP())
    model.load_state_dict(_TWO_MLPS)
    return model


with torch.random.fork_rng():
    torch.manual_seed(0)
    _TWO_MLPS = nn.Sequential(MLP(), MLP()).state_dict()


def _optimizer_after_forward(rank: int, ws: int, runtime: str, after: str) -> list[float]:
    """An AdamW built from ``model.parameters()`` ``after`` a forward with grad enabled whose
    output is dropped (a validation forward), or after ``unshard()``; then 5 steps on this
    rank's rows. Returns the global losses."""
    model = _two_mlps()  # rank threads share torch's global RNG: no draws from it here
    shard, mesh = SHARD[runtime], DeviceMesh("cpu", list(range(ws)))
    shard(model[0], mesh=mesh)
    shard(model, mesh=mesh)  # the root holds model[1]'s parameters
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 4 * ws, 8, generator=g), torch.randn(6, 4 * ws, 8, generator=g)
    if after == "forward":
        model(x[5])
    else:
        model.unshard()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return train_steps(model, opt, zip(x[:5], y[:5]), rank, ws,
                       loss_fn=lambda m, a, b: F.mse_loss(m(a), b))


def test_an_optimizer_built_after_a_forward_trains_as_one_process(one_torch_thread):
    """The validation forward: ``torch.optim.AdamW(model.parameters())`` built between a
    forward and its backward. Ours trains exactly as one process doing the same; FSDP2's
    optimizer holds the root's unsharded copies and never trains them (its losses drift)."""
    ref = _two_mlps()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 4 * WORLD, 8, generator=g), torch.randn(6, 4 * WORLD, 8, generator=g)
    ref(x[5])
    ref_losses = train_steps(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2),
                             zip(x[:5], y[:5]), loss_fn=lambda m, a, b: F.mse_loss(m(a), b))
    for losses in run_threaded(_optimizer_after_forward, WORLD, "ours", "forward"):
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-6, (losses, ref_losses)
    for losses in run_threaded(_optimizer_after_forward, WORLD, "fsdp2", "forward"):
        assert abs(losses[-1] - ref_losses[-1]) > 1e-3, (losses, ref_losses)


def _step_after_unshard(rank: int, ws: int) -> str:
    with pytest.raises(ValueError) as e:
        _optimizer_after_forward(rank, ws, "ours", "unshard")
    return str(e.value)


def test_an_optimizer_built_after_unshard_raises(one_torch_thread):
    """``FSDPModule.unshard()`` registers the unsharded parameters, as FSDP2's: an optimizer
    built from them raises at its first ``step()`` naming the parameter (FSDP2's would step
    copies that never train), before it changes anything."""
    for msg in run_threaded(_step_after_unshard, WORLD):
        assert "holds the unsharded parameter '1.in_proj.weight'" in msg, msg
        assert "after FSDPModule.unshard()" in msg and "after reshard()" in msg, msg


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
