"""``fully_shard(mesh=spmd_mesh, dp_mesh_dims=...)`` as torch FSDP2's (issue 24): parameters
are DTensors on the full SPMD mesh with ``Replicate()`` on the data-parallel dims, forward runs
on DTensors there; compared with FSDP2 on the same model and data and with one process on the
concatenated batch (4 threaded ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from common_fsdp import mse_loss, train_steps
from dist_utils import run_threaded
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ragged_placement import _compat
from ragged_placement.fsdp import DataParallelMeshDims, fully_shard
from ragged_placement.fsdp import spmd as spmd_mod

pytestmark = pytest.mark.skipif(
    _compat.DataParallelMeshDims is None, reason="torch < 2.13 has no DataParallelMeshDims"
)

WORLD, STEPS, BATCH, D = 4, 3, 8, 4
_GEN = torch.Generator().manual_seed(0)
X = torch.randn(STEPS, BATCH, D, generator=_GEN)
Y = torch.randn(STEPS, BATCH, 3, generator=_GEN)

# mesh shape, dim names, DataParallelMeshDims, each Linear's placements on the non-DP dim
CASES = {
    "hsdp": ((2, 2), ("rep", "shard"), {"shard": "shard", "replicate": "rep"}, None),
    "fsdp": ((4,), ("dp",), {"shard": "dp"}, None),
    "fsdp+tp": ((2, 2), ("dp", "tp"), {"shard": "dp"}, (Shard(0), Shard(1))),
}


_INIT = {k: torch.randn(v, generator=_GEN) for k, v in
         {"0.weight": (6, D), "0.bias": (6,), "2.weight": (3, 6), "2.bias": (3,)}.items()}


def _model() -> nn.Sequential:
    """The same model on every thread (threads share torch's global RNG)."""
    m = nn.Sequential(nn.Linear(D, 6), nn.ReLU(), nn.Linear(6, 3))
    m.load_state_dict(_INIT)
    return m


def _reference() -> dict[str, torch.Tensor]:
    m = _model()
    train_steps(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5), zip(X, Y),
                loss_fn=mse_loss)
    return {k: v.detach() for k, v in m.named_parameters()}


def _distribute(m: nn.Sequential, mesh, tp) -> None:
    """Each parameter as a DTensor on the full mesh: Replicate on the DP dims, ``tp`` (the
    column- then row-wise Linear's weight placement) on the tensor-parallel dim."""
    for i, lin in enumerate((m[0], m[2])):
        for k, p in list(lin._parameters.items()):
            tp_p = () if tp is None else (tp[i] if k == "weight" or i == 0 else Replicate(),)
            placements = [Replicate()] * (mesh.ndim - len(tp_p)) + list(tp_p)
            lin._parameters[k] = nn.Parameter(distribute_tensor(p.detach(), mesh, placements))


def _train(rank: int, ws: int, runtime: str, case: str) -> dict[str, torch.Tensor]:
    shape, names, dims, tp = CASES[case]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    m = _model()
    _distribute(m, mesh, tp)
    fs = fully_shard if runtime == "ours" else torch_fully_shard
    fs(m, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(**dims))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5)
    dp_size = WORLD // (2 if tp else 1)
    dp_rank = rank // (2 if tp else 1)
    per = BATCH // dp_size
    batch = [Shard(0) if n in (dims.get("shard"), dims.get("replicate")) else Replicate()
             for n in names]
    for s in range(STEPS):
        rows = slice(dp_rank * per, (dp_rank + 1) * per)
        x = DTensor.from_local(X[s, rows], mesh, batch)
        y = DTensor.from_local(Y[s, rows], mesh, batch)
        F.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.full_tensor() for k, v in m.named_parameters()}


@pytest.mark.parametrize("case", list(CASES))
def test_dp_mesh_dims_matches_one_process_and_fsdp2(case):
    ref = _reference()
    for runtime in ("ours", "fsdp2"):
        for params in run_threaded(_train, WORLD, runtime, case):
            for k, v in params.items():
                torch.testing.assert_close(v, ref[k], atol=1e-5, rtol=0, msg=f"{runtime} {k}")


def _bad_calls(rank: int, ws: int) -> bool:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    replicated = _model()
    _distribute(replicated, mesh, None)
    bad = [
        (TypeError, r"dp_mesh_dims must be .*'shard'", "shard", replicated),
        (ValueError, r"names 'nope', not a dim", DataParallelMeshDims(shard="nope"), replicated),
        (ValueError, r"\(DDP\) is not supported", DataParallelMeshDims(replicate="rep"),
         replicated),
        (ValueError, r"replicate dim must come before",
         DataParallelMeshDims(shard="rep", replicate="shard"), replicated),
        (ValueError, r"several mesh dims", DataParallelMeshDims(shard=("rep", "shard")),
         replicated),
        (ValueError, r"got Parameter for '0.weight'",
         DataParallelMeshDims(shard="shard", replicate="rep"), _model()),
    ]
    sharded = _model()
    for lin in (sharded[0], sharded[2]):
        lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), mesh,
                                                    [Replicate(), Shard(0)]))
        lin.bias = nn.Parameter(distribute_tensor(lin.bias.detach(), mesh, [Replicate()] * 2))
    bad.append((ValueError, r"'0.weight' has placements .*expected Replicate\(\)",
                DataParallelMeshDims(shard="shard", replicate="rep"), sharded))
    hsdp = DataParallelMeshDims(shard="shard", replicate="rep")
    for exc, match, dims, m, kw in [*[(*b, {}) for b in bad],
                                    (NotImplementedError,
                                     r"reshard_after_forward=2 with dp_mesh_dims",
                                     hsdp, replicated, {"reshard_after_forward": 2})]:
        before = list(m.parameters())
        with pytest.raises(exc, match=match):
            fully_shard(m, mesh=mesh, dp_mesh_dims=dims, **kw)
        assert list(m.parameters()) == before  # nothing replaced
    return True


def test_bad_dp_mesh_dims_raise_naming_the_argument_before_any_collective(monkeypatch):
    assert run_threaded(_bad_calls, WORLD) == [True] * WORLD
    monkeypatch.setattr(spmd_mod, "DataParallelMeshDims", None)  # torch 2.11
    with pytest.raises(TypeError, match=r"dp_mesh_dims needs torch >= 2.13"):
        spmd_mod.check_dp_mesh_dims(None, object())  # refused before the mesh is read


# -- a module computing on its parameter's local tensor (torchtitan's Embedding) -----------------

V, SEQ = 11, 5
TOKENS = torch.randint(0, V, (BATCH, SEQ + 1), generator=_GEN)


class LocalLM(nn.Module):
    """torchtitan's ``Embedding`` (``F.embedding`` on ``weight.to_local()``), an RMSNorm and an
    output layer; ``tied``: the output layer is the embedding, also run on its local tensor."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.tied = tied
        self.emb = nn.Embedding(V, D)
        self.norm = nn.RMSNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = x.to_local() if isinstance(x, DTensor) else x
        h = F.embedding(local, _local(self.emb.weight))
        if isinstance(x, DTensor):
            h = DTensor.from_local(h, x.device_mesh, x.placements)
        h = self.norm(h)
        if not self.tied:
            return self.head(h)
        out = F.linear(_local(h), _local(self.head.weight))
        return DTensor.from_local(out, x.device_mesh, x.placements) if isinstance(x, DTensor) else out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


with torch.random.fork_rng():
    torch.manual_seed(0)
    _LM_INIT = {tied: LocalLM(tied).state_dict() for tied in (False, True)}


def _lm(tied: bool) -> LocalLM:
    m = LocalLM(tied)
    m.load_state_dict(_LM_INIT[tied])
    return m


def _lm_grads(rank: int, ws: int, runtime: str, tied: bool) -> dict[str, torch.Tensor]:
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("dp",))
    m = _lm(tied)
    for mod in (m.emb, m.norm) if tied else (m.emb, m.norm, m.head):
        mod.weight = nn.Parameter(distribute_tensor(mod.weight.detach(), mesh, [Replicate()]))
    if tied:
        m.head.weight = m.emb.weight
    fs = fully_shard if runtime == "ours" else torch_fully_shard
    fs(m, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    m.set_gradient_divide_factor(1.0)  # torchtitan's: the DTensor loss is the global mean
    m.set_force_sum_reduction_for_comms(True)  # threaded ranks: FSDP2 with sums only
    per = BATCH // ws
    rows = slice(rank * per, (rank + 1) * per)
    x = DTensor.from_local(TOKENS[rows, :-1], mesh, [Shard(0)])
    y = DTensor.from_local(TOKENS[rows, 1:], mesh, [Shard(0)])
    F.cross_entropy(m(x).flatten(0, 1), y.flatten()).backward()
    return {k: p.grad.full_tensor() for k, p in m.named_parameters()}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_embedding_on_its_local_tensor_gets_fsdp2s_gradient(tied):
    """``weight.to_local()``'s backward returns the gradient ``Replicate()`` on the DP dim
    though each rank holds its own batch's: it used to be divided by the DP size once more
    when accumulated into the unit's ``Partial()`` gradient (exactly half of FSDP2's on 2
    ranks, issue 34); now each rank's local gradient is reduced, as FSDP2 does."""
    m = _lm(tied)
    F.cross_entropy(m(TOKENS[:, :-1]).flatten(0, 1), TOKENS[:, 1:].flatten()).backward()
    ref = {k: p.grad for k, p in m.named_parameters()}
    for runtime in ("ours", "fsdp2"):
        for grads in run_threaded(_lm_grads, 2, runtime, tied):
            assert grads.keys() == ref.keys()
            for k, g in grads.items():
                torch.testing.assert_close(g, ref[k], atol=1e-6, rtol=1e-5, msg=f"{runtime} {k}")
