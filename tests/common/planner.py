"""What the planner tests check every plan against (``tests/planner/``): the units they draw
(``units``, hypothesis), the reference cut rule of a granularity (``ref_cut_ok``, ``ref_dims``),
``check_plan`` (every documented invariant of a plan, for every parameter and rank) and the
padding of a block-keeping per-parameter ``Shard(0)`` (``block_shard0_padding``).
"""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st
from ragged_placement.planner import Granularity
from ragged_placement.planner.granularity import resolve

from ragged_placement.placement import RaggedShard


def ref_cut_ok(shape: tuple[int, ...], gran: Granularity, x: int) -> bool:
    """Whether a cut ``x`` elements into a tensor of ``shape`` respects ``gran``."""
    n = math.prod(shape)
    if x <= 0 or x >= n:
        return True
    if gran.keep_dims_whole and x % math.prod(shape[min(gran.keep_dims_whole):]):
        return False
    if gran.kind == "element":
        return True
    if gran.kind == "matrix" or (gran.kind == "matrices" and len(shape) <= 2):
        return False
    if gran.kind == "matrices":  # between the trailing matrices of a stack
        return x % (shape[-1] * shape[-2]) == 0
    if gran.kind == "rows":
        row_numel = math.prod(shape[1:])
        return x % row_numel == 0 and (x // row_numel) % gran.band_rows == 0
    # block: bands of band_rows rows of the trailing matrix, restarting at every matrix
    cols, rows = shape[-1], shape[-2]
    return x % cols == 0 and ((x // cols) % rows) % gran.band_rows == 0


def ref_dims(shape: tuple[int, ...], gran: Granularity) -> tuple[int, ...]:
    """The RaggedShard dims a granularity documents."""
    nd = {"element": len(shape), "rows": 1, "block": len(shape) - 1, "matrix": 1,
          "matrices": max(len(shape) - 2, 1)}[gran.kind]
    if gran.keep_dims_whole:
        nd = max(min(nd, min(gran.keep_dims_whole)), 1)
    return tuple(range(nd))


def check_plan(p, shapes: dict[str, tuple[int, ...]], grans: dict[str, Granularity]) -> None:
    """Every documented invariant of a plan, for every parameter and rank."""
    s, w = p.chunk_numel, p.world_size
    total = sum(math.prod(sh) for sh in shapes.values())
    assert p.padding_numel == s * w - total >= 0
    assert list(p.names) == list(shapes)
    assert sorted(p.order) == sorted(shapes)
    # parameters are disjoint, in buffer order, inside the buffer
    end = 0
    for name in p.order:
        o = p.offsets[name]
        assert o >= end
        end = o + math.prod(shapes[name])
    assert end <= s * w
    for name, shape in shapes.items():
        o, n, g = p.offsets[name], math.prod(shape), grans[name]
        pl = p.placements[name]
        assert isinstance(pl, RaggedShard)
        assert p.shapes[name] == torch.Size(shape)
        assert pl.dims == ref_dims(shape, g), (name, pl, g)
        assert len(pl.local_units) == w
        row_numel = math.prod(shape[len(pl.dims):])
        rows = math.prod(shape[:len(pl.dims)])
        assert sum(pl.local_units) * pl.unit_rows(shape) == rows  # units sum to the rows
        # no block is ever cut
        for r in range(1, w):
            if o < r * s < o + n:
                assert ref_cut_ok(shape, g, r * s - o), (name, shape, g, r * s - o)
        for r in range(w):
            lo, hi = max(o, r * s), min(o + n, (r + 1) * s)
            b, e = p.local_slice(name, r)
            r0, r1 = pl.local_row_range(shape, r)
            if lo < hi:
                assert (b, e) == (lo - r * s, hi - r * s)
                assert (r0 * row_numel, r1 * row_numel) == (lo - o, hi - o)
            else:
                assert b == e and (r1 - r0) * row_numel == 0
            assert pl.local_shape(shape, r)[0] * row_numel == max(hi - lo, 0)


GRANS = [
    Granularity.element(),
    Granularity.row(),
    Granularity.rows(3),
    Granularity.block(4, 4),
    Granularity.matrix(),
    Granularity.matrices(),
]


@st.composite
def units(draw, max_params: int = 7):
    """A small FSDP unit: shapes of 1-3 dims with a granularity each."""
    shapes: dict[str, tuple[int, ...]] = {}
    grans: dict[str, Granularity] = {}
    for i in range(draw(st.integers(1, max_params))):
        ndim = draw(st.integers(1, 3))
        shape = tuple(draw(st.lists(st.integers(1, 12), min_size=ndim, max_size=ndim)))
        options = [g for g in GRANS if not (g.kind == "block" and ndim < 2)]
        g = draw(st.sampled_from(options))
        if ndim >= 2 and draw(st.booleans()):
            keep = draw(st.integers(1, ndim - 1))
            if g.kind not in ("matrix", "matrices"):
                g = Granularity(g.kind, g.band_rows, g.block_cols, (keep,))
        shapes[f"p{i}"] = shape
        grans[f"p{i}"] = g
    return shapes, grans


def resolvable(shapes, grans) -> bool:
    try:
        for n, s in shapes.items():
            resolve(n, s, grans[n])
    except ValueError:
        return False
    return True


def block_shard0_padding(shapes: dict[str, tuple[int, ...]], grans: dict[str, Granularity], world: int) -> int:
    """Per-parameter Shard(0) that keeps blocks whole: dim 0 padded to a multiple of
    ``world * band_rows`` (band rows 1 for element and row granularities)."""
    pad = 0
    for name, s in shapes.items():
        g = grans[name]
        band = g.band_rows if g.kind in ("rows", "block") else 1
        step = world * band
        pad += (-(-s[0] // step) * step - s[0]) * math.prod(s[1:])
    return pad
