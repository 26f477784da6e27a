"""``plan()``: the flat layout and RaggedShard placements of one FSDP unit."""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ragged_placement.placement import RaggedShard
from ragged_placement.planner.granularity import (
    CutSpec,
    Granularity,
    GranularityPolicy,
    resolve,
    resolve_policy,
)
from ragged_placement.planner.packing import Layout, pack

__all__ = ["Plan", "Placements", "Segment", "plan", "plan_units"]

NamedShapes = Mapping[str, Sequence[int]] | Sequence[tuple[str, Sequence[int]]]


def _placement(spec: CutSpec, offset: int, chunk: int, world_size: int) -> RaggedShard:
    """The RaggedShard that chunk boundaries ``r * chunk`` induce on a parameter at ``offset``."""
    dims = tuple(range(spec.prefix))
    numel = spec.numel
    if numel == 0:
        units = [0] * world_size
        units[min(offset // chunk, world_size - 1)] = 1
        return RaggedShard._unchecked(dims, tuple(units))
    first, last = offset // chunk, (offset + numel - 1) // chunk
    runs = [
        (min(offset + numel, (r + 1) * chunk) - max(offset, r * chunk)) // spec.row_numel
        for r in range(first, last + 1)
    ]
    g = functools.reduce(math.gcd, runs)
    units = [0] * first + [x // g for x in runs] + [0] * (world_size - 1 - last)
    return RaggedShard._unchecked(dims, tuple(units))  # valid by construction: O(1) checks


class Placements(Mapping[str, RaggedShard]):
    """``{name: RaggedShard}`` of a plan, each built on first access.

    A placement holds one unit count per rank, so building one is O(world size); plans of large
    worlds build only what is asked for. Plans of identical units share the built placements.
    """

    def __init__(self, names: Sequence[str], specs: Sequence[CutSpec], layout: Layout,
                 built: list[RaggedShard | None]) -> None:
        self._index = {n: i for i, n in enumerate(names)}
        self._specs = specs
        self._layout = layout
        self._built = built

    def __getitem__(self, name: str) -> RaggedShard:
        i = self._index[name]
        pl = self._built[i]
        if pl is None:
            lay = self._layout
            pl = _placement(self._specs[i], lay.offsets[i], lay.chunk_numel, lay.world_size)
            self._built[i] = pl
        return pl

    def __iter__(self):
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def __repr__(self) -> str:
        return f"Placements({len(self)} parameters over {self._layout.world_size} ranks)"


@functools.lru_cache(maxsize=256)
def _planned(
    specs: tuple[CutSpec, ...], world_size: int, align: int
) -> tuple[Layout, list[RaggedShard | None]]:
    """Layout of ``specs`` and its (lazily built) placements; identical units share both."""
    return pack(specs, world_size, align), [None] * len(specs)


def _crossed_boundaries(layout: Layout, specs: Sequence[CutSpec]) -> list[tuple[int, int]]:
    """Merged ``[lo, hi]`` ranges of chunk boundaries ``b`` (at ``b * S``) inside a parameter."""
    s = layout.chunk_numel
    spans = sorted(
        (o // s + 1, (o + sp.numel - 1) // s)
        for o, sp in zip(layout.offsets, specs)
        if sp.numel and (o + sp.numel - 1) // s > o // s
    )
    merged: list[tuple[int, int]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _rotation_at_or_after(layout: Layout, specs: Sequence[CutSpec], wanted: int) -> int:
    """The smallest valid rank offset ``k >= wanted`` (cyclically; 0 is always valid).

    Rotating by ``k`` moves buffer position ``x`` to ``(x + k*S) mod (W*S)``; it is valid when
    no parameter contains the boundary ``(W - k) * S`` that becomes the end of the buffer."""
    w = layout.world_size
    b = w - wanted % w  # boundary that must be free; b == w means k == 0
    for lo, hi in reversed(_crossed_boundaries(layout, specs)):
        if lo <= b <= hi:
            b = lo - 1
        elif hi < b:
            break
    return (w - b) % w


@functools.lru_cache(maxsize=1024)
def _rotated(
    specs: tuple[CutSpec, ...], world_size: int, align: int, k: int
) -> tuple[Layout, list[RaggedShard | None]]:
    """The layout of :func:`_planned` rotated by ``k`` chunks (``rank_offset``)."""
    base, built = _planned(specs, world_size, align)
    if k == 0:
        return base, built
    if _rotation_at_or_after(base, specs, k) != k:
        raise ValueError(
            f"rank_offset={k} would split a parameter across the end of the buffer; the next "
            f"valid offset is {_rotation_at_or_after(base, specs, k)}"
        )
    total = base.chunk_numel * world_size
    offsets = tuple((o + k * base.chunk_numel) % total for o in base.offsets)
    order = tuple(sorted(range(len(specs)), key=lambda i: (offsets[i], i)))
    layout = Layout(base.chunk_numel, world_size, order, offsets, base.chunk_lower_bound, base.attempts)
    return layout, [None] * len(specs)


def _normalize(named_shapes: NamedShapes) -> list[tuple[str, tuple[int, ...]]]:
    items = named_shapes.items() if isinstance(named_shapes, Mapping) else named_shapes
    out: list[tuple[str, tuple[int, ...]]] = []
    seen: set[str] = set()
    for entry in items:
        try:
            name, shape = entry
        except (TypeError, ValueError):
            raise ValueError(f"named_shapes entries must be (name, shape) pairs, got {entry!r}") from None
        if not isinstance(name, str):
            raise ValueError(f"parameter names must be str, got {name!r}")
        if name in seen:
            raise ValueError(f"parameter name {name!r} appears twice in named_shapes")
        seen.add(name)
        try:
            dims = tuple(shape)
        except TypeError:
            raise ValueError(f"shape of {name!r} must be a sequence of ints, got {shape!r}") from None
        if not all(type(d) is int for d in dims):
            raise ValueError(f"shape of {name!r} must be a sequence of ints, got {shape!r}")
        out.append((name, dims))
    if not out:
        raise ValueError("named_shapes is empty: a plan needs at least one parameter")
    return out


@dataclass(frozen=True)
class Segment:
    """Where one flat layout sits in a unit: its chunk starts at ``chunk_offset`` inside every
    rank's chunk, its ``world_size * chunk_numel`` elements at ``buffer_offset`` in the unsharded
    buffer. A :class:`Plan` is one segment; a ``SegmentedPlan`` has several.

    An uneven segment (``rank_starts`` given, from an ``UnevenPlan``) splits its buffer of
    ``rank_starts[-1]`` elements unevenly: rank ``r`` holds ``[rank_starts[r], rank_starts[r+1])``
    of it, at ``chunk_offset`` in its chunk; ``chunk_numel`` is then the largest of those."""

    chunk_offset: int
    buffer_offset: int
    chunk_numel: int
    rank_starts: tuple[int, ...] | None = None

    @property
    def uneven(self) -> bool:
        return self.rank_starts is not None

    def buffer_numel(self, world_size: int) -> int:
        """Elements of this segment in the unsharded buffer."""
        return self.rank_starts[-1] if self.rank_starts is not None else world_size * self.chunk_numel

    def rank_range(self, rank: int) -> tuple[int, int]:
        """``[begin, end)`` of ``rank``'s chunk in this segment's unsharded buffer."""
        if self.rank_starts is not None:
            return self.rank_starts[rank], self.rank_starts[rank + 1]
        return rank * self.chunk_numel, (rank + 1) * self.chunk_numel


class Plan:
    """The flat layout of one FSDP unit over ``world_size`` ranks and its RaggedShard placements.

    The global flat buffer has ``chunk_numel * world_size`` elements; rank ``r`` owns
    ``[r * chunk_numel, (r + 1) * chunk_numel)``. Parameter ``n`` occupies
    ``[offsets[n], offsets[n] + numel)`` in row-major order, so the local run of rank ``r`` is
    the intersection of the two, and ``placements[n].local_row_range(shape, r)`` times the row
    numel is exactly that intersection relative to ``offsets[n]``. Build with :func:`plan`.
    """

    def __init__(
        self,
        names: Sequence[str],
        specs: Sequence[CutSpec],
        granularities: Sequence[Granularity],
        layout: Layout,
        built: list[RaggedShard | None],
        dtype: torch.dtype,
        rank_offset: int = 0,
    ) -> None:
        self.world_size: int = layout.world_size
        self.names: tuple[str, ...] = tuple(names)
        self.order: tuple[str, ...] = tuple(self.names[i] for i in layout.order)
        sizes: dict[CutSpec, torch.Size] = {}  # torch.Size is slow to build; layers repeat shapes
        self.shapes: dict[str, torch.Size] = {
            n: sizes.get(s) or sizes.setdefault(s, torch.Size(s.shape)) for n, s in zip(names, specs)
        }
        self.granularities: dict[str, Granularity] = dict(zip(names, granularities))
        self.specs: dict[str, CutSpec] = dict(zip(names, specs))
        self.offsets: dict[str, int] = dict(zip(names, layout.offsets))
        self.placements: Placements = Placements(names, specs, layout, built)
        self.chunk_numel: int = layout.chunk_numel
        self.chunk_lower_bound: int = layout.chunk_lower_bound
        self.numel: int = sum(s.numel for s in specs)
        self.buffer_numel: int = self.chunk_numel * self.world_size
        self.padding_numel: int = self.buffer_numel - self.numel
        self.dtype: torch.dtype = dtype
        self.attempts: int = layout.attempts
        self.rank_offset: int = rank_offset

    # -- geometry ---------------------------------------------------------------------------
    @property
    def segments(self) -> tuple[Segment, ...]:
        """One segment: rank ``r``'s chunk is ``[r * S, (r + 1) * S)`` of the unsharded buffer."""
        return (Segment(0, 0, self.chunk_numel),)

    def rank_numel(self, rank: int) -> int:
        """Elements of ``rank``'s chunk (every rank's: ``chunk_numel``)."""
        self._check_rank(rank)
        return self.chunk_numel

    def segment_index(self, name: str) -> int:
        """Index in :attr:`segments` of the segment holding ``name`` (always 0 here)."""
        if name not in self.offsets:
            raise ValueError(f"no parameter named {name!r} in this plan")
        return 0

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}), got {rank!r}")

    def local_slice(self, name: str, rank: int) -> tuple[int, int]:
        """``[begin, end)`` of ``name``'s local run inside ``rank``'s chunk (empty: begin == end)."""
        self._check_rank(rank)
        if name not in self.offsets:
            raise ValueError(f"no parameter named {name!r} in this plan")
        s = self.chunk_numel
        o = self.offsets[name] - rank * s
        begin, end = max(o, 0), min(o + self.specs[name].numel, s)
        if begin >= end:
            begin = end = min(max(o, 0), s)
        return begin, end

    def local_views(self, chunk: torch.Tensor, rank: int) -> dict[str, torch.Tensor]:
        """Views into ``rank``'s flat ``chunk`` (``chunk_numel`` elements), one per parameter,
        each shaped ``placements[name].local_shape(shape, rank)``."""
        self._check_rank(rank)
        if chunk.dim() != 1 or chunk.numel() != self.chunk_numel:
            raise ValueError(
                f"chunk must be 1-D with {self.chunk_numel} elements, got shape {tuple(chunk.shape)}"
            )
        out = {}
        for name in self.names:
            begin, end = self.local_slice(name, rank)
            spec = self.specs[name]
            if spec.row_numel:
                shape = ((end - begin) // spec.row_numel, *spec.shape[spec.prefix:])
            else:  # rows of no elements: only the placement knows how many this rank has
                shape = self.placements[name].local_shape(spec.shape, rank)
            out[name] = chunk[begin:end].view(shape)
        return out

    def rank_span(self, name: str) -> tuple[int, int]:
        """First and last rank (inclusive) holding part of ``name``."""
        o, n, s = self.offsets[name], self.specs[name].numel, self.chunk_numel
        return o // s, max(o + n - 1, o) // s

    def rank_work(self) -> np.ndarray:
        """Optimizer work per rank (float64): Newton-Schulz FLOPs of the matrices a rank owns
        under matrix granularities, its element count under the others."""
        s, w = self.chunk_numel, self.world_size
        work = np.zeros(w, dtype=np.float64)
        for name in self.names:
            spec, o = self.specs[name], self.offsets[name]
            if spec.numel == 0:
                continue
            per = spec.work / spec.numel
            first, last = o // s, (o + spec.numel - 1) // s
            if first == last:
                work[first] += spec.work
            else:
                work[first] += ((first + 1) * s - o) * per
                work[first + 1:last] += s * per
                work[last] += (o + spec.numel - last * s) * per
        return work

    # -- identity ---------------------------------------------------------------------------
    def digest(self) -> str:
        """A stable hash of the plan (shapes, granularities, layout, world size, dtype)."""
        payload = [
            self.world_size,
            self.chunk_numel,
            str(self.dtype),
            [
                [n, list(self.shapes[n]), self.offsets[n], self.specs[n].prefix,
                 self.specs[n].band, self.specs[n].period, self.specs[n].work]
                for n in self.order
            ],
        ]
        return hashlib.sha256(json.dumps(payload, separators=(",", ":")).encode()).hexdigest()

    def check_consistent(self, group: dist.ProcessGroup | None = None) -> None:
        """Raise ``ValueError`` unless every rank of ``group`` holds the same plan."""
        size = dist.get_world_size(group)
        if size != self.world_size:
            raise ValueError(f"the plan is for {self.world_size} ranks but the group has {size}")
        digests: list[str | None] = [None] * size
        dist.all_gather_object(digests, self.digest(), group=group)
        if len(set(digests)) > 1:
            by_digest: dict[str, list[int]] = {}
            for r, d in enumerate(digests):
                by_digest.setdefault(d, []).append(r)
            parts = "; ".join(f"ranks {rs} have {d[:12]}" for d, rs in by_digest.items())
            raise ValueError(f"ranks disagree on the plan (check shapes, names, policy): {parts}")

    # -- reporting --------------------------------------------------------------------------
    @property
    def padding_fraction(self) -> float:
        """Padding as a fraction of the buffer."""
        return self.padding_numel / (self.chunk_numel * self.world_size)

    def summary(self) -> str:
        """A human-readable table of the plan."""
        item = torch.empty((), dtype=self.dtype).element_size()
        lines = [
            f"Plan: {len(self.names)} params, {self.numel:,} elements ({self.dtype}, "
            f"{self.numel * item / 2**20:,.1f} MiB), world {self.world_size}, chunk "
            f"S={self.chunk_numel:,} (lower bound {self.chunk_lower_bound:,}), padding "
            f"{self.padding_numel:,} ({100 * self.padding_fraction:.3f}%)",
        ]
        work = self.rank_work()
        if work.mean() > 0:
            lines.append(f"work max/mean {work.max() / work.mean():.3f}")
        width = max(len(n) for n in self.names)
        for n in self.order:
            o = self.offsets[n]
            first, last = self.rank_span(n)
            lines.append(
                f"  {n:<{width}}  {str(tuple(self.shapes[n])):<20} "
                f"{str(self.granularities[n]):<16} offset {o:>14,}  ranks {first}-{last}"
            )
        return "\n".join(lines)

    def ascii_map(self, width: int = 64, max_ranks: int = 32) -> str:
        """Which rank owns which rows of each parameter, one bar per rank (see render.py)."""
        from ragged_placement.planner.render import ascii_map

        return ascii_map(self, width=width, max_ranks=max_ranks)

    def save_png(self, path: str, width: int = 512, max_ranks: int = 1024) -> None:
        """Write the map as a PNG: one pixel row band per rank, one color per parameter."""
        from ragged_placement.planner.render import save_png

        save_png(self, path, width=width, max_ranks=max_ranks)

    def __repr__(self) -> str:
        return (
            f"Plan(params={len(self.names)}, world_size={self.world_size}, "
            f"chunk_numel={self.chunk_numel}, padding_numel={self.padding_numel})"
        )


def plan(
    named_shapes: NamedShapes,
    world_size: int,
    granularity: GranularityPolicy = None,
    dtype: torch.dtype = torch.bfloat16,
    *,
    rank_offset: int = 0,
    align_bytes: int | None = None,
) -> Plan:
    """Plan the flat buffer of one FSDP unit over ``world_size`` ranks.

    Args:
        named_shapes: ``{name: shape}`` or a sequence of ``(name, shape)``; the input order is
            ``Plan.names``, the buffer order (``Plan.order``) is the planner's choice.
        world_size: ranks of the FSDP mesh dim.
        granularity: ``None`` (rows for >= 2-D, elements for 1-D), one :class:`Granularity`,
            a callable ``(name, shape) -> Granularity``, or ``{fnmatch pattern: Granularity}``
            (first match wins, unmatched names get the default).
        dtype: element type of the buffer (reported in bytes; part of the digest).
        rank_offset: rotate the layout by this many chunks (what rank 0 would hold, rank
            ``rank_offset`` holds), to spread the work of identical units over different
            ranks (:func:`plan_units` picks it). ``ValueError`` if the rotation would split a
            parameter across the end of the buffer.
        align_bytes: if given, every parameter starts, and every chunk is, a multiple of this
            many bytes (e.g. 16 for vectorized and TMA kernels on GPUs), so every local view
            is aligned if the chunk is. Must be a multiple of the dtype's item size. Costs at
            most ``align_bytes`` per parameter and per chunk; ``None`` packs densely.

    The plan depends only on the shapes, granularities and ``world_size``: every rank computes
    the same one (:meth:`Plan.check_consistent` verifies it). Padding is minimized first (no
    granularity block is ever cut), optimizer work is balanced second. Raises ``ValueError`` for
    a granularity a shape cannot take (block granularity on a 1-D tensor, keep_dims_whole beyond
    the tensor's dims). A whole-matrix parameter larger than ``total / world_size`` is not an
    error: the chunk grows to hold it, and the extra is padding.
    """
    align = _check_args(world_size, dtype, align_bytes)
    names, grans, specs = _resolve_unit(named_shapes, granularity)
    if isinstance(rank_offset, bool) or not isinstance(rank_offset, int) or not 0 <= rank_offset < world_size:
        raise ValueError(f"rank_offset must be an int in [0, {world_size}), got {rank_offset!r}")
    layout, built = _rotated(specs, world_size, align, rank_offset)
    return Plan(names, specs, grans, layout, built, dtype, rank_offset)


def _check_args(world_size: int, dtype: torch.dtype, align_bytes: int | None) -> int:
    """Validate the common arguments; the alignment in elements."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
    if align_bytes is None:
        return 1
    item = torch.empty((), dtype=dtype).element_size()
    if isinstance(align_bytes, bool) or not isinstance(align_bytes, int) or align_bytes < 1 \
            or align_bytes % item:
        raise ValueError(
            f"align_bytes must be a positive multiple of the {dtype} item size {item}, "
            f"got {align_bytes!r}"
        )
    return align_bytes // item


def _resolve_unit(named_shapes: NamedShapes, granularity: GranularityPolicy):
    entries = _normalize(named_shapes)
    names = [n for n, _ in entries]
    grans = [resolve_policy(granularity, n, s) for n, s in entries]
    seen: dict[tuple, CutSpec] = {}  # layers repeat shapes: resolve each (shape, granularity) once
    specs = []
    for (n, s), g in zip(entries, grans):
        spec = seen.get((s, g))
        if spec is None:
            spec = seen[(s, g)] = resolve(n, s, g)
        specs.append(spec)
    return names, grans, tuple(specs)


def plan_units(
    units: Sequence[NamedShapes],
    world_size: int,
    granularity: GranularityPolicy = None,
    dtype: torch.dtype = torch.bfloat16,
    *,
    align_bytes: int | None = None,
) -> list[Plan]:
    """Plan every FSDP unit of a model, spreading their optimizer work over the ranks.

    Each unit is planned as by :func:`plan` (same padding), then rotated so that it starts on
    the rank after the last one the previous unit used (round robin, the nearest valid
    rotation at or after it). Identical layers thus put their whole matrices (Muon owners) on
    different ranks instead of stacking them on the first few. Deterministic from the shapes.
    """
    align = _check_args(world_size, dtype, align_bytes)
    plans: list[Plan] = []
    cursor = 0
    for unit in units:
        names, grans, specs = _resolve_unit(unit, granularity)
        layout, _ = _planned(specs, world_size, align)
        k = _rotation_at_or_after(layout, specs, cursor % world_size)
        plans.append(Plan(names, specs, grans, *_rotated(specs, world_size, align, k), dtype, k))
        s = layout.chunk_numel
        used = max((o + sp.numel - 1) // s + 1 for o, sp in zip(layout.offsets, specs) if sp.numel) \
            if any(sp.numel for sp in specs) else 1
        cursor = k + used
    return plans
