"""Which part of a tensor each rank holds, as boxes, and where it sits in the local tensor.

Every redistribution step on one mesh dimension moves data between two placements of the same
"level" tensor (the tensor that mesh dimension splits, after the splits of earlier mesh dims).
This module describes, for ``Replicate``, ``Partial``, ``Shard(d)`` and ``RaggedShard``:

* the *region* of a rank: a list of boxes (half-open index ranges over the leading ``k`` dims of
  the level tensor; the remaining dims are an opaque row carried whole), and
* the *addressing* of its local tensor: the strides and origin that map a box to an
  ``as_strided`` view of the (contiguous) local tensor, with no copy.

A RaggedShard run of flattened rows ``[a, b)`` over ``j`` prefix dims decomposes into at most
``2 * j - 1`` boxes, each contiguous in memory; its local tensor is the full tensor's flat storage
shifted by ``a`` rows, so it shares the full tensor's strides.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from ragged_placement.placement import RaggedShard

Box = tuple[tuple[int, int], ...]

__all__ = [
    "Box",
    "Layout",
    "involved_dims",
    "layout",
    "flat_range_boxes",
    "intersect",
    "box_numel",
    "shard_size_and_offset",
    "cut_shape",
]


def shard_size_and_offset(size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """torch's ``Shard`` chunking: ``ceil(size / n)`` per rank, trailing ranks short or empty."""
    full = -(-size // num_chunks) if size else 0
    offset = min(full * index, size)
    return min(full, size - offset), offset


def cut_shape(shape: Sequence[int], placement: Placement, index: int, num_chunks: int) -> list[int]:
    """Shape of the piece rank ``index`` of ``num_chunks`` holds after ``placement`` cuts a tensor
    of ``shape``: ``Shard`` chunks its dim as torch does; a ``RaggedShard`` gives its local
    ``(rows, *row_shape)`` (its flattened prefix becomes one dim); others keep ``shape``."""
    if isinstance(placement, RaggedShard):
        return list(placement.local_shape(shape, index))
    shape = [int(s) for s in shape]
    if isinstance(placement, Shard):
        shape[placement.dim] = shard_size_and_offset(shape[placement.dim], num_chunks, index)[0]
    return shape


def involved_dims(placement: Placement) -> int:
    """How many leading tensor dims a placement cuts (0 for Replicate / Partial)."""
    if isinstance(placement, RaggedShard):
        return len(placement.dims)
    if isinstance(placement, Shard):
        return placement.dim + 1
    return 0


def box_numel(box: Box) -> int:
    return math.prod(e - s for s, e in box)


def intersect(a: Box, b: Box) -> Box | None:
    out = []
    for (s0, e0), (s1, e1) in zip(a, b):
        s, e = max(s0, s1), min(e0, e1)
        if e <= s:
            return None
        out.append((s, e))
    return tuple(out)


def flat_range_boxes(shape: Sequence[int], start: int, end: int) -> list[Box]:
    """Decompose the row-major flat range ``[start, end)`` of ``shape`` into boxes.

    Each box is contiguous in row-major order; there are at most ``2 * len(shape) - 1``.
    """
    shape = tuple(int(s) for s in shape)
    if start >= end:
        return []
    if len(shape) == 1:
        return [((start, end),)]
    inner = math.prod(shape[1:])
    i0, r0 = divmod(start, inner)
    i1, r1 = divmod(end, inner)
    boxes: list[Box] = []
    if i0 == i1:  # within one outer index
        return [((i0, i0 + 1), *b) for b in flat_range_boxes(shape[1:], r0, r1)]
    if r0:
        boxes += [((i0, i0 + 1), *b) for b in flat_range_boxes(shape[1:], r0, inner)]
        i0 += 1
    if i1 > i0:
        boxes.append(((i0, i1), *((0, s) for s in shape[1:])))
    if r1:
        boxes += [((i1, i1 + 1), *b) for b in flat_range_boxes(shape[1:], 0, r1)]
    return boxes


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides torch gives a contiguous tensor of ``shape`` (a size-0 dim counts as 1)."""
    return tuple(torch.empty(tuple(shape), device="meta").stride())


def _row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


@dataclass(frozen=True)
class Layout:
    """Region of one rank under one placement, and the addressing of its local tensor.

    The local tensor is read as a flat contiguous buffer: an element of global index ``x``
    (leading ``k`` dims) inside ``boxes[i]`` starts at ``(sum(x_j * strides_j) - bases[i]) * row``.
    ``row`` is the numel of the trailing dims, carried whole; ``local_numel`` the numel of the
    local tensor.
    """

    boxes: tuple[Box, ...]
    bases: tuple[int, ...]
    strides: tuple[int, ...]
    row: int
    local_numel: int

    def view(self, flat_local: torch.Tensor, box: Box, i: int) -> torch.Tensor:
        """An ``as_strided`` view of ``box`` (inside ``boxes[i]``, plus the row) into the flat
        local tensor."""
        offset = sum(s * st for (s, _), st in zip(box, self.strides)) - self.bases[i]
        size = tuple(e - s for s, e in box) + (self.row,)
        stride = tuple(st * self.row for st in self.strides) + (1,)
        return flat_local.as_strided(size, stride, flat_local.storage_offset() + offset * self.row)


def layout(placement: Placement, shape: Sequence[int], row: int, index: int, num_chunks: int) -> Layout:
    """The :class:`Layout` of rank ``index`` of ``num_chunks`` under ``placement``.

    ``shape`` are the leading dims of the level tensor that the step involves (at least
    ``involved_dims(placement)`` of them); ``row`` is the numel of the remaining dims.
    """
    shape = tuple(int(s) for s in shape)
    full_box: Box = tuple((0, s) for s in shape)
    if isinstance(placement, RaggedShard):
        j = len(placement.dims)
        tail = shape[j:]
        inner = math.prod(tail)
        boxes, bases, held = [], [], 0
        # each run is contiguous in the full tensor: full strides, shifted to where it sits locally
        for start, end in placement.runs(shape[:j], index):
            for b in flat_range_boxes(shape[:j], start, end):
                boxes.append((*b, *((0, s) for s in tail)))
                bases.append((start - held) * inner)
            held += end - start
        return Layout(tuple(boxes), tuple(bases), _row_major_strides(shape), row, held * inner * row)
    if isinstance(placement, Shard):
        d = placement.dim
        size, off = shard_size_and_offset(shape[d], num_chunks, index)
        local_shape = shape[:d] + (size,) + shape[d + 1:]
        strides = _row_major_strides(local_shape)
        box = full_box[:d] + ((off, off + size),) + full_box[d + 1:]
        boxes, bases = ((box,), (off * strides[d],)) if size else ((), ())
        return Layout(boxes, bases, strides, row, math.prod(local_shape) * row)
    if isinstance(placement, (Replicate, Partial)):
        return Layout((full_box,), (0,), _row_major_strides(shape), row, math.prod(shape) * row)
    raise NotImplementedError(f"no region rule for placement {placement!r}")
