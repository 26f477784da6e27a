"""Segmented plans: one FSDP unit as several flat layouts gathered by one coalesced collective.

A single flat layout has a hard limit (:mod:`.packing`): a parameter longer than two chunks holds
two chunk boundaries exactly ``S`` apart, so ``S`` must be a multiple of its band, and with two
such parameters of different widths, of the lcm of their bands. Llama-3.1-8B's layer at 8 ranks,
with 128-row bands of 4096 and 14336 columns, pays 6.3% padding for it.

A :class:`SegmentedPlan` splits the unit into segments, each an independent :class:`Plan` with its
own chunk ``S_k`` (parameters grouped by band, so no lcm arises). Rank ``r``'s chunk is the
concatenation of its segment chunks, and the unsharded buffer the concatenation of the segments'
``W * S_k`` buffers, so every parameter is still contiguous in the unsharded buffer (zero-copy
views) and every local run contiguous in its rank's chunk. The runtime gathers the segments with
one coalesced collective (``segments`` gives the offsets). One segment per parameter reproduces
per-parameter ``Shard(0)`` padding exactly, so :func:`plan_segmented`, which keeps the candidate
with the least padding, never pads more than the block-respecting ``Shard(0)`` baseline when that
candidate fits in ``max_segments``.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ragged_placement.placement import RaggedShard
from ragged_placement.planner.granularity import CutSpec, GranularityPolicy
from ragged_placement.planner.plan import (
    NamedShapes,
    Plan,
    Segment,
    _check_args,
    _planned,
    _resolve_unit,
    _rotated,
)
from ragged_placement.planner.uneven import UnevenPlan, cached_uneven_cuts, shard0_padding

__all__ = ["SegmentedPlan", "plan_segmented"]


class _MergedPlacements(Mapping[str, RaggedShard]):
    def __init__(self, parts: Sequence[Plan], part_of: dict[str, int]) -> None:
        self._parts, self._part_of = parts, part_of

    def __getitem__(self, name: str) -> RaggedShard:
        return self._parts[self._part_of[name]].placements[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._part_of)

    def __len__(self) -> int:
        return len(self._part_of)


class SegmentedPlan:
    """A unit laid out as several :class:`Plan` segments; the same API as :class:`Plan`.

    ``offsets`` are offsets in the unsharded buffer (``sum(W * S_k)`` elements),
    ``chunk_numel`` is ``sum(S_k)``, and :meth:`local_slice` / :meth:`local_views` address a
    rank's whole chunk. A parameter's placement is the one its segment induces.
    """

    def __init__(self, parts: Sequence[Plan], names: Sequence[str]) -> None:
        if not parts:
            raise ValueError("a segmented plan needs at least one segment")
        self.parts: tuple[Plan, ...] = tuple(parts)
        self.world_size: int = parts[0].world_size
        segments, c, u = [], 0, 0
        for p in parts:
            segments.append(Segment(c, u, p.chunk_numel, p.segments[0].rank_starts))
            c += p.chunk_numel
            u += p.buffer_numel
        self.segments: tuple[Segment, ...] = tuple(segments)
        self.chunk_numel: int = c
        self._part_of = {n: k for k, p in enumerate(parts) for n in p.names}
        self.names: tuple[str, ...] = tuple(names)
        self.order: tuple[str, ...] = tuple(n for p in parts for n in p.order)
        self.shapes = {n: parts[self._part_of[n]].shapes[n] for n in names}
        self.granularities = {n: parts[self._part_of[n]].granularities[n] for n in names}
        self.specs = {n: parts[self._part_of[n]].specs[n] for n in names}
        self.offsets = {n: segments[self._part_of[n]].buffer_offset + parts[self._part_of[n]].offsets[n]
                        for n in names}
        self.placements = _MergedPlacements(self.parts, self._part_of)
        self.numel: int = sum(p.numel for p in parts)
        self.buffer_numel: int = u
        self.padding_numel: int = self.buffer_numel - self.numel
        self.chunk_lower_bound: int = sum(p.chunk_lower_bound for p in parts)
        self.dtype: torch.dtype = parts[0].dtype

    def segment_index(self, name: str) -> int:
        """Index in :attr:`segments` of the segment holding ``name``."""
        if name not in self._part_of:
            raise ValueError(f"no parameter named {name!r} in this plan")
        return self._part_of[name]

    def local_slice(self, name: str, rank: int) -> tuple[int, int]:
        """``[begin, end)`` of ``name``'s local run inside ``rank``'s whole chunk."""
        if name not in self._part_of:
            raise ValueError(f"no parameter named {name!r} in this plan")
        k = self._part_of[name]
        begin, end = self.parts[k].local_slice(name, rank)
        base = self.segments[k].chunk_offset
        return base + begin, base + end

    def rank_numel(self, rank: int) -> int:
        """Elements of ``rank``'s chunk it uses: its part of every segment, up to the last."""
        last = self.segments[-1]
        return last.chunk_offset + self.parts[-1].rank_numel(rank)

    def local_views(self, chunk: torch.Tensor, rank: int) -> dict[str, torch.Tensor]:
        """Views into ``rank``'s flat chunk (``chunk_numel`` elements), one per parameter."""
        if chunk.dim() != 1 or chunk.numel() != self.chunk_numel:
            raise ValueError(f"chunk must be 1-D with {self.chunk_numel} elements, got shape {tuple(chunk.shape)}")
        out: dict[str, torch.Tensor] = {}
        for seg, p in zip(self.segments, self.parts):
            out.update(p.local_views(chunk[seg.chunk_offset:seg.chunk_offset + seg.chunk_numel], rank))
        return {n: out[n] for n in self.names}

    def rank_work(self) -> np.ndarray:
        return sum(p.rank_work() for p in self.parts)

    @property
    def padding_fraction(self) -> float:
        return self.padding_numel / max(self.buffer_numel, 1)

    def digest(self) -> str:
        payload = [[s.chunk_offset, s.buffer_offset, s.chunk_numel] for s in self.segments]
        payload.append([p.digest() for p in self.parts])
        return hashlib.sha256(json.dumps(payload, separators=(",", ":")).encode()).hexdigest()

    def check_consistent(self, group: dist.ProcessGroup | None = None) -> None:
        """Raise ``ValueError`` unless every rank of ``group`` holds the same plan."""
        Plan.check_consistent(self, group)  # same protocol: all-gather the digests

    def summary(self) -> str:
        head = (f"SegmentedPlan: {len(self.parts)} segments, chunk S={self.chunk_numel:,} "
                f"(= {' + '.join(f'{s.chunk_numel:,}' for s in self.segments)}), padding "
                f"{self.padding_numel:,} ({100 * self.padding_fraction:.3f}%)")
        return "\n".join([head] + [f"segment {k}: {p.summary()}" for k, p in enumerate(self.parts)])

    def ascii_map(self, width: int = 64, max_ranks: int = 32) -> str:
        return "\n".join(f"segment {k}:\n{p.ascii_map(width, max_ranks)}" for k, p in enumerate(self.parts))

    def __repr__(self) -> str:
        return (f"SegmentedPlan(segments={len(self.parts)}, world_size={self.world_size}, "
                f"chunk_numel={self.chunk_numel}, padding={self.padding_numel})")


def plan_segmented(
    named_shapes: NamedShapes,
    world_size: int,
    granularity: GranularityPolicy = None,
    dtype: torch.dtype = torch.bfloat16,
    *,
    max_segments: int = 16,
    align_bytes: int | None = None,
    groups: Sequence[Sequence[str]] | None = None,
    uneven: bool = False,
    even_padding: float = 0.01,
) -> Plan | SegmentedPlan | UnevenPlan:
    """Plan one FSDP unit as one or several segments, whichever pads least.

    Candidates: one segment (:func:`plan`); one segment per band size (parameters whose cuts fall
    on the same quantum share a segment, so no lcm arises); one segment per
    parameter, with the parameters that are never cut (whole or smaller than one band) joining
    the largest segment, and with every parameter alone (per-parameter ``Shard(0)`` padding).

    ``groups`` (a partition of the parameter names, e.g. by submodule) adds two candidates: one
    segment per group, and one per group and band size. A group holding only parameters that are
    never cut joins the next group (the last joins the previous). The FSDP runtime passes the
    unit's submodules here: a segment's gradient buffer is allocated when backward reaches its
    first parameter, so segments that follow the module structure hold gradient memory for
    about as long as per-parameter gradients would.

    Candidates with more than ``max_segments`` segments are skipped. Of those with the least
    padding, one built from ``groups`` wins, then the one with fewer segments. Returns a
    :class:`Plan` when one segment wins, so callers that ask for segments pay nothing when
    they do not help.

    ``uneven=True`` (the FSDP runtime's choice; needs ``align_bytes=None``) also allows uneven
    per-rank chunks (:class:`UnevenPlan`: no padding, every chunk within one band of the mean,
    an uneven collective). They win unless the best equal-chunk candidate pads at most
    ``even_padding`` of the parameters, no more than per-parameter ``Shard(0)``
    (:func:`shard0_padding`), and at most one band per rank (so its chunk also meets the uneven
    bound): equal chunks run as one ring all-gather on NCCL, uneven ones as a group of ``W``
    broadcasts. An uneven plan is one segment whatever ``groups`` says, so that the unit still
    issues one collective per pass. The choice depends only on the shapes, granularities and arguments, and is
    cached, so identical layers plan once.
    """
    if isinstance(max_segments, bool) or not isinstance(max_segments, int) or max_segments < 1:
        raise ValueError(f"max_segments must be a positive int, got {max_segments!r}")
    if not isinstance(uneven, bool):
        raise ValueError(f"uneven must be a bool, got {uneven!r}")
    if isinstance(even_padding, bool) or not isinstance(even_padding, (int, float)) \
            or not 0 <= even_padding <= 1:
        raise ValueError(f"even_padding must be a float in [0, 1], got {even_padding!r}")
    if uneven and align_bytes is not None:
        raise ValueError("uneven=True needs align_bytes=None (uneven cuts are not aligned)")
    align = _check_args(world_size, dtype, align_bytes)
    names, grans, specs = _resolve_unit(named_shapes, granularity)
    index = {n: i for i, n in enumerate(names)}
    group_idx = None
    if groups is not None:
        flat = [n for g in groups for n in g]
        if sorted(flat) != sorted(names) or any(not g for g in groups):
            raise ValueError(
                f"groups must partition the parameter names {list(names)} into non-empty "
                f"groups, got {[list(g) for g in groups]}"
            )
        group_idx = tuple(tuple(index[n] for n in g) for g in groups)
    kind, chosen = _choose(tuple(specs), world_size, align, max_segments, group_idx, uneven,
                           float(even_padding))
    parts = []
    for g in chosen:
        sub_names, sub_specs = [names[i] for i in g], tuple(specs[i] for i in g)
        sub_grans = [grans[i] for i in g]
        if kind == "uneven":
            parts.append(UnevenPlan(sub_names, sub_specs, sub_grans,
                                    *cached_uneven_cuts(sub_specs, world_size), dtype))
        else:
            parts.append(Plan(sub_names, sub_specs, sub_grans,
                              *_rotated(sub_specs, world_size, align, 0), dtype))
    return parts[0] if len(parts) == 1 else SegmentedPlan(parts, names)


@functools.lru_cache(maxsize=1024)
def _choose(specs: tuple[CutSpec, ...], world_size: int, align: int, max_segments: int,
            groups: tuple[tuple[int, ...], ...] | None, uneven: bool, even_padding: float,
            ) -> tuple[str, tuple[tuple[int, ...], ...]]:
    """``("equal" | "uneven", index groups)``: the segments :func:`plan_segmented` builds."""
    n_params = len(specs)
    numel = sum(s.numel for s in specs)
    cut = [i for i, s in enumerate(specs) if not s.whole and s.numel > s.band_numel]
    cut_set = set(cut)
    fill = [i for i in range(n_params) if i not in cut_set]

    def with_fillers(gs: list[list[int]]) -> list[list[int]]:
        if not gs:
            return [list(range(n_params))]
        largest = max(range(len(gs)), key=lambda k: sum(specs[i].numel for i in gs[k]))
        return [g + fill if k == largest else g for k, g in enumerate(gs)]

    def by_band(g: list[int]) -> dict[tuple[int, int], list[int]]:
        bands: dict[tuple[int, int], list[int]] = {}
        for i in g:
            bands.setdefault((specs[i].band_numel, specs[i].period_numel), []).append(i)
        return bands

    # (preference, groups): on equal padding the lower preference wins, then fewer segments.
    # The caller's groups come first: a candidate seen twice keeps its first preference.
    candidates: list[tuple[int, list[list[int]]]] = []
    folded = None
    if groups is not None:
        as_given = _merge_uncut_groups([list(g) for g in groups], cut_set)
        # small groups (a norm) folded into the next: fewer segments when that pads no more
        folded = _fold_groups(
            as_given, lambda g: sum(specs[i].numel for i in g) * max_segments < numel
        )
        for module_groups in (as_given, folded):
            split = []
            for g in module_groups:
                bands = by_band(g)
                split.extend(_merge_uncut_groups([bands[k] for k in sorted(bands)], cut_set))
            candidates += [(0, module_groups), (0, split)]
    classes = by_band(cut)
    candidates += [
        (1, [list(range(n_params))]),
        (1, with_fillers([classes[k] for k in sorted(classes)])),
        (1, with_fillers([[i] for i in cut])),
        (1, [[i] for i in range(n_params)]),  # exactly per-parameter Shard(0): the guarantee's
    ]
    best: tuple[tuple[int, ...], ...] | None = None
    best_key: tuple[int, int, int] | None = None
    seen: set[tuple[tuple[int, ...], ...]] = set()
    for preference, candidate in candidates:
        key = tuple(tuple(g) for g in candidate)
        if len(candidate) > max_segments or key in seen:
            continue
        seen.add(key)
        chunk = sum(_planned(tuple(specs[i] for i in g), world_size, align)[0].chunk_numel
                    for g in candidate)
        rank_key = (chunk * world_size - numel, preference, len(candidate))
        if best_key is None or rank_key < best_key:
            best, best_key = key, rank_key
    assert best is not None and best_key is not None
    padding = best_key[0]
    # the uneven plan's bound: every chunk within one uncuttable piece of the mean
    piece = max(s.numel if s.whole else s.band_numel for s in specs)
    balanced = (numel + padding) // world_size <= -(-numel // world_size) + piece
    if uneven and numel and (padding > even_padding * numel or not balanced
                             or padding > shard0_padding(specs, world_size)):
        # One segment: uneven segments cannot be coalesced into one collective on every backend
        # (gloo drops coalesced broadcasts), and a unit issues one collective per pass.
        return "uneven", (tuple(range(n_params)),)
    return "equal", best


def _merge_uncut_groups(groups: list[list[str]], cut: set[str]) -> list[list[str]]:
    """Fold each group without a cut parameter into the next group (the last into the previous):
    a segment of only small parameters would pad a band for nothing."""
    return _fold_groups(groups, lambda g: not any(n in cut for n in g))


def _fold_groups(groups: list[list[str]], fold) -> list[list[str]]:
    """Fold each group for which ``fold(group)`` holds into the next group (the last into the
    previous)."""
    out: list[list[str]] = []
    carry: list[str] = []
    for g in groups:
        if fold(g):
            carry += g
        else:
            out.append(carry + g)
            carry = []
    if carry:
        if out:
            out[-1] += carry
        else:
            out.append(carry)
    return out


def layers_per_unit(
    layers: Sequence[NamedShapes],
    world_size: int,
    granularity: GranularityPolicy = None,
    *,
    max_padding: float = 0.01,
    max_imbalance: float = 0.25,
    uneven: bool = True,
) -> int | None:
    """The smallest number ``k`` of consecutive layers to wrap in one ``fully_shard`` unit
    (``fully_shard([l0, ..., l{k-1}])``) so that every unit pads at most ``max_padding`` of its
    parameters and its largest chunk is at most ``(1 + max_imbalance)`` times the mean.

    ``layers`` are the layers' ``named_shapes`` in module order; units are ``layers[i:i + k]``
    for ``i = 0, k, 2k, ...`` (a shorter remainder is meant to join the last unit, and is not
    checked). Each unit is planned as the runtime plans it (:func:`plan_segmented`, ``uneven``).
    Uneven plans never pad and keep every chunk within one band of the mean, so for them the
    imbalance decides: the default 0.25 is one band at four bands per rank, the issue-16 target.
    Equal-chunk plans (``uneven=False``) are decided by their padding. Returns ``None`` if not
    even all the layers in one unit qualify (the mesh is too large for the model).
    """
    if not layers:
        raise ValueError("layers is empty")
    for name, value in (("max_padding", max_padding), ("max_imbalance", max_imbalance)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{name} must be a non-negative float, got {value!r}")
    for k in range(1, len(layers) + 1):
        ok = True
        for i in range(0, len(layers) - k + 1, k):
            unit = [entry for layer in layers[i:i + k] for entry in _entries(layer)]
            p = plan_segmented(unit, world_size, granularity, uneven=uneven)
            mean = p.numel / world_size
            if p.padding_numel > max_padding * p.numel or p.chunk_numel > (1 + max_imbalance) * mean:
                ok = False
                break
        if ok:
            return k
    return None


def _entries(named_shapes: NamedShapes) -> list:
    return list(named_shapes.items()) if isinstance(named_shapes, Mapping) else list(named_shapes)
