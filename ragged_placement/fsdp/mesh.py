"""The meshes of a ``fully_shard`` unit.

:class:`UnitMesh` is what the runtime (the unit, its flat buffers and gradients, the hooks)
asks about the unit's process groups and the order of its reductions; ``fully_shard`` builds
one per unit from its ``mesh`` / ``dp_mesh_dims`` / ``state_sharding`` arguments, and the
runtime never asks which kind it holds. Each flat buffer gets, from it, its
:class:`BufferComm`: the all-gather's and the reductions' segments, groups and buffers.

* :class:`DataParallelMesh` (here): FSDP and HSDP, FSDP2's meshes; its buffers' communication
  is :class:`ShardComm`;
* :class:`~ragged_placement.fsdp.nested.StateShardedMesh`: per-state sharding
  (``state_sharding``), whose buffers' communication is the nested layout's
  (:class:`~ragged_placement.fsdp.nested.NestedBuffer`).

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

import abc
import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate

from ragged_placement._compat import concatenate_meshes
from ragged_placement._gloo import one_worker_gloo
from ragged_placement.fsdp.collectives import FixedAllGather, Gather, Reduction
from ragged_placement.fsdp.common import CommStats
from ragged_placement.placement import RaggedShard
from ragged_placement.planner.plan import Segment

if TYPE_CHECKING:
    from ragged_placement.planner.layout import FlatLayout

__all__ = [
    "BufferComm", "DataParallelMesh", "GatherBuffers", "ParamRefresh", "PostForwardMesh",
    "ShardComm", "UnitMesh", "any_rank", "coarsen_segments",
]


class UnitMesh(abc.ABC):
    """The process groups of one ``fully_shard`` unit and the order of its reductions.

    The flat buffers are planned over the *shard* ranks (``shard_size`` chunks, this rank's
    ``shard_rank``); a sharded parameter is a RaggedShard DTensor over them on :attr:`mesh`
    (with ``Replicate()`` over the replicas first, :meth:`placements`). Gradients are
    averaged over ``shard_size * replicate_size`` ranks.

    Attributes:
        source: the user's data-parallel mesh.
        mesh: the mesh of the sharded parameters (without a tensor-parallel dim).
    """

    source: DeviceMesh
    mesh: DeviceMesh

    @property
    @abc.abstractmethod
    def shard_group(self) -> dist.ProcessGroup:
        """The group of the shard ranks (a buffer's chunks)."""

    @property
    @abc.abstractmethod
    def shard_rank(self) -> int:
        """This rank's chunk among the shard ranks."""

    @property
    @abc.abstractmethod
    def shard_size(self) -> int:
        """The number of shard ranks (chunks of a buffer)."""

    @property
    @abc.abstractmethod
    def replicate_group(self) -> dist.ProcessGroup | None:
        """The group of this rank's replicas (``None``: no replicas)."""

    @property
    @abc.abstractmethod
    def replicate_size(self) -> int:
        """The number of replicas of a chunk."""

    @property
    def hsdp(self) -> bool:
        """Whether each chunk has replicas (HSDP, or dims outside ``state_sharding.optim``)."""
        return self.replicate_size > 1

    @property
    def shard_dim(self) -> int:
        """The dim of :attr:`mesh` the chunks are sharded over (its last)."""
        return self.mesh.ndim - 1

    def placements(self, fsdp: RaggedShard) -> tuple[Placement, ...]:
        """The placements of a sharded parameter on :attr:`mesh`: ``(Replicate(),)`` over the
        replicas if any, then ``fsdp`` over the shard ranks."""
        return (Replicate(), fsdp) if self.hsdp else (fsdp,)

    @abc.abstractmethod
    def with_tp(self, tp_mesh: DeviceMesh) -> DeviceMesh:
        """The mesh of the sharded parameters beside ``tp_mesh`` (a sibling sub-mesh of
        :attr:`source` in one root mesh): :attr:`mesh`'s dims, then ``tp_mesh``'s."""

    @abc.abstractmethod
    def buffer_comm(self, plan: FlatLayout) -> BufferComm:
        """The communication of a flat buffer laid out as ``plan`` over the shard ranks."""

    # -- what only some meshes do; the defaults are FSDP's ----------------------------------
    def param_refresh(self, unit) -> ParamRefresh:
        """What ``unit``, the :class:`~ragged_placement.fsdp.unit.FSDPUnit` built on this
        mesh, runs before each unshard (FSDP's: nothing; a ``state_sharding``'s refreshes the
        parameter chunks, :class:`~ragged_placement.fsdp.nested_refresh.ChunkRefresh`)."""
        del unit
        return ParamRefresh()

    def fixed_all_gather(self, buffers: Sequence,
                         gathers: list[Gather]) -> FixedAllGather | None:
        """A unit's all-gather built once from its first ``gathers`` and reissued at each
        unshard, where every one of its ``buffers`` takes the common path (a plain gather
        sending its sharded chunk as it is or cast: no FP8, no CPU offload); else ``None``.
        FSDP's and HSDP's meshes gather the sharded chunks themselves; a ``state_sharding``'s
        gathers parameter chunks of its own (``None``)."""
        if not all(b.gathers_own_chunk for b in buffers):
            return None
        if not FixedAllGather.applies(gathers, gathers[0].group):
            return None
        return FixedAllGather(gathers, [b.sharded for b in buffers],
                              [b.gather.allocate for b in buffers])

    @property
    def keeps_params_unsharded(self) -> bool:
        """Whether the unsharded buffers persist between passes (the refresh fills them and
        no all-gather runs): parameters sharded over no rank."""
        return False

    @property
    def replicas_group(self) -> dist.ProcessGroup | None:
        """The group over which the unit all-reduces each reduce-scatter output (HSDP's
        replicas; ``None``: :meth:`BufferComm.start_rest` reduced over the replicas already, or
        there are none: a replicate dim of size 1 issues nothing)."""
        return self.replicate_group if self.replicate_size > 1 else None

    @property
    def reduces_over_all_ranks(self) -> bool:
        """Whether the unit's reduce-scatter over the shard ranks, then its all-reduce over
        :attr:`replicas_group`, sums over every data-parallel rank of more than one (so one
        more part of it can carry an agreement among them)."""
        return self.shard_size > 1

    @property
    def agreement_groups(self) -> tuple[dist.ProcessGroup, ...]:
        """The groups an agreement among all the data-parallel ranks runs over (the shard
        ranks', then the replicas'): those of more than one rank, so that a mesh dim of size 1
        costs no collective (none at all on one rank)."""
        groups = [(self.shard_group, self.shard_size), (self.replicate_group, self.replicate_size)]
        return tuple(group for group, size in groups if group is not None and size > 1)

    def check_supported(self, what: str, where: str) -> None:
        """``ValueError`` if ``what`` (an ``FSDPModule`` setting, on module class ``where``)
        cannot run on this mesh."""
        del what, where

    def count(self, stats: CommStats, kind: str, level: str, nbytes: int) -> None:
        """Count ``nbytes`` of collective ``kind`` over the dims of ``level`` (``"params"``:
        the all-gather and the first reduce-scatter; ``"refresh"``) in ``stats.by_dims``, for
        meshes that name their dims there."""
        del stats, kind, level, nbytes


class ParamRefresh:
    """What a unit runs before each unshard to bring the parameters it gathers up to date with
    the sharded chunks (:meth:`UnitMesh.param_refresh`). Here nothing: on FSDP's and HSDP's
    meshes the all-gather sends the sharded chunks themselves. A ``state_sharding`` gathers
    parameter chunks of their own, refreshed from the sharded ones
    (:class:`~ragged_placement.fsdp.nested_refresh.ChunkRefresh`)."""

    def before_unshard(self) -> bool:
        """Bring the parameters up to date; whether that filled the unsharded buffers (then no
        all-gather follows)."""
        return False

    def wait(self) -> None:
        """Wait for a refresh in flight (before the sharded chunks are moved)."""

    def mark_stale(self) -> None:
        """The sharded chunks changed where no version counter shows it (a move)."""


class GatherBuffers(Protocol):
    """What a buffer's communication uses of its gather (:class:`~ragged_placement.fsdp.
    gather.PlainGather`, or the FP8 one): the all-gather's output and segments."""

    gathered: torch.Tensor
    send_segments: Sequence[Segment]

    def allocate(self) -> None:
        """Give ``gathered`` its storage."""

    def assemble(self) -> None:
        """After an all-gather into ``gathered``: assemble the unsharded tensors."""


class BufferComm(abc.ABC):
    """One flat buffer's communication on its unit's mesh: what its all-gather sends and
    where, and the order of its gradient reductions (built once with the buffer from its plan,
    :meth:`UnitMesh.buffer_comm`). It is handed what it needs, and never reads the buffer:
    the gather (:class:`~ragged_placement.fsdp.gather.PlainGather` or the FP8 one) at each
    :meth:`allocate`, the packing of this rank's send at each unshard."""

    @property
    def param_chunk(self) -> torch.Tensor | None:
        """What the buffer keeps for its parameters beside the sharded chunk between passes
        (``None``: nothing)."""
        return None

    @property
    def overlaps(self) -> bool:
        """Whether :meth:`start_rest` leaves a collective in flight."""
        return False

    @abc.abstractmethod
    def allocate(self, gather: GatherBuffers | None, chunk: torch.Tensor | None) -> None:
        """After each allocation of the buffer (``FlatBuffer.allocate``): its ``gather``
        (``None`` on the meta device), and ``chunk``, its sharded chunk where the all-gather
        sends it as it is or cast to ``param_dtype`` (no staging copy, no packing; else
        ``None``). Allocates what this communication keeps."""

    def shared_unsharded(self, chunk: torch.Tensor | None,
                         dtype: torch.dtype) -> torch.Tensor | None:
        """The tensor whose storage the unsharded buffer (in ``dtype``) shares, given the
        ``chunk`` of :meth:`allocate` (``None``: a storage of its own, allocated at each
        unshard; see :class:`~ragged_placement.fsdp.gather.PlainGather`)."""
        del chunk, dtype
        return None

    @abc.abstractmethod
    def prepare_unshard(self, pack: Callable[[PostForwardMesh | None], torch.Tensor],
                        pf: PostForwardMesh | None) -> Gather:
        """The all-gather into the unsharded buffer (from the post-forward shard where ``pf``),
        its output's storage allocated; ``pack(pf)`` gives this rank's send (the post-forward
        shard, or the gather's packing of the sharded chunk, staged to the device)."""

    @abc.abstractmethod
    def reduction(self, inputs: list[torch.Tensor],
                  group: dist.ProcessGroup | None) -> Reduction:
        """The reduce-scatter of the per-segment unsharded gradients ``inputs`` (in
        ``reduce_dtype``), over ``group`` where it is not ``None``
        (``set_separate_reduce_scatter_group``)."""

    def start_rest(self, reduction: Reduction,
                   stats: CommStats) -> Callable[[], torch.Tensor]:
        """What follows the finished reduce-scatter ``reduction``, issued; returns what
        completes it and gives the summed gradient chunk (here: the reduce-scatter's output;
        the reduction's inputs are not kept alive)."""
        del stats
        output = reduction.output
        return lambda: output


@dataclass(frozen=True)
class DataParallelMesh(UnitMesh):
    """The data-parallel mesh of one unit: ``mesh`` is 1-D (shard) or 2-D (replicate, shard)."""

    mesh: DeviceMesh

    @staticmethod
    def of(mesh: object) -> DataParallelMesh:
        """Validate ``mesh`` (the ``mesh`` argument of ``fully_shard``)."""
        if not isinstance(mesh, DeviceMesh) or mesh.ndim not in (1, 2):
            raise ValueError(
                "mesh must be a 1-D (shard) or 2-D (replicate, shard) DeviceMesh: fully_shard "
                f"expects a 1D or 2D DeviceMesh but got {mesh!r}"
            )
        return DataParallelMesh(mesh)

    @property
    def source(self) -> DeviceMesh:
        """The user's data-parallel mesh (``mesh`` itself)."""
        return self.mesh

    # Read by every hook: computed once per mesh (a DeviceMesh's groups, ranks and sizes never
    # change; cached_property writes the instance dict, which a frozen dataclass allows).
    @functools.cached_property
    def hsdp(self) -> bool:
        return self.mesh.ndim == 2

    @functools.cached_property
    def shard_dim(self) -> int:
        return self.mesh.ndim - 1

    @functools.cached_property
    def shard_group(self):
        return self.mesh.get_group(self.shard_dim)

    @functools.cached_property
    def shard_rank(self) -> int:
        return self.mesh.get_local_rank(self.shard_dim)

    @functools.cached_property
    def shard_size(self) -> int:
        return self.mesh.size(self.shard_dim)

    @functools.cached_property
    def replicate_group(self):
        return self.mesh.get_group(0) if self.hsdp else None

    @functools.cached_property
    def replicate_size(self) -> int:
        return self.mesh.size(0) if self.hsdp else 1

    @functools.cached_property
    def agreement_groups(self) -> tuple[dist.ProcessGroup, ...]:
        return UnitMesh.agreement_groups.fget(self)

    def with_tp(self, tp_mesh: DeviceMesh) -> DeviceMesh:
        return concatenate_meshes([self.mesh, tp_mesh])

    def buffer_comm(self, plan: FlatLayout) -> ShardComm:
        return ShardComm(plan, self)


class ShardComm(BufferComm):
    """A flat buffer's communication on a :class:`DataParallelMesh`: the all-gather of the
    chunks over the shard group (or of the post-forward shards over their group), the
    reduce-scatter over it; HSDP's all-reduce over the replicas follows in the unit.

    **One shard rank** (a one-rank mesh, or a shard dim of size 1): the chunk is the whole
    buffer, so the unsharded parameters are views of the sharded chunk itself
    (:meth:`shared_unsharded`, where no cast, CPU offload or FP8 packing stands between them),
    a one-segment buffer's reduce-scatter output is its gradient buffer itself (:meth:`reduction`:
    ``.grad`` lands where backward accumulated it), and the unit's collectives over one rank are
    local copies at most, none issued (:func:`~ragged_placement.fsdp.collectives.
    issue_all_gather`)."""

    _plan: FlatLayout
    _mesh: DataParallelMesh
    _gather: GatherBuffers | None  # the buffer's (allocate)
    _chunk: torch.Tensor | None  # its sharded chunk, where sent as it is or cast (allocate)
    _one: bool  # _one_rank(), read at every unshard and reduction: decided once

    def __init__(self, plan: FlatLayout, mesh: DataParallelMesh) -> None:
        self._plan = plan
        self._mesh = mesh
        self._gather = self._chunk = None
        self._one = (mesh.shard_size == 1 and plan.buffer_numel <= plan.chunk_numel
                     and all(s.chunk_offset == s.buffer_offset for s in plan.segments))

    def _one_rank(self) -> bool:
        """Whether the buffer is sharded over one rank with the chunk laid out as the
        unsharded buffer (every segment at the same offset in both)."""
        return self._one

    def allocate(self, gather: GatherBuffers | None, chunk: torch.Tensor | None) -> None:
        self._gather, self._chunk = gather, chunk

    def shared_unsharded(self, chunk: torch.Tensor | None,
                         dtype: torch.dtype) -> torch.Tensor | None:
        """The sharded chunk over one rank where it is sent as it is (no cast)."""
        return chunk if chunk is not None and chunk.dtype == dtype and self._one_rank() else None

    def prepare_unshard(self, pack: Callable[[PostForwardMesh | None], torch.Tensor],
                        pf: PostForwardMesh | None) -> Gather:
        gather = self._gather
        gather.allocate()
        if pf is None and self._chunk is not None and self._one_rank():
            # one rank: the mixed-precision cast written into the unsharded buffer (a no-op
            # where it shares the chunk's storage), which the local all-gather leaves as it is
            send = gather.gathered
            if send.data_ptr() != self._chunk.data_ptr():
                send.copy_(self._chunk[:send.numel()])
        else:
            send = pack(pf)
        world_size = self._mesh.shard_size if pf is None else pf.size
        segments = gather.send_segments if pf is None else pf.coarsen(gather.send_segments)
        group = self._mesh.shard_group if pf is None else pf.group
        return Gather(gather.gathered, send, segments, world_size, group, pf is not None)

    def reduction(self, inputs: list[torch.Tensor],
                  group: dist.ProcessGroup | None) -> Reduction:
        plan = self._plan
        if self._one_rank() and len(inputs) == 1 and inputs[0].numel() == plan.chunk_numel:
            out = inputs[0]  # one rank, one segment: the sum is the gradient buffer itself
        else:
            out = inputs[0].new_empty(plan.chunk_numel)  # in reduce_dtype, as the inputs
        group = self._mesh.shard_group if group is None else group
        return Reduction(out, inputs, plan.segments, self._mesh.shard_size, group)


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
        with one_worker_gloo():  # this runtime's own group (_gloo)
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


def any_rank(flags: list[bool], device: torch.device,
             groups: Sequence[dist.ProcessGroup]) -> list[bool]:
    """Each of ``flags`` or-ed over the ranks of ``groups`` (a unit mesh's
    :attr:`~UnitMesh.agreement_groups`; none: this rank's own): one all-reduce (max) of one
    byte per flag per group, read by the host."""
    if not groups:
        return list(flags)
    out = torch.tensor(flags, dtype=torch.uint8, device=device)
    for group in groups:
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return [bool(f) for f in out.tolist()]
