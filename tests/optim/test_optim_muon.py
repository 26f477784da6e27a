"""Muon on sharded DTensors against single-device references.

Tolerances. Newton-Schulz runs in bf16, so two correct implementations differ by their bf16
rounding. We measured the spread of Keller Jordan's reference against *itself* run on the
transposed layout (``W^T``, same math, other NS branch) over 5 seeds, 10 steps, lr=0.02 on the
shapes below: max |dW| = 1.7e-3 (torch.optim.Muon vs the reference: 2.5e-3; ours: 2.7e-3).
``REF_ATOL = 4e-3`` (10 steps, lr 0.02, params ~ 0.1) sits just above that spread, well below
what a wrong momentum, scale or a missed step gives (> 1.2e-2, checked in
``test_reference_tolerance_detects_mistakes``).

Distributed runs execute the same bf16 kernels on the same bf16 inputs as our single-device
path, so they are compared to it with ``DIST_ATOL = 1e-6`` (observed: bitwise equal).
"""

from __future__ import annotations

import math

import pytest
import torch
from common.muon import (
    DIST_ATOL,
    LR,
    REF_ATOL,
    SHAPES,
    WD,
    dist_muon,
    gather_results,
    keller_muon,
    make_problem,
    max_diff,
    placement_for,
    run_single,
    shard,
    single_device_results,
)
from dist_utils import recording_collectives, run_threaded
from hypothesis import given, settings
from hypothesis import strategies as st
from ragged_placement.optim import Muon, newton_schulz, newton_schulz_flops
from ragged_placement.optim._sharding import Exchange, Item, Layout, assign_owners, layout_of
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ragged_placement import RaggedShard

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


# -- references -----------------------------------------------------------------------------------


# -- placements -----------------------------------------------------------------------------------


# -- single device --------------------------------------------------------------------------------
def test_single_device_matches_published_algorithm_and_torch_muon():
    """Plain tensors: ours vs Keller Jordan's reference and vs torch.optim.Muon, within REF_ATOL."""
    params, grads = make_problem(1)
    two_d = [i for i, s in enumerate(SHAPES) if len(s) == 2]
    ref = keller_muon(params, grads)
    ours = run_single(lambda ps: Muon(ps, lr=LR, weight_decay=WD), params, grads)
    assert max_diff(ours, ref) < REF_ATOL
    torch_muon = run_single(
        lambda ps: torch.optim.Muon(ps, lr=LR, weight_decay=WD),
        [params[i] for i in two_d],
        [[g[i] for i in two_d] for g in grads],
    )
    assert max_diff([ours[i] for i in two_d], torch_muon) < REF_ATOL
    # and the update is real: parameters moved by far more than the tolerance
    assert max_diff(ours, params) > 20 * REF_ATOL


def test_match_rms_adamw_and_plain_momentum_match_pytorch_optimizer():
    """pytorch-optimizer's Muon agrees for 2-D weights (it flattens 3-D ones to (out, rest)
    instead of batching, so those are left out); both adjust_lr modes, nesterov on and off."""
    pytorch_optimizer = pytest.importorskip("pytorch_optimizer")
    shapes = [s for s in SHAPES if len(s) == 2]
    params, grads = make_problem(2, shapes)
    for adjust, nesterov in [("original", True), ("match_rms_adamw", False)]:
        ours = run_single(
            lambda ps: Muon(ps, lr=LR, weight_decay=WD, adjust_lr=adjust, nesterov=nesterov),
            params,
            grads,
        )
        ref = keller_muon(params, grads, nesterov=nesterov, scale=adjust)
        peer = run_single(
            lambda ps: pytorch_optimizer.Muon(
                [dict(params=ps, use_muon=True)],
                lr=LR,
                weight_decay=WD,
                nesterov=nesterov,
                use_adjusted_lr=adjust == "match_rms_adamw",
                foreach=False,
            ),
            params,
            grads,
        )
        assert max_diff(ours, ref) < REF_ATOL
        assert max_diff(ours, peer) < REF_ATOL


def test_reference_tolerance_detects_mistakes():
    """REF_ATOL separates a correct implementation from plausible wrong ones."""
    params, grads = make_problem(3)
    ref = keller_muon(params, grads)
    assert max_diff(keller_muon(params, grads, nesterov=False), ref) > 5 * REF_ATOL
    assert max_diff(keller_muon(params, grads, beta=0.9), ref) > 2 * REF_ATOL
    assert max_diff(keller_muon(params, grads, scale="match_rms_adamw"), ref) > 5 * REF_ATOL
    assert max_diff(keller_muon(params, grads[:9]), ref) > 3 * REF_ATOL


def test_newton_schulz_orthogonalizes():
    """Singular values of NS(X) land in the quintic's band [0.6, 1.25] (vs spread-out inputs)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 40, 24, generator=g) @ torch.diag(torch.logspace(-1, 0, 24))
    s = torch.linalg.svdvals(newton_schulz(x).float())
    assert s.min() > 0.6 and s.max() < 1.25
    assert torch.equal(newton_schulz(x)[2], newton_schulz(x[2]))
    fp32 = newton_schulz(x, dtype=torch.float32)  # Muon(ns_dtype=torch.float32)
    s32 = torch.linalg.svdvals(fp32)
    assert fp32.dtype == torch.float32 and s32.min() > 0.6 and s32.max() < 1.25
    assert newton_schulz_flops(40, 24) == 5 * (4 * 24 * 24 * 40 + 2 * 24**3)


# -- distributed ----------------------------------------------------------------------------------


@pytest.mark.parametrize("ws", [1, 2, 4])
@pytest.mark.parametrize("kind", ["even", "uneven", "whole", "flat", "replicate"])
def test_distributed_matches_single_device(kind, ws):
    kwargs = dict(lr=LR, weight_decay=WD, adjust_lr="match_rms_adamw")
    single, reference = single_device_results()
    results = run_threaded(dist_muon, ws, kind, kwargs, 10)
    got = [r[0] for r in results] if kind == "replicate" else [gather_results(results, SHAPES)]
    for full in got:
        assert max_diff(full, single) <= DIST_ATOL
        assert max_diff(full, reference) < REF_ATOL
    info = results[0][1][-1]
    if kind in ("whole", "replicate") or ws == 1:
        assert all(i.bytes_sent == 0 and i.all_to_all_calls == 0 for r in results for i in r[1])
    else:
        assert all(i.all_to_all_calls == 2 for r in results for i in r[1])
        assert sum(r[1][-1].bytes_sent for r in results) > 0
    if kind != "replicate":
        assert sum(info.flops_per_rank) == sum(
            newton_schulz_flops(*s[-2:]) * math.prod(s[:-2]) for s in SHAPES
        )


def test_batched_path_issues_exactly_two_all_to_alls_and_nothing_else():
    """Count c10d calls per rank: 2 all_to_all_single per step (uneven), 0 for whole matrices."""
    kwargs = dict(lr=LR)
    with recording_collectives() as rec:
        results = run_threaded(dist_muon, 4, "uneven", kwargs, 3)
    assert set(rec.calls) == {"all_to_all_single"}
    assert sorted(rec.calls["all_to_all_single"]) == sorted(
        [r for r in range(4) for _ in range(2 * 3)]
    )
    # MuonStepInfo.bytes_sent is what really went into the collectives
    wire_bytes = [rec.all_to_all_bytes[r] for r in range(4)]
    assert wire_bytes == [sum(i.bytes_sent for i in r[1]) for r in results]
    assert sum(wire_bytes) > 0
    with recording_collectives() as rec:
        run_threaded(dist_muon, 4, "whole", kwargs, 3)
    assert rec.calls == {}


def _adamw_groups(rank, ws, steps):
    mesh = init_device_mesh("cpu", (ws,))
    g = torch.Generator().manual_seed(6)
    mats = [0.1 * torch.randn(8, 12, generator=g)]
    vecs = [torch.randn(12, generator=g), torch.randn(4, generator=g)]
    grads = [[torch.randn(t.shape, generator=g) for t in mats + vecs] for _ in range(steps)]
    pl = RaggedShard((0,), (1, 0, 2, 1)[:ws] if ws == 4 else (1,) * ws)
    dps = [torch.nn.Parameter(shard(t, pl, mesh, rank)) for t in mats + vecs[:1]] + [
        torch.nn.Parameter(vecs[1].clone())
    ]
    opt = Muon(
        [
            {"params": dps[:1]},
            {"params": dps[1:], "algorithm": "adamw", "lr": 1e-2, "weight_decay": 0.05},
        ],
        lr=LR,
        betas=(0.8, 0.9),
        adamw_eps=1e-6,
    )
    for step_grads in grads:
        for p, gr in zip(dps, step_grads):
            p.grad = shard(gr, pl, mesh, rank) if isinstance(p, DTensor) else gr.clone()
        opt.step()
    return [
        p._local_tensor.clone() if isinstance(p, DTensor) else p.detach().clone() for p in dps
    ], (mats, vecs, grads)


def test_adamw_group_matches_torch_adamw():
    results = run_threaded(_adamw_groups, 4, 4)
    mats, vecs, grads = results[0][1]
    ref = run_single(
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05),
        vecs,
        [g[1:] for g in grads],
    )
    got_vec0 = torch.cat([r[0][1] for r in results])
    torch.testing.assert_close(got_vec0, ref[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(results[0][0][2], ref[1], rtol=1e-6, atol=1e-7)
    single = run_single(lambda ps: Muon(ps, lr=LR), mats, [g[:1] for g in grads])
    assert max_diff([torch.cat([r[0][0] for r in results])], single) <= DIST_ATOL


def _state_dict_round_trip(rank, ws):
    mesh = init_device_mesh("cpu", (ws,))
    params, grads = make_problem(7)
    pls = [placement_for("uneven", p.shape, ws, i) for i, p in enumerate(params)]

    def build(values):
        dps = [torch.nn.Parameter(shard(v, pl, mesh, rank)) for v, pl in zip(values, pls)]
        return dps, Muon(
            [{"params": dps[:3]}, {"params": dps[3:], "algorithm": "adamw"}], lr=LR, weight_decay=WD
        )

    def steps(dps, opt, gs):
        for step_grads in gs:
            for p, g, pl in zip(dps, step_grads, pls):
                p.grad = shard(g, pl, mesh, rank)
            opt.step()

    dps, opt = build(params)
    steps(dps, opt, grads)
    straight = [p._local_tensor.clone() for p in dps]

    dps, opt = build(params)
    steps(dps, opt, grads[:5])
    sd = opt.state_dict()
    placed = [
        (v.placements == dps[i].placements and isinstance(v, DTensor))
        for i, s in sd["state"].items()
        for k, v in s.items()
        if k != "step"
    ]
    snapshot = [p._local_tensor.clone() for p in dps]
    fresh = [
        torch.nn.Parameter(
            DTensor.from_local(
                x.clone(), mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False
            )
        )
        for x, p in zip(snapshot, dps)
    ]
    opt2 = Muon(
        [{"params": fresh[:3]}, {"params": fresh[3:], "algorithm": "adamw"}], lr=LR, weight_decay=WD
    )
    opt2.load_state_dict(sd)
    steps(fresh, opt2, grads[5:])
    return straight, [p._local_tensor.clone() for p in fresh], placed


def test_state_dict_round_trip_with_dtensor_state():
    """Momentum / AdamW moments come out as DTensors with the parameter's placement; reloading
    them into a new optimizer and continuing equals training straight through."""
    for straight, resumed, placed in run_threaded(_state_dict_round_trip, 4):
        assert placed and all(placed) and len(placed) == 3 + 2
        for a, b in zip(straight, resumed):
            assert torch.equal(a, b)


# -- owner planning -------------------------------------------------------------------------------
def _gpt2_shapes(layers: int = 12):
    h, f = 768, 3072
    return [s for _ in range(layers) for s in [(3 * h, h), (h, h), (f, h), (h, f)]]


def test_owner_plan_balances_gpt2_ns_flops():
    """gpt2-124m's 48 matrices on 4 ranks under Shard(0): LPT max/mean NS FLOPs <= 1.10."""
    shapes = _gpt2_shapes()
    ws = 4
    layouts = []
    for s in shapes:
        chunk = -(-s[0] // ws)
        layouts.append(
            Layout(
                s,
                None,
                0,
                tuple(
                    (min(r * chunk, s[0]) * s[1], min((r + 1) * chunk, s[0]) * s[1])
                    for r in range(ws)
                ),
            )
        )
    items = [Item(i, 0, s, newton_schulz_flops(*s)) for i, s in enumerate(shapes)]
    _, loads = assign_owners(items, layouts)
    assert max(loads) / (sum(loads) / ws) <= 1.10


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 6), st.integers(1, 5)), min_size=1, max_size=5),
    st.data(),
)
def test_exchange_plan_moves_exactly_the_off_owner_pieces(shapes, data):
    """For random flat cuts: pieces received by each owner tile its items exactly, every element
    off its owner is sent once, and items whole on a rank are owned by it."""
    ws = 3
    layouts, items = [], []
    for i, (m, n) in enumerate(shapes):
        numel = m * n
        cuts = sorted(data.draw(st.lists(st.integers(0, numel), min_size=ws - 1, max_size=ws - 1)))
        bounds = [0, *cuts, numel]
        layouts.append(Layout((m, n), None, 0, tuple(zip(bounds[:-1], bounds[1:]))))
        items.append(Item(i, 0, (m, n), m * n * min(m, n)))
    owners, _ = assign_owners(items, layouts)
    off_owner = 0
    for k, it in enumerate(items):
        held = [max(0, min(b, it.end) - max(a, it.start)) for a, b in layouts[it.param].flat_ranges]
        if max(held) == it.numel:
            assert held[owners[k]] == it.numel
        off_owner += it.numel - held[owners[k]]
    for rank in range(ws):
        rl = [Layout(lay.shape, None, rank, lay.flat_ranges) for lay in layouts]
        ex = Exchange(items, owners, rl, None, rank, torch.float32, torch.device("cpu"))
        assert ex.traffic == off_owner
        for k in ex.owned:
            covered = sorted((lo, hi) for pieces in ex.recv for kk, lo, hi in pieces if kk == k)
            covered += [(lo, hi) for kk, lo, hi in ex.self_pieces if kk == k]
            covered.sort()
            assert covered[0][0] == items[k].start and covered[-1][1] == items[k].end
            assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))


# -- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=-1.0), "lr"),
        (dict(momentum=1.0), "momentum"),
        (dict(momentum=-0.1), "momentum"),
        (dict(weight_decay=-1e-3), "weight_decay"),
        (dict(adjust_lr="spectral"), "adjust_lr"),
        (dict(ns_steps=0), "ns_steps"),
        (dict(betas=(0.9, 1.0)), "betas"),
        (dict(ns_dtype=torch.float16), "ns_dtype"),
    ],
)
def test_bad_hyperparameters_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Muon([torch.nn.Parameter(torch.zeros(4, 4))], **kwargs)


def test_non_matrix_params_raise_with_the_fix():
    with pytest.raises(ValueError, match="adamw"):
        Muon([torch.nn.Parameter(torch.zeros(4))])
    with pytest.raises(ValueError, match="shape \\(2, 2, 2, 2\\)"):
        Muon([torch.nn.Parameter(torch.zeros(2, 2, 2, 2))])
    with pytest.raises(ValueError, match="algorithm"):
        Muon([{"params": [torch.nn.Parameter(torch.zeros(4))], "algorithm": "sgd"}])
    Muon([{"params": [torch.nn.Parameter(torch.zeros(4))], "algorithm": "adamw"}])  # fine


def _unsupported_placement(rank, ws):
    mesh = init_device_mesh("cpu", (ws,))
    p = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 4), mesh, [Shard(1)]))
    p.grad = distribute_tensor(torch.ones(4, 4), mesh, [Shard(1)])
    with pytest.raises(ValueError, match="Shard\\(dim=1\\)"):
        Muon([p]).step()
    return True


def test_unsupported_placement_raises():
    assert all(run_threaded(_unsupported_placement, 2))


def _layouts_per_spec(rank, ws):
    mesh = init_device_mesh("cpu", (ws,))
    d = distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0)])
    first = layout_of(d)
    kept = layout_of(d) is first  # read once per spec, not derived at every step
    d._spec = distribute_tensor(torch.zeros(6, 4), mesh, [RaggedShard((0,), (2, 1))])._spec
    ragged = layout_of(d)
    return kept, first.local_range, ragged.local_range, first.rank == rank


def test_a_layout_is_read_once_per_spec_and_follows_a_new_spec():
    """Each rank thread gets its own rank's layout, kept for the spec object; a DTensor given
    another spec gets that spec's layout."""
    for rank, (kept, shard, ragged, own) in enumerate(run_threaded(_layouts_per_spec, 2)):
        assert kept and own
        assert shard == ((0, 12), (12, 24))[rank]
        assert ragged == ((0, 16), (16, 24))[rank]


def _grad_placement_mismatch(rank, ws):
    mesh = init_device_mesh("cpu", (ws,))
    p = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 4), mesh, [Shard(0)]))
    p.grad = distribute_tensor(torch.ones(4, 4), mesh, [Replicate()])
    with pytest.raises(ValueError, match="grad must have the parameter's shape and placements"):
        Muon([p]).step()
    return True


def test_grad_placement_must_match_param():
    assert all(run_threaded(_grad_placement_mismatch, 2))


# -- DCP ------------------------------------------------------------------------------------------
class _Holder(torch.nn.Module):
    def __init__(self, params) -> None:
        super().__init__()
        for i, p in enumerate(params):
            self.register_parameter(f"p{i}", p)


def _dcp_run(rank, ws, values, grads, path, mode):
    """mode "save": step, then dcp.save; "load": dcp.load (other world size), then step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    mesh = init_device_mesh("cpu", (ws,))
    pls = [placement_for("uneven", v.shape, ws, i) for i, v in enumerate(values)]
    model = _Holder([torch.nn.Parameter(shard(v, pl, mesh, rank)) for v, pl in zip(values, pls)])
    ps = list(model.parameters())
    opt = Muon(
        [{"params": ps[:3]}, {"params": ps[3:], "algorithm": "adamw"}], lr=LR, weight_decay=WD
    )
    if mode == "load":
        state = {"optim": get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=path)
        set_optimizer_state_dict(model, opt, state["optim"])
    for step_grads in grads:
        for p, g, pl in zip(ps, step_grads, pls):
            p.grad = shard(g, pl, mesh, rank)
        opt.step()
    if mode == "save":
        dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    return [p.full_tensor() for p in ps]


def test_dcp_checkpoint_saved_on_4_ranks_resumes_on_2(tmp_path):
    """Momentum and AdamW moments saved by DCP from 4 ranks (RaggedShard (2,0,1,1)) load into 2
    ranks (RaggedShard (3,1)): DCP reshards them, and the next 5 steps equal 10 straight steps."""
    params, grads = make_problem(7)
    path = str(tmp_path / "ckpt")
    middle = run_threaded(_dcp_run, 4, params, grads[:5], path, "save")[0]
    resumed = run_threaded(_dcp_run, 2, middle, grads[5:], path, "load")[0]
    straight = run_threaded(_dcp_run, 4, params, grads, None, "straight")[0]
    for a, b in zip(resumed, straight):
        assert torch.equal(a, b)
