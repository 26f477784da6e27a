"""Muon's references and problems (``tests/optim/``, and the state-sharding optimizer tests):
Keller Jordan's single-device Muon, the tolerances (see ``test_optim_muon``'s docstring), the
problems, the test layouts' placements, and the runs on one device and sharded; ``max_diff``,
``run_single`` and ``shard`` serve Shampoo's tests too.
"""

from __future__ import annotations

import functools

import torch
from ragged_placement.optim import Muon
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ragged_placement import RaggedShard

REF_ATOL = 4e-3
DIST_ATOL = 1e-6
SHAPES = [(12, 10), (8, 18), (3, 8, 12), (20, 6)]
LR, WD = 0.02, 0.1


def keller_ns(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """zeropower_via_newtonschulz5 from github.com/KellerJordan/Muon (muon.py), verbatim."""
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.bfloat16()
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X


def keller_muon(params, grads, lr=LR, wd=WD, beta=0.95, nesterov=True, scale="original"):
    """Single-device Muon from the published algorithm (muon_update + the step of ``Muon``)."""
    params = [p.clone() for p in params]
    bufs = [torch.zeros_like(p) for p in params]
    for step_grads in grads:
        for p, g, m in zip(params, step_grads, bufs):
            g = g.clone()
            m.lerp_(g, 1 - beta)
            u = g.lerp_(m, beta) if nesterov else m
            u = keller_ns(u)
            rows, cols = p.shape[-2:]
            u = u * (
                max(1, rows / cols) ** 0.5 if scale == "original" else 0.2 * max(rows, cols) ** 0.5
            )
            p.mul_(1 - lr * wd)
            p.add_(u.reshape(p.shape), alpha=-lr)
    return params


def make_problem(seed: int, shapes=SHAPES, steps: int = 10):
    g = torch.Generator().manual_seed(seed)
    params = [0.1 * torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(steps)]
    return params, grads


def run_single(opt_factory, params, grads):
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = opt_factory(ps)
    for step_grads in grads:
        for p, g in zip(ps, step_grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in ps]


def max_diff(xs, ys) -> float:
    return max((x - y).abs().max().item() for x, y in zip(xs, ys))


def placement_for(kind: str, shape, ws: int, index: int):
    """The placement of parameter ``index`` for a test layout ``kind`` on ``ws`` ranks."""
    if kind == "even":
        return Shard(0)
    if kind == "replicate":
        return Replicate()
    dims = (0,) if len(shape) == 2 else (0, 1)
    if kind == "uneven":  # zeros included
        return RaggedShard(dims, {1: (1,), 2: (3, 1), 4: (2, 0, 1, 1)}[ws])
    if kind == "whole":  # every matrix whole on one rank; experts spread one per rank
        if len(shape) == 3:
            return RaggedShard(
                (0,),
                tuple(1 if r < shape[0] else 0 for r in range(ws))
                if ws >= shape[0]
                else (shape[0],) + (0,) * (ws - 1),
            )
        return RaggedShard((0,), tuple(int(r == index % ws) for r in range(ws)))
    if kind == "flat":  # FSDP1-style element-wise cut, through rows and matrices
        return RaggedShard(tuple(range(len(shape))), (1,) * ws)
    raise ValueError(kind)


def shard(full: torch.Tensor, placement, mesh, rank: int) -> torch.Tensor:
    if isinstance(placement, RaggedShard):
        local = placement.shard_local(full, rank).clone()
        return DTensor.from_local(
            local, mesh, [placement], shape=full.shape, stride=full.stride(), run_check=False
        )
    return distribute_tensor(full.clone(), mesh, [placement])


def dist_muon(rank, ws, kind, opt_kwargs, steps):
    mesh = init_device_mesh("cpu", (ws,))
    params, grads = make_problem(0, steps=steps)
    pls = [placement_for(kind, p.shape, ws, i) for i, p in enumerate(params)]
    dps = [torch.nn.Parameter(shard(p, pl, mesh, rank)) for p, pl in zip(params, pls)]
    opt = Muon(dps, **opt_kwargs)
    infos = []
    for step_grads in grads:
        for p, g, pl in zip(dps, step_grads, pls):
            p.grad = shard(g, pl, mesh, rank)
        opt.step()
        infos.append(opt.last_step_info)
    return [p._local_tensor.clone() for p in dps], infos


def gather_results(results, shapes):
    return [torch.cat([r[0][i].reshape(-1) for r in results]).view(s) for i, s in enumerate(shapes)]


@functools.cache
def single_device_results():
    """Ours and Keller Jordan's reference on plain tensors, for the problem of ``dist_muon``."""
    params, grads = make_problem(0)
    single = run_single(
        lambda ps: Muon(ps, lr=LR, weight_decay=WD, adjust_lr="match_rms_adamw"), params, grads
    )
    return single, keller_muon(params, grads, scale="match_rms_adamw")
