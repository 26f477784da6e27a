"""The planner's three layouts declare one interface (:class:`FlatLayout`), the one the FSDP
runtime reads."""

from __future__ import annotations

import types

from ragged_placement.planner import plan, plan_segmented
from ragged_placement.planner.layout import FlatLayout
from ragged_placement.planner.uneven import plan_uneven

SHAPES = [("a", (300, 7)), ("b", (5,)), ("c", (64, 64))]


def _members() -> list[str]:
    return [
        m for m in dir(FlatLayout)
        if not m.startswith("_") and m not in dir(object)
    ] + list(FlatLayout.__annotations__)


def test_plan_segmented_and_uneven_layouts_are_flat_layouts():
    layouts = [
        plan(SHAPES, 4),
        plan_segmented(SHAPES, 4, groups=[["a", "b"], ["c"]]),
        plan_uneven(SHAPES, 4),
    ]
    assert [type(p).__name__ for p in layouts] == ["Plan", "SegmentedPlan", "UnevenPlan"]
    for p in layouts:
        assert isinstance(p, FlatLayout), type(p).__name__
        # and each member is there with its meaning: rank chunks tile the buffer's segments
        assert sum(s.chunk_numel for s in p.segments) == p.chunk_numel
        assert p.buffer_numel - p.numel == p.padding_numel


def test_a_layout_missing_a_member_is_not_one():
    p = plan(SHAPES, 4)
    members = set(_members())
    assert {"segments", "local_views", "check_consistent", "chunk_numel"} <= members
    partial = types.SimpleNamespace(**{m: getattr(p, m) for m in members if m != "digest"})
    assert not isinstance(partial, FlatLayout)
    whole = types.SimpleNamespace(**{m: getattr(p, m) for m in members})
    assert isinstance(whole, FlatLayout)
