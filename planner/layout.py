"""The interface the planner's three layouts share: :class:`~ragged_placement.planner.Plan`
(one flat layout, equal chunks), :class:`~ragged_placement.planner.SegmentedPlan` (several
layouts, one coalesced collective) and :class:`~ragged_placement.planner.UnevenPlan` (uneven
per-rank chunks). The runtime (``ragged_placement.fsdp``) reads a unit's layout only through it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import numpy as np
import torch
import torch.distributed as dist
from ragged_placement.planner.granularity import Granularity
from ragged_placement.planner.plan import Segment

from ragged_placement.placement import RaggedShard

__all__ = ["FlatLayout"]


@runtime_checkable
class FlatLayout(Protocol):
    """A unit's parameters packed into one unsharded flat buffer of ``buffer_numel`` elements,
    cut into ``world_size`` per-rank chunks of at most ``chunk_numel`` elements.

    Attributes:
        world_size: the ranks the buffer is cut over.
        names: the parameters, in the order given; ``order``: in buffer order.
        shapes, granularities, offsets: per parameter, its shape, the granularity it was
            planned at and its offset in the unsharded buffer.
        placements: per parameter, the :class:`RaggedShard` its cut induces.
        numel, buffer_numel, padding_numel: parameter elements, unsharded buffer elements and
            their difference.
        chunk_numel: the sharded buffer's size (the largest rank's chunk).
        chunk_lower_bound: ``ceil(numel / world_size)``-like bound the search measured against.
        dtype: the dtype the layout was planned for (alignment).
        segments: the collectives' parts (:class:`Segment`), in buffer order.
    """

    world_size: int
    names: tuple[str, ...]
    order: tuple[str, ...]
    shapes: Mapping[str, torch.Size]
    granularities: Mapping[str, Granularity]
    offsets: Mapping[str, int]
    placements: Mapping[str, RaggedShard]
    numel: int
    buffer_numel: int
    padding_numel: int
    chunk_numel: int
    chunk_lower_bound: int
    dtype: torch.dtype

    @property
    def segments(self) -> tuple[Segment, ...]: ...

    @property
    def padding_fraction(self) -> float: ...

    def rank_numel(self, rank: int) -> int:
        """The elements of ``rank``'s chunk that hold parameters or padding of the layout."""
        ...

    def segment_index(self, name: str) -> int:
        """The segment that holds parameter ``name``."""
        ...

    def local_slice(self, name: str, rank: int) -> tuple[int, int]:
        """``[begin, end)`` of ``name``'s run in ``rank``'s chunk."""
        ...

    def local_views(self, chunk: torch.Tensor, rank: int) -> dict[str, torch.Tensor]:
        """Each parameter's local tensor as a view of ``rank``'s ``chunk``."""
        ...

    def rank_work(self) -> np.ndarray:
        """Per rank, the work its chunk carries (elements, or the granularity's cost)."""
        ...

    def digest(self) -> str:
        """A hash of the layout, equal on every rank that planned the same one."""
        ...

    def check_consistent(self, group: dist.ProcessGroup | None = None) -> None:
        """``RuntimeError`` unless every rank of ``group`` planned this layout."""
        ...

    def summary(self) -> str:
        """A human-readable table of the layout."""
        ...

    def ascii_map(self, width: int = 64, max_ranks: int = 32) -> str:
        """The chunks as a character map, one row per rank."""
        ...
