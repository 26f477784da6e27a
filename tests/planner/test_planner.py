"""Properties of ragged_placement.planner, checked against independent references.

The reference for "allowed cut" is computed here from the shape and the granularity's documented
meaning, not from the planner's CutSpec; the reference for the layout invariant is plain interval
arithmetic on the global flat buffer.
"""

from __future__ import annotations

import math

import pytest
import torch
from common.planner import check_plan, ref_cut_ok, resolvable, units
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ragged_placement.planner import Granularity, chunk_lower_bound, plan, plan_units

# -- independent references -------------------------------------------------------------------


def shard0_padding(shapes: dict[str, tuple[int, ...]], world: int) -> int:
    """FSDP2: every parameter's dim 0 padded up to a multiple of the world size."""
    return sum(
        (-(-s[0] // world) * world - s[0]) * math.prod(s[1:]) for s in shapes.values()
    )


# -- strategies -------------------------------------------------------------------------------


# -- properties -------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(units(), st.integers(1, 9), st.sampled_from([None, 4, 8, 16]))
def test_plan_invariants(unit, world, align_bytes):
    shapes, grans = unit
    if not resolvable(shapes, grans):
        return
    p = plan(shapes, world, granularity=grans, dtype=torch.float32, align_bytes=align_bytes)
    check_plan(p, shapes, grans)
    align = (align_bytes or 4) // 4
    assert p.chunk_numel % align == 0 and all(o % align == 0 for o in p.offsets.values())
    assert p.chunk_numel >= chunk_lower_bound([p.specs[n] for n in shapes], world, align)
    # deterministic: same input, same plan, from a fresh computation
    from ragged_placement.planner.plan import _planned, _rotated

    _planned.cache_clear()
    _rotated.cache_clear()
    again = plan(shapes, world, granularity=grans, dtype=torch.float32, align_bytes=align_bytes)
    assert again.digest() == p.digest()
    # rotated copies (plan_units) keep every invariant and the padding
    for q in plan_units([shapes] * 3, world, granularity=grans, dtype=torch.float32,
                        align_bytes=align_bytes):
        check_plan(q, shapes, grans)
        assert q.padding_numel == p.padding_numel


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=3), min_size=1, max_size=8),
       st.integers(1, 64))
def test_element_granularity_never_pads_more_than_fsdp2(shape_list, world):
    shapes = {f"p{i}": tuple(s) for i, s in enumerate(shape_list)}
    p = plan(shapes, world, granularity=Granularity.element())
    check_plan(p, shapes, {n: Granularity.element() for n in shapes})
    assert p.padding_numel <= shard0_padding(shapes, world)
    assert p.padding_numel < world  # one flat pad: FSDP1's


def _brute_force_chunk(shapes, grans, world) -> int:
    """The smallest S with a valid layout, by exhaustive search over orders and paddings."""
    names = list(shapes)
    sizes = {n: math.prod(shapes[n]) for n in names}
    total = sum(sizes.values())
    s = max(-(-total // world), 1)
    while True:
        cap = s * world

        def fits(rest, pos):
            if not rest:
                return True
            for i, n in enumerate(rest):
                for o in range(pos, cap - sizes[n] + 1):
                    if all(
                        ref_cut_ok(shapes[n], grans[n], r * s - o)
                        for r in range(1, world)
                        if o < r * s < o + sizes[n]
                    ) and fits(rest[:i] + rest[i + 1:], o + sizes[n]):
                        return True
            return False

        if fits(names, 0):
            return s
        s += 1


@st.composite
def tiny_units(draw):
    """Units small enough for exhaustive search: <= 3 parameters, <= 24 elements."""
    shapes, grans = {}, {}
    for i in range(draw(st.integers(1, 3))):
        ndim = draw(st.integers(1, 3))
        shape = tuple(draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim)))
        g = draw(st.sampled_from([Granularity.element(), Granularity.row(), Granularity.rows(2),
                                  Granularity.block(2, 2), Granularity.matrix(),
                                  Granularity.matrices()]))
        if g.kind == "block" and ndim < 2:
            g = Granularity.row()
        shapes[f"p{i}"], grans[f"p{i}"] = shape, g
    return shapes, grans


@settings(max_examples=60, deadline=None)
@given(tiny_units(), st.integers(2, 4))
def test_lower_bound_and_planner_against_brute_force(unit, world):
    shapes, grans = unit
    if sum(math.prod(s) for s in shapes.values()) > 24:
        return
    p = plan(shapes, world, granularity=grans)
    best = _brute_force_chunk(shapes, grans, world)
    assert p.chunk_lower_bound <= best <= p.chunk_numel


# -- targeted cases ---------------------------------------------------------------------------


def test_stacked_experts_cut_between_experts_or_bands():
    shapes = {"experts.w1": (4, 300, 64), "norm": (64,)}
    grans = {"experts.w1": Granularity.block(128, 128), "norm": Granularity.element()}
    for world in (2, 3, 5, 8, 16):
        p = plan(shapes, world, granularity=grans)
        check_plan(p, shapes, grans)
        assert p.placements["experts.w1"].dims == (0, 1)


def test_keep_dims_whole_tensor_parallel():
    shapes = {"w": (8, 6, 4)}
    g = Granularity.element(keep_dims_whole=(1,))
    p = plan(shapes, 4, granularity=g)
    check_plan(p, shapes, {"w": g})
    assert p.placements["w"].dims == (0,)  # only whole [6, 4] slices move
    whole = plan(shapes, 4, granularity=Granularity.row(keep_dims_whole=(0,)))
    assert sum(1 for u in whole.placements["w"].local_units if u) == 1


def test_policy_forms_and_errors():
    shapes = [("layers.0.w", (256, 64)), ("layers.0.b", (64,))]
    by_pattern = plan(shapes, 4, granularity={"*.w": Granularity.block(128, 128)})
    by_callable = plan(
        shapes, 4,
        granularity=lambda n, s: Granularity.block(128, 128) if len(s) == 2 else Granularity.element(),
    )
    assert by_pattern.digest() == by_callable.digest()
    assert by_pattern.granularities["layers.0.b"] == Granularity.element()
    with pytest.raises(ValueError, match="layers.0.b"):
        plan(shapes, 4, granularity=Granularity.block(128, 128))
    with pytest.raises(ValueError, match="world_size"):
        plan(shapes, 0)
    with pytest.raises(ValueError, match="twice"):
        plan([("a", (2,)), ("a", (3,))], 2)
    with pytest.raises(ValueError, match="0-d"):
        plan({"s": ()}, 2)
    with pytest.raises(ValueError, match="align_bytes"):
        plan(shapes, 4, dtype=torch.float32, align_bytes=6)
    with pytest.raises(ValueError, match="keep_dims_whole"):
        plan({"w": (4, 4)}, 2, granularity=Granularity.row(keep_dims_whole=(2,)))


def test_whole_matrices_balance_newton_schulz_work():
    # four 64x64 and four 32x32 matrices on 4 ranks: padding-minimal S holds one big + one small
    shapes = {f"big{i}": (64, 64) for i in range(4)} | {f"small{i}": (32, 32) for i in range(4)}
    p = plan(shapes, 4, granularity=Granularity.matrix())
    check_plan(p, shapes, {n: Granularity.matrix() for n in shapes})
    assert p.padding_numel == 0
    work = p.rank_work()
    assert work.max() == work.min() == 64**3 + 32**3


def test_local_views_and_rendering(tmp_path):
    shapes = {"a": (5, 3), "b": (7,), "c": (2, 4, 3)}
    p = plan(shapes, 3, granularity={"c": Granularity.block(2, 2)})
    full = {n: torch.randn(s) for n, s in shapes.items()}
    flat = torch.zeros(p.chunk_numel * p.world_size)
    for n, t in full.items():
        flat[p.offsets[n]:p.offsets[n] + t.numel()] = t.flatten()
    for r in range(p.world_size):
        views = p.local_views(flat[r * p.chunk_numel:(r + 1) * p.chunk_numel], r)
        for n, t in full.items():
            torch.testing.assert_close(views[n], p.placements[n].shard_local(t, r), rtol=0, atol=0)
    text = p.ascii_map()
    assert all(f"rank {r}" in text for r in range(3)) and "a[" in text
    path = tmp_path / "plan.png"
    p.save_png(str(path))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(data[16:20], "big") == 512
    assert "padding" in p.summary()


def test_plan_units_rotates_identical_units_round_robin():
    unit = {"a": (8, 8), "b": (4, 4)}
    g = Granularity.matrix()
    alone = [plan(unit, 8, granularity=g) for _ in range(4)]
    spread = plan_units([unit] * 4, 8, granularity=g)
    assert [p.padding_numel for p in spread] == [p.padding_numel for p in alone]
    assert [p.rank_offset for p in spread] == [0, 2, 4, 6]
    for p in spread:
        check_plan(p, unit, {"a": g, "b": g})
    total = sum(p.rank_work() for p in spread)
    assert total.tolist() == [8**3, 4**3] * 4  # one matrix per rank
    assert sum(p.rank_work() for p in alone).tolist() == [4 * 8**3, 4 * 4**3] + [0] * 6


def test_rank_offset_must_not_split_a_parameter():
    shapes = {"w": (16, 4), "n": (4,)}
    base = plan(shapes, 4)  # w spans ranks 0-3 (+ n): only a rotation keeping w whole is valid
    assert base.rank_span("w") == (0, 3)
    with pytest.raises(ValueError, match="rank_offset=1"):
        plan(shapes, 4, rank_offset=1)
    with pytest.raises(ValueError, match="rank_offset"):
        plan(shapes, 4, rank_offset=4)


def test_empty_parameters():
    shapes = {"e": (0, 3), "z": (4, 0), "w": (5, 2), "b": (0,)}
    grans = {n: Granularity.row() for n in shapes}
    p = plan(shapes, 3, granularity=grans)
    check_plan(p, shapes, grans)
    chunk = torch.arange(float(p.chunk_numel))
    for r in range(3):
        views = p.local_views(chunk, r)
        assert {n: tuple(v.shape) for n, v in views.items()} == {
            n: p.placements[n].local_shape(shapes[n], r) for n in shapes
        }
