"""Block-diagonal Shampoo on sharded DTensors against single-device references.

Tolerances (fp32 throughout, no bf16): ours vs the reference below, written from the definition
(the module docstring of ragged_placement.optim.shampoo), ``ATOL = 1e-5`` after 10 steps at lr
1e-2 (observed <= 1e-6). Against pytorch-optimizer's ``Shampoo`` (unblocked, SVD roots of
``eps I + sum G G^T``, no grafting) applied block by block: ``PEER_ATOL = 1e-4`` (SVD vs eigh
roots, observed ~1e-6). Distributed runs compute every row slab with the same code as the single
device path: ``DIST_ATOL = 1e-6``.
"""

from __future__ import annotations

import functools

import pytest
import torch
from dist_utils import recording_collectives, run_threaded
from test_optim_muon import max_diff, run_single, shard
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from ragged_placement import RaggedShard
from ragged_placement.optim import Shampoo

ATOL = 1e-5
PEER_ATOL = 1e-4
DIST_ATOL = 1e-6
SHAPES = [(12, 10), (8, 18), (3, 8, 12), (20, 6), (12,)]
B = 4
LR, WD = 1e-2, 0.05
OPTS = dict(
    lr=LR, max_preconditioner_dim=B, precondition_frequency=3, epsilon=1e-6, weight_decay=WD
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def make_problem(seed: int, shapes=SHAPES, steps: int = 10):
    g = torch.Generator().manual_seed(seed)
    params = [0.1 * torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(steps)]
    return params, grads


# -- reference ------------------------------------------------------------------------------------
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


# -- single device --------------------------------------------------------------------------------
@pytest.mark.parametrize("grafting", ["adam", "rmsprop", "sgd", "none"])
def test_single_device_matches_reference(grafting):
    params, grads = make_problem(0)
    ours = run_single(lambda ps: Shampoo(ps, grafting=grafting, **OPTS), params, grads)
    ref = reference_shampoo(params, grads, grafting=grafting, **OPTS)
    assert max_diff(ours, ref) < ATOL
    assert max_diff(ours, params) > 100 * ATOL


def test_reference_tolerance_detects_mistakes():
    params, grads = make_problem(1)
    ref = reference_shampoo(params, grads, **OPTS)
    wrong_freq = reference_shampoo(params, grads, **{**OPTS, "precondition_frequency": 1})
    wrong_block = reference_shampoo(params, grads, **{**OPTS, "max_preconditioner_dim": 6})
    wrong_exp = reference_shampoo(params, grads, exponents=(-0.5, -0.25), **OPTS)
    for wrong in (wrong_freq, wrong_block, wrong_exp):
        assert max_diff(wrong, ref) > 100 * ATOL


def test_matches_pytorch_optimizer_shampoo_block_by_block():
    """pytorch-optimizer's Shampoo (momentum 0, no weight decay, roots every step, matrix_eps=eps:
    its L starts at eps I, ours adds eps to the eigenvalues: the same matrix) on each B x B block
    as a separate parameter equals our grafting="none" block-diagonal Shampoo."""
    pytorch_optimizer = pytest.importorskip("pytorch_optimizer")
    shape = (8, 12)
    params, grads = make_problem(2, [shape])
    eps = 1e-3
    ours = run_single(
        lambda ps: Shampoo(
            ps,
            lr=LR,
            max_preconditioner_dim=B,
            precondition_frequency=1,
            epsilon=eps,
            grafting="none",
        ),
        params,
        grads,
    )
    blocks = [(r, c) for r in range(0, 8, B) for c in range(0, 12, B)]
    peer = run_single(
        lambda ps: pytorch_optimizer.Shampoo(
            ps, lr=LR, momentum=0.0, preconditioning_compute_steps=1, matrix_eps=eps
        ),
        [params[0][r : r + B, c : c + B] for r, c in blocks],
        [[g[0][r : r + B, c : c + B] for r, c in blocks] for g in grads],
    )
    stitched = torch.empty(shape)
    for (r, c), blk in zip(blocks, peer):
        stitched[r : r + B, c : c + B] = blk
    assert max_diff(ours, [stitched]) < PEER_ATOL
    assert max_diff(ours, params) > 100 * PEER_ATOL


# -- distributed ----------------------------------------------------------------------------------
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


def _dist_shampoo(rank, ws, kind, steps, opts, shapes=SHAPES):
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
def _single(shapes=tuple(SHAPES)):
    params, grads = make_problem(0, list(shapes))
    return run_single(lambda ps: Shampoo(ps, **OPTS), params, grads)


@pytest.mark.parametrize("ws", [1, 2, 4])
def test_block_aligned_placement_needs_no_communication(ws):
    """RaggedShard with B-row units: every rank owns whole row blocks; zero collectives."""
    with recording_collectives() as rec:
        results = run_threaded(_dist_shampoo, ws, "aligned", 10, OPTS)
    assert rec.calls == {}
    assert all(r[1] == 0 for r in results)
    full = [torch.cat([r[0][i].reshape(-1) for r in results]).view(s) for i, s in enumerate(SHAPES)]
    assert max_diff(full, _single()) <= DIST_ATOL


@pytest.mark.parametrize("ws,kind", [(2, "even"), (4, "flat"), (2, "flat")])
def test_unaligned_placement_gathers_slabs_with_two_all_to_alls(ws, kind):
    shapes = tuple(SHAPES)
    with recording_collectives() as rec:
        results = run_threaded(_dist_shampoo, ws, kind, 10, OPTS, list(shapes))
    calls = rec.calls
    assert set(calls) == {"all_to_all_single"} and len(calls["all_to_all_single"]) == 2 * 10 * ws
    assert all(r[1] == 2 for r in results)
    full = [torch.cat([r[0][i].reshape(-1) for r in results]).view(s) for i, s in enumerate(shapes)]
    assert max_diff(full, _single(shapes)) <= DIST_ATOL


def _round_trip(rank, ws):
    mesh = init_device_mesh("cpu", (ws,))
    params, grads = make_problem(3)
    pls = [placement_for("flat", p.shape, ws) for p in params]

    def run(dps, opt, gs):
        for step_grads in gs:
            for p, g, pl in zip(dps, step_grads, pls):
                p.grad = shard(g, pl, mesh, rank)
            opt.step()

    dps = [torch.nn.Parameter(shard(p, pl, mesh, rank)) for p, pl in zip(params, pls)]
    opt = Shampoo(dps, **OPTS)
    run(dps, opt, grads)
    straight = [p._local_tensor.clone() for p in dps]

    dps = [torch.nn.Parameter(shard(p, pl, mesh, rank)) for p, pl in zip(params, pls)]
    opt = Shampoo(dps, **OPTS)
    run(dps, opt, grads[:4])
    sd = opt.state_dict()
    vector_state_is_dtensor = isinstance(sd["state"][4]["exp_avg"], DTensor)
    fresh = [
        torch.nn.Parameter(
            DTensor.from_local(
                p._local_tensor.clone(),
                mesh,
                p.placements,
                shape=p.shape,
                stride=p.stride(),
                run_check=False,
            )
        )
        for p in dps
    ]
    opt2 = Shampoo(fresh, **OPTS)
    opt2.load_state_dict(sd)
    run(fresh, opt2, grads[4:])
    return straight, [p._local_tensor.clone() for p in fresh], vector_state_is_dtensor


def test_state_dict_round_trip():
    for straight, resumed, vector_state_is_dtensor in run_threaded(_round_trip, 2):
        assert vector_state_is_dtensor
        for a, b in zip(straight, resumed):
            assert torch.equal(a, b)


# -- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=-1.0), "lr"),
        (dict(max_preconditioner_dim=0), "max_preconditioner_dim"),
        (dict(precondition_frequency=0), "precondition_frequency"),
        (dict(epsilon=-1.0), "epsilon"),
        (dict(grafting="adagrad"), "grafting"),
        (dict(exponents=(0.25, -0.25)), "exponents"),
        (dict(grafting_betas=(1.0, 0.9)), "grafting_betas"),
        (dict(weight_decay=-0.1), "weight_decay"),
    ],
)
def test_bad_hyperparameters_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Shampoo([torch.nn.Parameter(torch.zeros(4, 4))], **kwargs)
