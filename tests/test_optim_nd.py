"""Muon and Shampoo on parameters of 2-D meshes (FSDP x TP, HSDP) equal their single-device runs.

Parameters sharded over one mesh dim (HSDP, a plain parameter on an FSDP x TP mesh) take the
batched exchange over that dim's group; they must equal, bitwise, the per-matrix DTensor
redistribution path (forced here by patching the optimizers' routing predicate) with fewer
collectives (``CommDebugMode`` on 4 gloo processes).
"""

from __future__ import annotations

import contextlib
import warnings
from unittest import mock

import pytest
import torch
from dist_utils import run_gloo, run_threaded
from ragged_placement.optim import Muon, Shampoo
from ragged_placement.optim import muon as muon_module
from ragged_placement.optim import shampoo as shampoo_module
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from ragged_placement import RaggedShard

warnings.filterwarnings("ignore", category=FutureWarning)

SHAPES = [(8, 6), (12, 4), (4, 10), (3, 8, 4)]
LAYOUTS = [  # (dp, tp) placements of each parameter
    [RaggedShard((0,), (1, 1), split_factor=2), Shard(0)],   # colwise TP under FSDP
    [RaggedShard((0,), (2, 1)), Shard(1)],                    # rowwise TP under FSDP
    [RaggedShard((0,), (0, 1)), Replicate()],                 # plain parameter, FSDP x TP mesh
    [Replicate(), RaggedShard((0, 1), (1, 3))],               # HSDP: (replicate, shard), 3-D stack
]


def _fulls(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _train(rank: int, world_size: int, steps: int):
    mesh = init_device_mesh("cpu", (2, 2))
    params = [torch.nn.Parameter(distribute_tensor(f, mesh, pl)) for f, pl in zip(_fulls(0), LAYOUTS)]
    opt = Muon(params, lr=0.02, momentum=0.95, nesterov=True)
    for step in range(steps):
        for p, g in zip(params, _fulls(100 + step)):
            p.grad = distribute_tensor(g, mesh, p.placements)
        opt.step()
    assert opt.last_step_info.nd_matrices == 2  # the two TP layouts
    return [p.full_tensor() for p in params]


def _single_device(make_opt, steps: int) -> list[torch.nn.Parameter]:
    """The reference: full tensors on one device, the same gradients as the ranks see."""
    ref = [torch.nn.Parameter(f.clone()) for f in _fulls(0)]
    opt = make_opt(ref)
    for step in range(steps):
        for p, g in zip(ref, _fulls(100 + step)):
            p.grad = g
        opt.step()
    return ref


def test_muon_on_2d_meshes_matches_single_device():
    results = run_threaded(_train, 4, 5)
    ref = _single_device(lambda ps: Muon(ps, lr=0.02, momentum=0.95, nesterov=True), 5)
    for rank_result in results:
        for got, want in zip(rank_result, ref):
            # the same bf16 Newton-Schulz on the same full matrix: equal up to fp32 update order
            torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-6)


def _train_shampoo(rank: int, world_size: int, steps: int):
    from ragged_placement.optim import Shampoo

    mesh = init_device_mesh("cpu", (2, 2))
    params = [torch.nn.Parameter(distribute_tensor(f, mesh, pl)) for f, pl in zip(_fulls(0), LAYOUTS)]
    opt = Shampoo(params, lr=1e-2, max_preconditioner_dim=4, precondition_frequency=2, grafting="adam")
    for step in range(steps):
        for p, g in zip(params, _fulls(100 + step)):
            p.grad = distribute_tensor(g, mesh, p.placements)
        opt.step()
    return [p.full_tensor() for p in params]


def test_shampoo_on_2d_meshes_matches_single_device():
    from ragged_placement.optim import Shampoo

    results = run_threaded(_train_shampoo, 4, 4)
    ref = _single_device(
        lambda ps: Shampoo(ps, lr=1e-2, max_preconditioner_dim=4, precondition_frequency=2, grafting="adam"),
        4,
    )
    for rank_result in results:
        for got, want in zip(rank_result, ref):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


HSDP_LAYOUTS = [  # one sharded mesh dim, the other Replicate
    [Replicate(), RaggedShard((0,), (1, 1))],  # HSDP (replicate, shard), rows cut
    [Replicate(), Shard(0)],
    [RaggedShard((0,), (1, 3)), Replicate()],  # plain parameter on an (FSDP, TP) mesh
    [Replicate(), RaggedShard((0, 1), (1, 3))],  # 3-D stack, matrices cut
]
MUON_OPTS = {"lr": 0.02, "momentum": 0.95, "nesterov": True}
SHAMPOO_OPTS = {"lr": 1e-2, "max_preconditioner_dim": 4, "precondition_frequency": 2, "grafting": "adam"}


def _every_nd_param_per_matrix(tensor: torch.Tensor) -> bool:
    """The routing before the batched N-D path: every parameter on an N-D mesh per matrix."""
    return isinstance(tensor, DTensor) and tensor.device_mesh.ndim > 1


@contextlib.contextmanager
def _per_matrix_path():
    with mock.patch.object(
        muon_module, "sharded_on_several_dims", _every_nd_param_per_matrix
    ), mock.patch.object(shampoo_module, "sharded_on_several_dims", _every_nd_param_per_matrix):
        yield


def _train_hsdp(rank: int, world_size: int, optimizer: str, steps: int):
    """Full parameters after ``steps`` and the collectives of each step (``CommDebugMode``)."""
    mesh = init_device_mesh("cpu", (2, 2))
    params = [
        torch.nn.Parameter(distribute_tensor(f, mesh, pl)) for f, pl in zip(_fulls(0), HSDP_LAYOUTS)
    ]
    opt = Muon(params, **MUON_OPTS) if optimizer == "muon" else Shampoo(params, **SHAMPOO_OPTS)
    counts = []
    for step in range(steps):
        for p, g in zip(params, _fulls(100 + step)):
            p.grad = distribute_tensor(g, mesh, p.placements)
        with CommDebugMode() as comm:
            opt.step()
        counts.append(comm.get_total_counts())
    return [p.full_tensor() for p in params], counts


def test_one_sharded_dim_batched_equals_per_matrix_path_bitwise():
    """4 threaded ranks, 2x2 mesh, Muon and Shampoo: bitwise equal to the per-matrix path."""
    for optimizer, steps in (("muon", 3), ("shampoo", 3)):
        batched = run_threaded(_train_hsdp, 4, optimizer, steps)
        with _per_matrix_path():
            per_matrix = run_threaded(_train_hsdp, 4, optimizer, steps)
        for (got, _), (want, _) in zip(batched, per_matrix):
            for a, b in zip(got, want):
                assert torch.equal(a, b), (optimizer, (a - b).abs().max())


def _hsdp_counts(rank: int, world_size: int):
    out = {}
    for optimizer in ("muon", "shampoo"):
        batched, batched_counts = _train_hsdp(rank, world_size, optimizer, 2)
        with _per_matrix_path():
            per_matrix, per_matrix_counts = _train_hsdp(rank, world_size, optimizer, 2)
        out[optimizer] = (
            all(torch.equal(a, b) for a, b in zip(batched, per_matrix)),
            batched_counts,
            per_matrix_counts,
        )
    return out


@pytest.mark.multiprocess
def test_one_sharded_dim_batched_collectives_gloo():
    """4 gloo ranks, 2x2 mesh: one all-to-all each way per step and sharded mesh dim (two here:
    three parameters shard over dim 1, one over dim 0) for all matrices (Muon, and Shampoo whose
    B=4 row slabs are cut by the placements) instead of one collective per matrix and direction;
    results bitwise equal to the per-matrix path."""
    results = run_gloo(_hsdp_counts, 4)
    for optimizer in ("muon", "shampoo"):
        for rank_out in results:
            equal, batched, per_matrix = rank_out[optimizer]
            assert equal, optimizer
            assert batched == [4, 4], (optimizer, batched)
            assert per_matrix == [2 * len(HSDP_LAYOUTS)] * 2, (optimizer, per_matrix)
