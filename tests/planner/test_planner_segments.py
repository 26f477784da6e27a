"""Segmented plans: invariants, a simulated all-gather round trip, and the padding guarantees."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from common.planner import block_shard0_padding, check_plan, resolvable, units
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ragged_placement.planner import Granularity, Plan, SegmentedPlan, plan, plan_segmented

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))


def check_segmented(p: Plan | SegmentedPlan, shapes, grans) -> None:
    """Each segment is a valid plan; the unit's offsets, slices and views are the segments'."""
    parts = p.parts if isinstance(p, SegmentedPlan) else (p,)
    assert sum(s.chunk_numel for s in p.segments) == p.chunk_numel
    covered = set()
    for seg, part in zip(p.segments, parts):
        check_plan(part, {n: shapes[n] for n in part.names}, {n: grans[n] for n in part.names})
        for n in part.names:
            assert p.offsets[n] == seg.buffer_offset + part.offsets[n]
            for r in range(p.world_size):
                b, e = part.local_slice(n, r)
                assert p.local_slice(n, r) == (seg.chunk_offset + b, seg.chunk_offset + e)
            covered.add(n)
    assert covered == set(shapes)
    assert p.padding_numel == p.chunk_numel * p.world_size - sum(math.prod(s) for s in shapes.values())


def gather_round_trip(p: Plan | SegmentedPlan, shapes) -> None:
    """Fill every rank's chunk from the full tensors through ``local_views``, all-gather each
    segment into its place in the unsharded buffer, and read every parameter back as a view."""
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    w = p.world_size
    chunks = []
    for r in range(w):
        chunk = torch.full((p.chunk_numel,), float("nan"))
        for n, view in p.local_views(chunk, r).items():
            view.copy_(p.placements[n].shard_local(full[n], r).reshape(view.shape))
        chunks.append(chunk)
    unsharded = torch.full((p.chunk_numel * w,), float("nan"))
    for seg in p.segments:
        for r in range(w):
            dst = seg.buffer_offset + r * seg.chunk_numel
            unsharded[dst:dst + seg.chunk_numel] = chunks[r][seg.chunk_offset:seg.chunk_offset + seg.chunk_numel]
    for n, s in shapes.items():
        o = p.offsets[n]
        assert torch.equal(unsharded[o:o + math.prod(s)].view(s), full[n]), n


@SETTINGS
@given(unit=units(), world=st.integers(1, 9))
def test_segmented_plan_invariants_round_trip_and_padding(unit, world):
    shapes, grans = unit
    if not resolvable(shapes, grans):
        return
    policy = lambda name, shape: grans[name]  # noqa: E731
    p = plan_segmented(shapes, world, policy, torch.float32)
    check_segmented(p, shapes, grans)
    gather_round_trip(p, shapes)
    # never worse than the single layout, and never worse than per-parameter block Shard(0)
    assert p.padding_numel <= plan(shapes, world, policy, torch.float32).padding_numel
    per_param_fits = sum(1 for n in shapes) <= 16
    if per_param_fits and all(g.kind in ("element", "row", "rows", "block") for g in grans.values()):
        assert p.padding_numel <= block_shard0_padding(shapes, grans, world)


def test_llama_layer_at_8_ranks_needs_no_padding_with_segments():
    h, i = 4096, 14336
    layer = {"q": (4096, h), "k": (1024, h), "v": (1024, h), "o": (h, 4096), "gate": (i, h), "up": (i, h),
             "down": (h, i), "norm1": (h,), "norm2": (h,)}
    policy = lambda name, shape: Granularity.block(128, 128) if len(shape) == 2 else Granularity.element()  # noqa: E731
    single = plan(layer, 8, policy)
    seg = plan_segmented(layer, 8, policy)
    # one flat layout: S must be a multiple of lcm(128*4096, 128*14336) = 3,670,016 elements
    assert single.chunk_numel % 3_670_016 == 0 and single.padding_fraction > 0.07
    assert isinstance(seg, SegmentedPlan) and seg.padding_numel == 0
    check_segmented(seg, layer, {n: policy(n, s) for n, s in layer.items()})


def test_one_segment_wins_returns_a_plain_plan_and_bad_arguments():
    # same band size: one layout pads nothing, so the tie goes to one segment
    p = plan_segmented({"w": (64, 8), "v": (32, 8)}, 4)
    assert isinstance(p, Plan) and p.padding_numel == 0 and p.segments[0].chunk_numel == p.chunk_numel
    with pytest.raises(ValueError, match="max_segments"):
        plan_segmented({"w": (8, 8)}, 2, max_segments=0)
    with pytest.raises(ValueError, match="world_size"):
        plan_segmented({"w": (8, 8)}, 0)


@SETTINGS
@given(unit=units(), world=st.integers(1, 9), data=st.data())
def test_submodule_groups_never_pad_more_and_are_followed_on_ties(unit, world, data):
    shapes, grans = unit
    if not resolvable(shapes, grans):
        return
    names = list(shapes)
    # a random partition of the names into consecutive groups (submodules hold consecutive names)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(names) - 1)), max_size=len(names))))
    bounds = [0] + [c for c in cuts if c < len(names)] + [len(names)]
    groups = [names[a:b] for a, b in itertools.pairwise(bounds) if b > a]
    policy = lambda name, shape: grans[name]  # noqa: E731
    with_groups = plan_segmented(shapes, world, policy, torch.float32, groups=groups)
    without = plan_segmented(shapes, world, policy, torch.float32)
    check_segmented(with_groups, shapes, grans)
    gather_round_trip(with_groups, shapes)
    assert with_groups.padding_numel <= without.padding_numel
    # When the groups change the plan, a candidate built from them won: each segment holds
    # parameters of consecutive groups (folding merges neighbours), or it is one band class of
    # a folded run of groups (a band split may then skip a group: groups 0 and 2 share a band,
    # group 1 holds another), so its cut parameters share one band.
    def seg_names(p):
        return [part.names for part in getattr(p, "parts", (p,))]

    if seg_names(with_groups) != seg_names(without):
        group_of = {n: k for k, g in enumerate(groups) for n in g}
        for part in with_groups.parts:
            spans = {group_of[n] for n in part.names}
            if spans == set(range(min(spans), max(spans) + 1)):
                continue
            specs = [part.specs[n] for n in part.names]
            bands = {(c.band_numel, c.period_numel) for c in specs
                     if not c.whole and c.numel > c.band_numel}
            assert len(bands) == 1, (part.names, groups, bands)


def test_submodule_groups_split_the_root_of_a_tensor_parallel_llama():
    # the root unit of benchmarks/compose.py at dp=2: embedding, final norm, output projection
    root = {"tok_embeddings.weight": (256, 256), "norm.weight": (256,), "output.weight": (256, 256)}
    groups = [["tok_embeddings.weight"], ["norm.weight"], ["output.weight"]]
    assert isinstance(plan_segmented(root, 2, dtype=torch.float32), Plan)  # one segment ties
    p = plan_segmented(root, 2, dtype=torch.float32, groups=groups)
    assert isinstance(p, SegmentedPlan) and p.padding_numel == 0
    assert [part.names for part in p.parts] == [tuple(g) for g in groups]
    # a grouping that would pad loses to the single layout
    p = plan_segmented(root, 2, dtype=torch.float32,
                       groups=[["tok_embeddings.weight"], ["norm.weight", "output.weight"]])
    assert p.padding_numel == 0
    with pytest.raises(ValueError, match="groups must partition"):
        plan_segmented(root, 2, groups=[["tok_embeddings.weight"], ["output.weight"]])
    with pytest.raises(ValueError, match="groups must partition"):
        plan_segmented(root, 2, groups=[[], *groups])


def test_parameters_too_small_to_cut_can_be_their_own_segments():
    # found by the property above: two 1-element vectors beside a 3x3 matrix on 3 ranks pad 7
    # as one layout (and as any layout that merges the vectors into the matrix's segment), 4 as
    # per-parameter Shard(0)
    shapes = {"p0": (3, 3), "p1": (1,), "p2": (1,)}
    grans = {"p0": Granularity.row(), "p1": Granularity.element(), "p2": Granularity.element()}
    p = plan_segmented(shapes, 3, lambda n, s: grans[n], torch.float32)
    assert p.padding_numel == block_shard0_padding(shapes, grans, 3) == 4
    check_segmented(p, shapes, grans)
    gather_round_trip(p, shapes)


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 10_000), min_size=1, max_size=64),
       max_padding=st.sampled_from([0.0, 0.01, 0.1]))
def test_gather_starts_pads_to_the_largest_only_within_max_padding(sizes, max_padding):
    """Equal (``None``) exactly when padding every send to the largest adds at most
    ``max_padding`` of the payload; else the prefix sums of the sizes (no padding)."""
    from ragged_placement.planner import gather_starts

    got = gather_starts(sizes, max_padding)
    padding = len(sizes) * max(sizes) - sum(sizes)
    if padding <= max_padding * sum(sizes):
        assert got is None
    else:
        assert got == tuple(sum(sizes[:r]) for r in range(len(sizes) + 1))


def test_gather_starts_bad_arguments_raise_naming_them():
    from ragged_placement.planner import gather_starts

    for bad in (-0.1, True, "1%"):
        with pytest.raises(ValueError, match="max_padding"):
            gather_starts([1, 2], bad)
    for bad in ([], [3, -1]):
        with pytest.raises(ValueError, match="rank_nbytes"):
            gather_starts(bad)
