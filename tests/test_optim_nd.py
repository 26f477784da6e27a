"""Muon and Shampoo on parameters of 2-D meshes (FSDP x TP, HSDP) equal their single-device runs."""

from __future__ import annotations

import warnings

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dist_utils import run_threaded
from ragged_placement import RaggedShard
from ragged_placement.optim import Muon

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
    assert opt.last_step_info.nd_matrices == len(params)
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
