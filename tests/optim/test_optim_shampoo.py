"""Block-diagonal Shampoo on sharded DTensors against single-device references.

Tolerances (fp32 throughout, no bf16): ours vs the reference below, written from the definition
(the module docstring of ragged_placement.optim.shampoo), ``ATOL = 1e-5`` after 10 steps at lr
1e-2 (observed <= 1e-6). Against pytorch-optimizer's ``Shampoo`` (unblocked, SVD roots of
``eps I + sum G G^T``, no grafting) applied block by block: ``PEER_ATOL = 1e-4`` (SVD vs eigh
roots, observed ~1e-6). Distributed runs compute every row slab with the same code as the single
device path: ``DIST_ATOL = 1e-6``.
"""

from __future__ import annotations

import pytest
import torch
from common.muon import max_diff, run_single, shard
from common.shampoo import (
    ATOL,
    DIST_ATOL,
    LR,
    OPTS,
    SHAPES,
    B,
    dist_shampoo,
    make_problem,
    placement_for,
    reference_shampoo,
    single_shampoo,
)
from dist_utils import recording_collectives, run_threaded
from ragged_placement.optim import Shampoo
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

PEER_ATOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


# -- reference ------------------------------------------------------------------------------------


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


@pytest.mark.parametrize("ws", [1, 2, 4])
def test_block_aligned_placement_needs_no_communication(ws):
    """RaggedShard with B-row units: every rank owns whole row blocks; zero collectives."""
    with recording_collectives() as rec:
        results = run_threaded(dist_shampoo, ws, "aligned", 10, OPTS)
    assert rec.calls == {}
    assert all(r[1] == 0 for r in results)
    full = [torch.cat([r[0][i].reshape(-1) for r in results]).view(s) for i, s in enumerate(SHAPES)]
    assert max_diff(full, single_shampoo()) <= DIST_ATOL


@pytest.mark.parametrize("ws,kind", [(2, "even"), (4, "flat"), (2, "flat")])
def test_unaligned_placement_gathers_slabs_with_two_all_to_alls(ws, kind):
    shapes = tuple(SHAPES)
    with recording_collectives() as rec:
        results = run_threaded(dist_shampoo, ws, kind, 10, OPTS, list(shapes))
    calls = rec.calls
    assert set(calls) == {"all_to_all_single"} and len(calls["all_to_all_single"]) == 2 * 10 * ws
    assert all(r[1] == 2 for r in results)
    full = [torch.cat([r[0][i].reshape(-1) for r in results]).view(s) for i, s in enumerate(shapes)]
    assert max_diff(full, single_shampoo(shapes)) <= DIST_ATOL


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
