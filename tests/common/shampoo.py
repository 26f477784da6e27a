"""Shampoo's references and problems (``tests/optim/``, and the state-sharding optimizer tests):
the fp32 single-device reference, the tolerances, the problems, the test layouts' placements and
the runs on one device and sharded.
"""

from __future__ import annotations

import functools

import torch
from ragged_placement.optim import Shampoo
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from common.muon import run_single, shard
from ragged_placement import RaggedShard

ATOL = 1e-5
DIST_ATOL = 1e-6
SHAPES = [(12, 10), (8, 18), (3, 8, 12), (20, 6), (12,)]
B = 4
LR, WD = 1e-2, 0.05
OPTS = dict(
    lr=LR, max_preconditioner_dim=B, precondition_frequency=3, epsilon=1e-6, weight_decay=WD
)


def make_problem(seed: int, shapes=SHAPES, steps: int = 10):
    g = torch.Generator().manual_seed(seed)
    params = [0.1 * torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(steps)]
    return params, grads


def _root(a: torch.Tensor, e: float, eps: float) -> torch.Tensor:
    w, q = torch.linalg.eigh(a)
    return q @ torch.diag((w.clamp(min=0) + eps) ** e) @ q.T


def reference_shampoo(
    params,
    grads,
    *,
    lr,
    max_preconditioner_dim,
    precondition_frequency,
    epsilon,
    weight_decay,
    grafting="adam",
    betas=(0.9, 0.999),
    graft_eps=1e-8,
    exponents=(-0.25, -0.25),
):
    """Straight from the definition: per block L, R, roots every k steps, grafting per block."""
    params = [p.clone() for p in params]
    state = [dict() for _ in params]
    for t, step_grads in enumerate(grads, start=1):
        for p, g, s in zip(params, step_grads, state):
            p.mul_(1 - lr * weight_decay)
            # grafting direction on the whole tensor (elementwise)
            if grafting in ("adam", "rmsprop"):
                s.setdefault("v", torch.zeros_like(g)).mul_(betas[1]).add_((1 - betas[1]) * g * g)
            if grafting == "adam":
                s.setdefault("m", torch.zeros_like(g)).mul_(betas[0]).add_((1 - betas[0]) * g)
                d = (s["m"] / (1 - betas[0] ** t)) / (
                    (s["v"] / (1 - betas[1] ** t)).sqrt() + graft_eps
                )
            elif grafting == "rmsprop":
                d = g / (s["v"].sqrt() + graft_eps)
            else:
                d = g
            if p.ndim < 2:
                p.sub_(lr * d)
                continue
            mats_g, mats_d = g.reshape(-1, *g.shape[-2:]), d.reshape(-1, *g.shape[-2:])
            update = torch.zeros_like(mats_g)
            rows, cols = g.shape[-2:]
            for b in range(mats_g.shape[0]):
                for r0 in range(0, rows, max_preconditioner_dim):
                    for c0 in range(0, cols, max_preconditioner_dim):
                        r1, c1 = (
                            min(r0 + max_preconditioner_dim, rows),
                            min(c0 + max_preconditioner_dim, cols),
                        )
                        G = mats_g[b, r0:r1, c0:c1]
                        key = (b, r0, c0)
                        L = s.setdefault(("L", key), torch.zeros(r1 - r0, r1 - r0))
                        R = s.setdefault(("R", key), torch.zeros(c1 - c0, c1 - c0))
                        L += G @ G.T
                        R += G.T @ G
                        if (t - 1) % precondition_frequency == 0:
                            s[("Lr", key)] = _root(L, exponents[0], epsilon)
                            s[("Rr", key)] = _root(R, exponents[1], epsilon)
                        P = s[("Lr", key)] @ G @ s[("Rr", key)]
                        if grafting != "none":
                            P = P * mats_d[b, r0:r1, c0:c1].norm() / (P.norm() + 1e-16)
                        update[b, r0:r1, c0:c1] = P
            p.sub_(lr * update.view(p.shape))
    return params


def _spread(n: int, ws: int) -> tuple[int, ...]:
    return tuple(n // ws + (1 if r < n % ws else 0) for r in range(ws))


def placement_for(kind: str, shape, ws: int):
    if kind == "aligned":  # cuts only on B-row boundaries (whole experts for 3-D)
        if len(shape) == 3:
            return RaggedShard((0,), _spread(shape[0], ws))
        if len(shape) == 1:
            return RaggedShard((0,), _spread(shape[0], ws))
        return RaggedShard((0,), _spread(shape[0] // B, ws))
    if kind == "even":
        return Shard(0)
    if kind == "flat":
        return RaggedShard(tuple(range(len(shape))), (1,) * ws)
    raise ValueError(kind)


def dist_shampoo(rank, ws, kind, steps, opts, shapes=SHAPES):
    mesh = init_device_mesh("cpu", (ws,))
    params, grads = make_problem(0, shapes, steps)
    pls = [placement_for(kind, p.shape, ws) for p in params]
    dps = [torch.nn.Parameter(shard(p, pl, mesh, rank)) for p, pl in zip(params, pls)]
    opt = Shampoo(dps, **opts)
    for step_grads in grads:
        for p, g, pl in zip(dps, step_grads, pls):
            p.grad = shard(g, pl, mesh, rank)
        opt.step()
    return [p._local_tensor.clone() for p in dps], opt.last_step_all_to_all_calls


@functools.cache
def single_shampoo(shapes=tuple(SHAPES)):
    params, grads = make_problem(0, list(shapes))
    return run_single(lambda ps: Shampoo(ps, **OPTS), params, grads)
