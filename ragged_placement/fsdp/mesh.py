"""The data-parallel meshes of a ``fully_shard`` unit.

``fully_shard(module, mesh=...)`` takes FSDP2's call shapes:

* a 1-D mesh: FSDP over its only dim;
* a 2-D ``(replicate, shard)`` mesh: HSDP. The unit is all-gathered and reduce-scattered over
  the shard dim; gradients are then all-reduced over the replicate dim.

Parameters on a tensor-parallel mesh beside it: :mod:`ragged_placement.fsdp.param`.

With an ``int`` ``reshard_after_forward`` ``N`` a unit keeps, between forward and backward, a
shard of its unsharded parameters over groups of ``N`` consecutive ranks of the shard dim
(:class:`PostForwardMesh`, FSDP2's post-forward mesh), and backward all-gathers within the group.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate

from ragged_placement._compat import concatenate_meshes
from ragged_placement.placement import RaggedShard
from ragged_placement.planner.plan import Segment

__all__ = ["DataParallelMesh", "PostForwardMesh", "coarsen_segments"]


@dataclass(frozen=True)
class DataParallelMesh:
    """The data-parallel mesh of one unit: ``mesh`` is 1-D (shard) or 2-D (replicate, shard)."""

    mesh: DeviceMesh

    @staticmethod
    def of(mesh: object) -> DataParallelMesh:
        """Validate ``mesh`` (the ``mesh`` argument of ``fully_shard``)."""
        if not isinstance(mesh, DeviceMesh) or mesh.ndim not in (1, 2):
            raise ValueError(
                f"mesh must be a 1-D (shard) or 2-D (replicate, shard) DeviceMesh, got {mesh!r}"
            )
        return DataParallelMesh(mesh)

    @property
    def source(self) -> DeviceMesh:
        """The user's data-parallel mesh (``mesh`` itself)."""
        return self.mesh

    @property
    def hsdp(self) -> bool:
        return self.mesh.ndim == 2

    @property
    def shard_dim(self) -> int:
        return self.mesh.ndim - 1

    @property
    def shard_group(self):
        return self.mesh.get_group(self.shard_dim)

    @property
    def shard_rank(self) -> int:
        return self.mesh.get_local_rank(self.shard_dim)

    @property
    def shard_size(self) -> int:
        return self.mesh.size(self.shard_dim)

    @property
    def replicate_group(self):
        return self.mesh.get_group(0) if self.hsdp else None

    @property
    def replicate_size(self) -> int:
        return self.mesh.size(0) if self.hsdp else 1

    def placements(self, fsdp: RaggedShard) -> tuple[Placement, ...]:
        """The data-parallel placements of a parameter: ``(Replicate(),)`` for HSDP, then ``fsdp``."""
        return (Replicate(), fsdp) if self.hsdp else (fsdp,)

    def with_tp(self, tp_mesh: DeviceMesh) -> DeviceMesh:
        """The mesh of the sharded parameters beside ``tp_mesh`` (a sibling sub-mesh of the same
        root): ``mesh``'s dims, then ``tp_mesh``'s."""
        return concatenate_meshes([self.mesh, tp_mesh])


# id(mesh) -> (a weak reference to the mesh, {N: this rank's N-rank post-forward group})
_POST_FORWARD_GROUPS: dict[int, tuple[weakref.ref, dict[int, dist.ProcessGroup]]] = {}


def _post_forward_group(mesh: DeviceMesh, size: int) -> dist.ProcessGroup:
    """This rank's group of ``size`` consecutive ranks of ``mesh`` (its row of
    ``mesh.mesh.reshape(-1, size)``), created once per mesh object and size.

    Only the group's members create it (``use_local_synchronization``): the groups of one
    mesh are disjoint, and a data-parallel sub-mesh (tensor parallel beside it) is not known to
    the ranks of its sibling sub-meshes, which create their own groups."""
    key = id(mesh)
    entry = _POST_FORWARD_GROUPS.get(key)
    if entry is None or entry[0]() is not mesh:

        def forget(ref: weakref.ref, key: int = key) -> None:
            if _POST_FORWARD_GROUPS.get(key, (None,))[0] is ref:
                del _POST_FORWARD_GROUPS[key]

        entry = (weakref.ref(mesh, forget), {})
        _POST_FORWARD_GROUPS[key] = entry
    groups = entry[1]
    if size not in groups:
        me = dist.get_rank()
        row = next(r for r in mesh.mesh.reshape(-1, size).tolist() if me in r)
        groups[size] = dist.new_group(row, use_local_synchronization=True)
    return groups[size]


@dataclass(frozen=True)
class PostForwardMesh:
    """Where a unit keeps its parameters between forward and backward under an ``int``
    ``reshard_after_forward`` ``N`` (``1 < N < W``, ``W`` the shard world size), as FSDP2's
    post-forward mesh: groups of ``N`` consecutive ranks (rows of ``mesh.mesh.reshape(-1, N)``;
    for HSDP the 2-D mesh flattened, so each group lies inside one replica's shard row).

    The ``W`` chunks of the unit's flat buffer are coarsened into ``N`` *places*: place ``j``
    holds the chunks of shard ranks ``j * factor`` to ``(j + 1) * factor - 1``
    (``factor = W // N``), contiguous in every plan segment. After forward the rank at place
    ``rank`` of its group keeps that place's part of the gathered buffer (``1/N`` of the
    unit); backward all-gathers the ``N`` places over ``group``.

    Args:
        size: ``N``, the ranks per group.
        rank: this rank's place in its group (its shard rank modulo ``N``).
        factor: shard ranks per place, ``W // N``.
        group: this rank's ``N``-rank process group (created once per mesh and ``N``).
    """

    size: int
    rank: int
    factor: int
    group: dist.ProcessGroup

    @staticmethod
    def of(dp: DataParallelMesh, size: int) -> PostForwardMesh:
        """The post-forward mesh of ``size``-rank groups of ``dp`` (``size`` divides the shard
        world size; checked by the caller). Collective over each group the first time."""
        world = dp.shard_size
        if size < 1 or world % size:
            raise ValueError(f"size={size} must divide the shard world size {world}")
        group = _post_forward_group(dp.mesh, size)
        return PostForwardMesh(size, dp.shard_rank % size, world // size, group)

    def coarsen(self, segments: Sequence[Segment]) -> list[Segment]:
        """A flat buffer's plan ``segments`` coarsened to the ``N`` places
        (:func:`coarsen_segments` by ``factor``)."""
        return coarsen_segments(segments, self.factor)


def coarsen_segments(segments: Sequence[Segment], factor: int) -> list[Segment]:
    """A flat buffer's plan ``segments`` over ``W`` ranks seen over ``W // factor`` places:
    place ``j`` owns, in each segment, the chunks of ranks ``j * factor`` to
    ``(j + 1) * factor - 1`` (equal: ``factor * chunk_numel`` elements; uneven:
    ``rank_starts[::factor]``), at ``chunk_offset`` in a place's buffer (the segments in order,
    each as large as its largest place)."""
    out, offset = [], 0
    for seg in segments:
        if seg.rank_starts is None:
            starts, numel = None, seg.chunk_numel * factor
        else:
            starts = seg.rank_starts[::factor]
            numel = max(b - a for a, b in zip(starts, starts[1:]))
        out.append(replace(seg, chunk_offset=offset, chunk_numel=numel, rank_starts=starts))
        offset += numel
    return out
