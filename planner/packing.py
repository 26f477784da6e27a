"""Packing parameters into one flat buffer of ``world_size`` equal chunks.

The buffer holds every parameter contiguously, in row-major order, at an offset of our choosing
(padding may sit between parameters and at the end). Rank ``r`` owns ``[r*S, (r+1)*S)``. A chunk
boundary may fall between parameters, in padding, or inside a parameter at an allowed cut of its
:class:`~ragged_placement.planner.granularity.CutSpec`. Padding is ``world_size * S - total``, so
minimizing padding is minimizing ``S``.

Two facts bound ``S`` from below (:func:`chunk_lower_bound`):

* every uncuttable piece (a band, or a whole matrix) fits in one chunk, and ``S * W >= total``;
* a parameter longer than ``2 * S`` contains two consecutive boundaries, ``S`` apart, both at
  allowed cuts; for a uniform band of ``a`` elements that forces ``S % a == 0``. So ``S`` is a
  multiple of the lcm of the bands of every parameter longer than ``2 * S``.

:func:`pack` searches ``S`` upward from that bound over values meeting the second condition
(stepping by what did not fit, then bisecting back between the last failure and the first
success) and, for each, runs an exact greedy packer in ``O(parameter classes * placements)``:

1. *Flow*: cuttable parameters are laid out from offset 0; at each step the next parameter is the
   one wasting least padding at the current position (one that fits in the chunk wastes none;
   one crossing the boundary wastes the distance from its last allowed cut to the boundary),
   ties to larger bands first.
2. *Whole* parameters (matrix owners, or ones that are a single band) go into chunks by longest
   processing time on optimizer work (Muon Newton-Schulz FLOPs): empty chunks first, then the
   least-loaded chunk with room; best-fit decreasing by size if that does not fit.
3. *Fillers* (element granularity) go best-fit into the remaining free runs, which they may
   cross; if they do not fit there, the packing is redone with the fillers in the flow.

Every placement is checked exactly, so a returned layout never cuts a block; the greedy may
miss the smallest ``S`` (on 308 random tiny units checked exhaustively it found the optimum in
301), and the lower bound is met on most real models (``benchmarks/planner.py``).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ragged_placement.planner.granularity import CutSpec

__all__ = ["Layout", "pack", "chunk_lower_bound"]

# Periodic (ragged-band) parameters: how many allowed head positions to try before padding.
_PERIODIC_HEAD_TRIES = 64
# S search: candidates tried one after another before the step grows geometrically.
_LINEAR_ATTEMPTS = 8
# ... and bisection steps between the last failure and the first success.
_BISECT_ATTEMPTS = 16


@dataclass(frozen=True)
class Layout:
    """A packed flat buffer: chunk size, buffer order and offsets (indexed like the input)."""

    chunk_numel: int
    world_size: int
    order: tuple[int, ...]
    offsets: tuple[int, ...]
    chunk_lower_bound: int
    attempts: int


@dataclass
class _Class:
    """Interchangeable parameters: same numel, band, period, wholeness and work."""

    numel: int
    band: int
    period: int
    work: int
    members: list[int]


def _lcm(values) -> int:
    out = 1
    for v in values:
        out = out * v // math.gcd(out, v)
    return out


def _classes(specs: Sequence[CutSpec]) -> list[_Class]:
    by_key: dict[tuple, _Class] = {}
    for i, s in enumerate(specs):
        key = (s.numel, s.band_numel, s.period_numel, s.whole, s.work)
        cls = by_key.get(key)
        if cls is None:
            by_key[key] = _Class(s.numel, s.band_numel, s.period_numel, s.work, [i])
        else:
            cls.members.append(i)
    return list(by_key.values())


class _ChainModulus:
    """``M(S)``: the lcm of bands (and the alignment) every chunk size ``S`` must divide by.

    A parameter of ``N`` elements longer than ``2 * S`` spans two boundaries ``S`` apart, so ``S``
    must be a multiple of its band (uniform bands) or, as a search heuristic, of its period
    (ragged bands). ``M`` only shrinks as ``S`` grows, at the breakpoints ``S = ceil(N / 2)``.
    """

    def __init__(self, classes: Sequence[_Class], include_periodic: bool, align: int = 1) -> None:
        self._align = align
        mods = []
        for c in classes:
            if c.band >= c.numel or c.band <= 1:
                continue
            if c.band == c.period:
                mods.append((c.numel, c.band))
            elif include_periodic:
                mods.append((c.numel, c.period))
        self._mods = sorted(mods)  # by numel: the long ones are constrained longest
        self._breaks = sorted({(n + 1) // 2 for n, _ in mods})

    def __call__(self, s: int) -> int:
        return _lcm([self._align] + [m for n, m in self._mods if n > 2 * s])

    def next_valid(self, x: int) -> int:
        """The smallest ``S >= x`` with ``S % M(S) == 0``."""
        while True:
            m = self(x)
            y = -(-x // m) * m
            nxt = bisect.bisect_right(self._breaks, x)
            if nxt == len(self._breaks) or self._breaks[nxt] > y:
                return y
            x = self._breaks[nxt]  # M drops at this breakpoint: a smaller valid S may exist


def _base_bound(classes: Sequence[_Class], world_size: int) -> int:
    total = sum(c.numel * len(c.members) for c in classes)
    biggest = max((min(c.band, c.numel) for c in classes), default=0)
    return max(-(-total // world_size), biggest, 1)


def chunk_lower_bound(specs: Sequence[CutSpec], world_size: int, align: int = 1) -> int:
    """A proven lower bound on the chunk size ``S`` of any valid layout of ``specs`` whose
    parameter offsets and chunk size are multiples of ``align`` elements."""
    classes = _classes(specs)
    return _ChainModulus(classes, include_periodic=False, align=align).next_valid(
        _base_bound(classes, world_size)
    )


def _up(x: int, align: int) -> int:
    return -(-x // align) * align


def _run(start: int, length: int, align: int) -> list[int]:
    """A free run ``[start, start + length)`` trimmed to start on an aligned offset."""
    begin = _up(start, align)
    return [begin, max(start + length - begin, 0)]


def _head(c: _Class, f: int, s: int, align: int) -> int | None:
    """Largest ``h`` in ``(0, f]``, a multiple of ``align``, so that ``c`` placed ``h`` before a
    boundary cuts only at allowed offsets ``h, h + s, h + 2s, ...``; ``None`` if there is none."""
    n, a, p = c.numel, c.band, c.period
    if a == p:
        step = _lcm((a, align))
        h = f - f % step
        if h == 0 or (h + s < n and s % a):
            return None
        return h
    last = (p - 1) // a * a  # start of the short last band of a period
    h = f - (f % p) % a
    cycle = p // math.gcd(s, p)
    for _ in range(_PERIODIC_HEAD_TRIES):
        if h <= 0:
            return None
        x, k, ok = h + s, 1, h % align == 0
        while ok and x < n and k < cycle:
            if (x % p) % a:
                ok = False
                break
            x += s
            k += 1
        if ok:
            return h
        h = h - a if h % p else h - p + last
    return None


def _try_pack(
    classes: Sequence[_Class], n_items: int, world_size: int, s: int, align: int
) -> tuple[list[int] | None, int]:
    """Offsets of every item at chunk size ``s``, or ``(None, deficit)``.

    Fillers first go into the free runs left by the others; if that fails they join the flow
    (where they cross boundaries that would cost banded parameters padding)."""
    fillers = [c for c in classes if c.band == 1 and c.numel >= 1]
    flow = [c for c in classes if 1 < c.band < c.numel]
    whole = [c for c in classes if c.band >= c.numel and not (c.band == 1 and c.numel >= 1)]
    offsets, deficit = _attempt(flow, whole, fillers, n_items, world_size, s, align)
    if offsets is None and fillers:
        offsets, deficit2 = _attempt(flow + fillers, whole, [], n_items, world_size, s, align)
        deficit = min(deficit, deficit2)
    return offsets, deficit


def _attempt(
    flow: list[_Class], whole: list[_Class], fillers: list[_Class], n_items: int,
    world_size: int, s: int, align: int,
) -> tuple[list[int] | None, int]:
    """One packing at chunk size ``s``: flow, then whole parameters, then fillers."""
    offsets = [0] * n_items
    capacity = world_size * s
    # -- 1. flow ------------------------------------------------------------------------
    pos = 0
    gaps: list[tuple[int, int]] = []
    placed: list[tuple[int, int, int]] = []  # (offset, numel, work) of flow items, by offset
    remaining = [len(c.members) for c in flow]
    left = sum(remaining)
    while left:
        if pos % align:
            gaps.append((pos, _up(pos, align) - pos))
            pos = _up(pos, align)
        f = s - pos % s
        best = None
        for ci, c in enumerate(flow):
            if not remaining[ci]:
                continue
            if c.numel <= f:
                waste = 0
            else:
                h = _head(c, f, s, align)
                if h is None:
                    continue
                waste = f - h
            key = (waste, -c.band, -c.numel, ci)
            if best is None or key < best:
                best = key
        if best is None:
            if f == s:  # cannot start anywhere: S is incompatible with a remaining parameter
                return None, 0
            gaps.append((pos, f))
            pos += f
            continue
        waste, _, _, ci = best
        if waste:
            gaps.append((pos, waste))
            pos += waste
        c = flow[ci]
        offsets[c.members[len(c.members) - remaining[ci]]] = pos
        placed.append((pos, c.numel, c.work))
        pos += c.numel
        remaining[ci] -= 1
        left -= 1
    if pos > capacity:
        return None, pos - capacity
    # free runs inside touched chunks, by chunk
    free: dict[int, list[list[int]]] = {}
    for start, length in gaps:
        free.setdefault(start // s, []).append(_run(start, length, align))
    if pos % s:
        free.setdefault(pos // s, []).append(_run(pos, s - pos % s, align))
    next_fresh = -(-pos // s)
    # -- 2. whole parameters --------------------------------------------------------------
    items = [(c, m) for c in whole for m in c.members]
    if items:
        load = {k: _flow_work(placed, k * s, (k + 1) * s) for k in free}
        result = _place_whole_lpt(items, free, load, next_fresh, world_size, s, align, offsets)
        if result is None:
            free, next_fresh, unplaced = _place_whole_bfd(
                items, free, next_fresh, world_size, s, align, offsets
            )
            if unplaced:
                return None, unplaced
        else:
            free, next_fresh = result
    # -- 3. fillers -----------------------------------------------------------------------
    fill = sorted(((c.numel, m) for c in fillers for m in c.members), key=lambda t: (-t[0], t[1]))
    if fill:
        runs = sorted((r[0], r[1]) for rs in free.values() for r in rs if r[1] > 0)
        if next_fresh < world_size:
            runs.append((next_fresh * s, capacity - next_fresh * s))
        merged: list[list[int]] = []
        for start, length in runs:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1][1] += length
            else:
                merged.append([start, length])
        sizes = sorted((length, start) for start, length in merged)
        unplaced = 0
        for numel, m in fill:
            j = bisect.bisect_left(sizes, (numel, -1))
            if j == len(sizes):
                unplaced += numel
                continue
            length, start = sizes.pop(j)
            offsets[m] = start
            rest = _run(start + numel, length - numel, align)
            if rest[1] > 0:
                bisect.insort(sizes, (rest[1], rest[0]))
        if unplaced:
            return None, unplaced
    return offsets, 0


def _take(runs: list[list[int]], numel: int, align: int) -> int | None:
    """Best-fit ``numel`` into one of ``runs`` (aligned starts; shrinking it); the start."""
    best = None
    for r in runs:
        if r[1] >= numel and (best is None or r[1] < best[1]):
            best = r
    if best is None:
        return None
    start = best[0]
    best[:] = _run(start + numel, best[1] - numel, align)
    return start


def _flow_work(placed: list[tuple[int, int, int]], lo: int, hi: int) -> float:
    """Work of the flow items' pieces inside ``[lo, hi)`` (items sorted by offset, disjoint)."""
    total = 0.0
    j = bisect.bisect_left(placed, (hi, -1, -1)) - 1
    while j >= 0 and placed[j][0] + placed[j][1] > lo:
        o, n, w = placed[j]
        total += w * (min(o + n, hi) - max(o, lo)) / n
        j -= 1
    return total


def _place_whole_lpt(items, free, load, next_fresh, world_size, s, align, offsets):
    """Longest-processing-time assignment of whole parameters to chunks, balancing work."""
    free = {k: [list(r) for r in v] for k, v in free.items()}
    heap = [(load[k], k) for k in free]
    heapq.heapify(heap)
    order = sorted(items, key=lambda cm: (-cm[0].work, -cm[0].numel, cm[1]))
    for c, m in order:
        if next_fresh < world_size:
            k = next_fresh
            next_fresh += 1
            free[k] = [[k * s, s]]
            load[k] = 0
        else:
            stash = []
            k = None
            while heap:
                ld, cand = heapq.heappop(heap)
                if ld != load[cand]:
                    continue  # stale entry
                if any(r[1] >= c.numel for r in free[cand]):
                    k = cand
                    break
                stash.append((ld, cand))
            for e in stash:
                heapq.heappush(heap, e)
            if k is None:
                return None
        offsets[m] = _take(free[k], c.numel, align)
        load[k] += c.work
        heapq.heappush(heap, (load[k], k))
    return free, next_fresh


def _place_whole_bfd(items, free, next_fresh, world_size, s, align, offsets):
    """Best-fit decreasing by size: the densest packing of whole parameters into chunks.
    Returns the free runs, the next untouched chunk and the numel that did not fit."""
    free = {k: [list(r) for r in v] for k, v in free.items()}
    runs = sorted((r[1], r[0], k) for k, v in free.items() for r in v if r[1] > 0)
    unplaced = 0
    for c, m in sorted(items, key=lambda cm: (-cm[0].numel, cm[1])):
        j = bisect.bisect_left(runs, (c.numel, -1, -1))
        if j < len(runs):
            length, start, k = runs.pop(j)
        elif next_fresh < world_size:
            k = next_fresh
            next_fresh += 1
            length, start = s, k * s
            free[k] = []
        else:
            unplaced += c.numel
            continue
        offsets[m] = start
        rest = _run(start + c.numel, length - c.numel, align)
        if rest[1] > 0:
            bisect.insort(runs, (rest[1], rest[0], k))
    rebuilt: dict[int, list[list[int]]] = {}
    for length, start, k in runs:
        rebuilt.setdefault(k, []).append([start, length])
    return rebuilt, next_fresh, unplaced


def pack(specs: Sequence[CutSpec], world_size: int, align: int = 1) -> Layout:
    """The smallest-chunk layout the greedy finds for ``specs`` over ``world_size`` ranks, with
    every parameter offset and the chunk size multiples of ``align`` elements."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if isinstance(align, bool) or not isinstance(align, int) or align < 1:
        raise ValueError(f"align must be a positive int, got {align!r}")
    classes = _classes(specs)
    base = _base_bound(classes, world_size)
    lower = _ChainModulus(classes, include_periodic=False, align=align).next_valid(base)
    modulus = _ChainModulus(classes, include_periodic=True, align=align)
    # everything in one chunk, each parameter aligned, always fits
    ceiling = modulus.next_valid(max(sum(sp.numel for sp in specs) + (align - 1) * len(specs), 1))
    s = modulus.next_valid(lower)
    attempts, failed = 0, None
    while True:
        attempts += 1
        offsets, deficit = _try_pack(classes, len(specs), world_size, s, align)
        if offsets is not None:
            break
        if s >= ceiling:
            raise AssertionError(f"planner bug: no layout at S={s} >= {ceiling}")
        failed = s
        step = -(-deficit // world_size)
        if attempts > _LINEAR_ATTEMPTS:
            step = max(step, s - lower)
        s = min(modulus.next_valid(s + max(step, 1)), ceiling)
    # the steps may have jumped past a feasible S: bisect between the last failure and success
    for _ in range(_BISECT_ATTEMPTS):
        if failed is None:
            break
        mid = modulus.next_valid(failed + 1 + (s - failed - 1) // 2)
        if mid >= s:
            break
        attempts += 1
        got, _ = _try_pack(classes, len(specs), world_size, mid, align)
        if got is None:
            failed = mid
        else:
            s, offsets = mid, got
    order = tuple(sorted(range(len(specs)), key=lambda i: (offsets[i], i)))
    return Layout(s, world_size, order, tuple(offsets), lower, attempts)
