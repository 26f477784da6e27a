"""Uneven plans: one flat layout with no padding, cut into per-rank chunks of different sizes.

An equal-chunk layout (:mod:`.packing`) must make its chunk ``S`` a multiple of the band of every
parameter that holds two chunk boundaries. When a unit holds ``q`` bands per rank, that rounds
``S`` up by up to one band, and the buffer pays up to ``W`` bands of padding (``1 / q`` of the
parameters: 25% at 4 bands per rank), more with two band widths (their lcm) or with stacked
experts whose rows are not a multiple of the band (only whole experts are periodic).

An :class:`UnevenPlan` drops the equal-chunk constraint instead of padding for it. The parameters
sit back to back in module order (no padding at all) and rank ``r`` owns
``[rank_starts[r], rank_starts[r + 1])``, where ``rank_starts[r]`` is the allowed cut (a
parameter boundary, a band boundary, or any element of an element-granularity parameter) nearest
to ``r * numel / W``. Consecutive allowed cuts are at most one band apart, so every chunk is
within one band of the mean: ``chunk_numel <= numel / W + band``. The buffer holds exactly the
parameters, so the all-gather moves exactly their bytes; the price is an uneven collective
(:func:`ragged_placement.fsdp.collectives.all_gather_segments`): NCCL runs torch's ``all_gather`` into a
list of uneven views as one group of ``W`` broadcasts, gloo as ``W`` broadcasts (see
``docs/planner-options.md`` for the measured comparison).

Cutting is vectorized over ranks (one ``searchsorted`` and a few array ops), so a unit plans in
``O(W + P)``; placements (``O(W)`` each) are built on first access.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ragged_placement.placement import RaggedShard
from ragged_placement.planner.granularity import CutSpec, Granularity, GranularityPolicy
from ragged_placement.planner.plan import (
    NamedShapes,
    Plan,
    Segment,
    _check_args,
    _resolve_unit,
)

__all__ = [
    "UnevenPlan", "plan_uneven", "uneven_cuts", "cached_uneven_cuts", "shard0_padding",
    "widest_band", "layers_per_unit", "gather_starts",
]


def uneven_cuts(specs: Sequence[CutSpec], world_size: int) -> np.ndarray:
    """``rank_starts`` (``world_size + 1`` int64 offsets) of ``specs`` laid out back to back:
    rank ``r``'s cut is the allowed cut nearest to ``r * numel / W`` (ties to the lower one)."""
    numels = np.array([s.numel for s in specs], dtype=np.int64)
    offsets = np.zeros(len(specs) + 1, dtype=np.int64)
    np.cumsum(numels, out=offsets[1:])
    total = int(offsets[-1])
    starts = np.empty(world_size + 1, dtype=np.int64)
    starts[0], starts[-1] = 0, total
    if world_size == 1:
        return starts
    r = np.arange(1, world_size, dtype=np.int64)
    # round(r * total / W) without float error (r * total < 2**63 for any real unit)
    targets = (r * total + world_size // 2) // world_size
    idx = np.searchsorted(offsets[1:], targets, side="right")  # parameter containing the target
    idx = np.minimum(idx, len(specs) - 1)
    band = np.array([s.band_numel if not s.whole else max(s.numel, 1) for s in specs], np.int64)
    period = np.array([s.period_numel if not s.whole else max(s.numel, 1) for s in specs], np.int64)
    band, period = np.maximum(band, 1), np.maximum(period, 1)
    off, n, b, p = offsets[idx], numels[idx], band[idx], period[idx]
    x = targets - off
    base = x - x % p
    lo = base + ((x - base) // b) * b
    hi = np.minimum(np.minimum(lo + b, base + p), n)
    cut = np.where(x - lo <= hi - x, lo, hi)
    starts[1:-1] = off + cut
    return starts


def _placement(spec: CutSpec, offset: int, starts: np.ndarray) -> RaggedShard:
    """The RaggedShard that the cuts ``starts`` induce on a parameter at ``offset``."""
    dims = tuple(range(spec.prefix))
    w = len(starts) - 1
    numel = spec.numel
    units = np.zeros(w, dtype=np.int64)
    if numel == 0 or spec.row_numel == 0:
        units[min(int(np.searchsorted(starts, offset, side="right")) - 1, w - 1)] = 1
        return RaggedShard._unchecked(dims, tuple(units.tolist()))
    end = offset + numel
    first = int(np.searchsorted(starts, offset, side="right")) - 1
    last = int(np.searchsorted(starts, end, side="left")) - 1
    lo = np.clip(starts[first:last + 1], offset, end)
    hi = np.clip(starts[first + 1:last + 2], offset, end)
    rows = (hi - lo) // spec.row_numel
    g = int(np.gcd.reduce(rows[rows > 0])) if np.any(rows > 0) else 1
    units[first:last + 1] = rows // g
    return RaggedShard._unchecked(dims, tuple(units.tolist()))


class _Placements(Mapping[str, RaggedShard]):
    """``{name: RaggedShard}`` of an uneven plan, each built on first access (O(W) each)."""

    def __init__(self, names: Sequence[str], specs: Sequence[CutSpec], offsets: Sequence[int],
                 starts: np.ndarray) -> None:
        self._index = {n: i for i, n in enumerate(names)}
        self._specs, self._offsets, self._starts = specs, offsets, starts
        self._built: dict[int, RaggedShard] = {}

    def __getitem__(self, name: str) -> RaggedShard:
        i = self._index[name]
        pl = self._built.get(i)
        if pl is None:
            pl = self._built[i] = _placement(self._specs[i], self._offsets[i], self._starts)
        return pl

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


class UnevenPlan:
    """One FSDP unit laid out with no padding and cut into uneven per-rank chunks.

    The same API as :class:`~ragged_placement.planner.Plan`, with these differences: rank ``r``
    owns ``[rank_starts[r], rank_starts[r + 1])`` of the unsharded buffer (``buffer_numel`` =
    ``numel`` elements), ``chunk_numel`` is the largest per-rank chunk (every rank's sharded
    buffer has that size; rank ``r`` uses its first :meth:`rank_numel` elements), and the single
    :class:`~ragged_placement.planner.Segment` carries ``rank_starts`` so that the runtime's
    collectives know the split. Build with :func:`plan_uneven` or
    :func:`~ragged_placement.planner.plan_segmented` (``uneven=True``).
    """

    rank_offset = 0
    attempts = 1

    def __init__(self, names: Sequence[str], specs: Sequence[CutSpec],
                 granularities: Sequence[Granularity], starts: np.ndarray,
                 starts_tuple: tuple[int, ...], dtype: torch.dtype) -> None:
        self.world_size: int = len(starts) - 1
        self.names: tuple[str, ...] = tuple(names)
        self.order: tuple[str, ...] = self.names
        sizes: dict[CutSpec, torch.Size] = {}  # torch.Size is slow to build; layers repeat shapes
        self.shapes = {n: sizes.get(s) or sizes.setdefault(s, torch.Size(s.shape))
                       for n, s in zip(names, specs)}
        self.granularities: dict[str, Granularity] = dict(zip(names, granularities))
        self.specs: dict[str, CutSpec] = dict(zip(names, specs))
        offs = np.concatenate([[0], np.cumsum([s.numel for s in specs], dtype=np.int64)]).tolist()
        self.offsets: dict[str, int] = dict(zip(names, offs))
        self.rank_starts: np.ndarray = starts
        self.numel: int = offs[-1]
        self.buffer_numel: int = self.numel
        self.padding_numel: int = 0
        sizes = np.diff(starts)
        self.chunk_numel: int = int(sizes.max())
        self.chunk_lower_bound: int = -(-self.numel // self.world_size)
        self.dtype = dtype
        self.placements = _Placements(names, specs, [self.offsets[n] for n in names], starts)
        self.segments: tuple[Segment, ...] = (
            Segment(0, 0, self.chunk_numel, starts_tuple),
        )

    def rank_numel(self, rank: int) -> int:
        """Elements of ``rank``'s chunk (at most ``chunk_numel``)."""
        self._check_rank(rank)
        return int(self.rank_starts[rank + 1] - self.rank_starts[rank])

    # one segment, and the same rank check as an equal-chunk plan
    segment_index = Plan.segment_index
    _check_rank = Plan._check_rank

    def local_slice(self, name: str, rank: int) -> tuple[int, int]:
        """``[begin, end)`` of ``name``'s local run inside ``rank``'s chunk (empty: begin == end)."""
        self._check_rank(rank)
        if name not in self.offsets:
            raise ValueError(f"no parameter named {name!r} in this plan")
        lo, hi = int(self.rank_starts[rank]), int(self.rank_starts[rank + 1])
        o = self.offsets[name]
        begin, end = max(o, lo) - lo, min(o + self.specs[name].numel, hi) - lo
        if begin >= end:
            begin = end = min(max(o - lo, 0), hi - lo)
        return begin, end

    def local_views(self, chunk: torch.Tensor, rank: int) -> dict[str, torch.Tensor]:
        """Views into ``rank``'s flat ``chunk`` (``chunk_numel`` elements, of which the first
        :meth:`rank_numel` are used), one per parameter, shaped by its placement."""
        return Plan.local_views(self, chunk, rank)

    def rank_span(self, name: str) -> tuple[int, int]:
        """First and last rank (inclusive) holding part of ``name``."""
        o, n = self.offsets[name], self.specs[name].numel
        first = int(np.searchsorted(self.rank_starts, o, side="right")) - 1
        last = int(np.searchsorted(self.rank_starts, max(o + n, o + 1), side="left")) - 1
        return min(first, self.world_size - 1), min(max(last, first), self.world_size - 1)

    def rank_work(self) -> np.ndarray:
        """Optimizer work per rank (float64), as :meth:`Plan.rank_work`."""
        work = np.zeros(self.world_size, dtype=np.float64)
        starts = self.rank_starts
        for name in self.names:
            spec, o = self.specs[name], self.offsets[name]
            if spec.numel == 0:
                continue
            first, last = self.rank_span(name)
            lo = np.clip(starts[first:last + 1], o, o + spec.numel)
            hi = np.clip(starts[first + 1:last + 2], o, o + spec.numel)
            work[first:last + 1] += (hi - lo) * (spec.work / spec.numel)
        return work

    def digest(self) -> str:
        """A stable hash of the plan (shapes, granularities, cuts, dtype)."""
        payload = [
            "uneven", self.world_size, str(self.dtype),
            hashlib.sha256(self.rank_starts.tobytes()).hexdigest(),
            [[n, list(self.shapes[n]), self.offsets[n], self.specs[n].prefix, self.specs[n].band,
              self.specs[n].period, self.specs[n].work] for n in self.order],
        ]
        return hashlib.sha256(json.dumps(payload, separators=(",", ":")).encode()).hexdigest()

    def check_consistent(self, group: dist.ProcessGroup | None = None) -> None:
        """Raise ``ValueError`` unless every rank of ``group`` holds the same plan."""
        Plan.check_consistent(self, group)

    @property
    def padding_fraction(self) -> float:
        return 0.0

    def summary(self) -> str:
        sizes = np.diff(self.rank_starts)
        return (
            f"UnevenPlan: {len(self.names)} params, {self.numel:,} elements, world "
            f"{self.world_size}, chunks {int(sizes.min()):,} ... {self.chunk_numel:,} "
            f"(mean {self.numel / self.world_size:,.0f}), padding 0"
        )

    def ascii_map(self, width: int = 64, max_ranks: int = 32) -> str:
        from ragged_placement.planner.render import ascii_map

        return ascii_map(self, width=width, max_ranks=max_ranks)

    def __repr__(self) -> str:
        return (f"UnevenPlan(params={len(self.names)}, world_size={self.world_size}, "
                f"chunk_numel={self.chunk_numel}, padding_numel=0)")


@functools.lru_cache(maxsize=256)
def cached_uneven_cuts(
    specs: tuple[CutSpec, ...], world_size: int
) -> tuple[np.ndarray, tuple[int, ...]]:
    """The cuts of ``specs`` as a read-only array and a tuple; identical units share both."""
    starts = uneven_cuts(specs, world_size)
    starts.setflags(write=False)
    return starts, tuple(starts.tolist())


def plan_uneven(
    named_shapes: NamedShapes,
    world_size: int,
    granularity: GranularityPolicy = None,
    dtype: torch.dtype = torch.bfloat16,
) -> UnevenPlan:
    """Plan one FSDP unit with no padding and uneven per-rank chunks (see the module docstring).

    Parameters are laid out in the given order. Every chunk is within one band (the largest
    uncuttable piece) of ``numel / world_size``; no granularity block is cut. Deterministic from
    the shapes and granularities, so every rank computes the same plan.
    """
    _check_args(world_size, dtype, None)
    names, grans, specs = _resolve_unit(named_shapes, granularity)
    return UnevenPlan(names, specs, grans, *cached_uneven_cuts(tuple(specs), world_size), dtype)


def shard0_padding(specs: Sequence[CutSpec], world_size: int) -> int:
    """Padding of per-parameter ``Shard(0)`` that respects each parameter's granularity.

    Each parameter's rows are padded to a multiple of ``world_size`` quanta, a quantum being its
    band (uniform bands: 128-row blocks, one row, one element), its period (ragged bands: one
    stacked expert) or the whole parameter (never cut), so that every rank holds the same number
    of whole quanta. This is the baseline :func:`plan_segmented` never pads more than.
    """
    pad = 0
    for s in specs:
        if s.numel == 0:
            continue
        quantum = s.rows if s.whole else (s.band if s.band == s.period else s.period)
        step = quantum * world_size
        pad += (-(-s.rows // step) * step - s.rows) * s.row_numel
    return pad


def gather_starts(rank_nbytes: Sequence[int], max_padding: float = 0.01) -> tuple[int, ...] | None:
    """Where each rank's send lands in an all-gather of per-rank sizes ``rank_nbytes``:
    ``None`` for an equal all-gather (every rank padded to the largest; one ring collective),
    else the ``W + 1`` byte offsets of an uneven one (``W`` grouped broadcasts on NCCL, ``W``
    broadcasts on gloo; no padding).

    The rule (``docs/fp8.md``, "Equal or uneven on the wire"): equal wins while its padding
    ``W * max - sum`` is at most ``max_padding`` of the payload ``sum``: a few bytes of padding
    cost less than ``W`` broadcasts, whose group NCCL runs as ``W`` separate pipelines (no
    all-gather-v; older releases cap a group at 2,048 operations) and which miss the ring and
    symmetric-memory all-gather kernels. Above it the padding grows with ``W`` (up to one band
    per rank, ``W`` bands in all) and uneven wins.
    """
    if isinstance(max_padding, bool) or not isinstance(max_padding, (int, float)) \
            or not 0 <= max_padding:
        raise ValueError(f"max_padding must be a non-negative float, got {max_padding!r}")
    sizes = [int(n) for n in rank_nbytes]
    if not sizes or min(sizes) < 0:
        raise ValueError(f"rank_nbytes must be non-empty and non-negative, got {rank_nbytes!r}")
    total = sum(sizes)
    if len(sizes) * max(sizes) - total <= max_padding * total:
        return None
    return tuple(itertools.accumulate(sizes, initial=0))


def widest_band(specs: Sequence[CutSpec], band_rows: int = 128) -> int:
    """``band_rows`` rows of the widest row in ``specs`` (the issue's "band" of a unit)."""
    return band_rows * max((s.row_numel for s in specs if len(s.shape) >= 2), default=1)
