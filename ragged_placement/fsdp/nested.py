"""Per-state sharding in the runtime: ``fully_shard(..., state_sharding=StateSharding(...))``.

A :class:`~ragged_placement.planner.sharding.StateSharding` names the mesh dims each state is
sharded over, ``params`` ⊆ ``grads`` ⊆ ``optim`` (AMSP's ``s_P <= s_G <= s_OS``). Write ``P``,
``G``, ``O`` for those dim sets, ``R`` for the dims outside ``O`` (everything replicated), and
``|X|`` for the number of ranks a set spans.

**The nested layout.** A unit's flat buffer is planned over the ``|O|`` optimizer ranks
(:func:`~ragged_placement.planner.plan_segmented`, block-aligned and with the flat plan's padding
targets), with those ranks ordered *params-major*: optimizer rank
``o = (p * |G \\ P| + g) * |O \\ G| + z`` for the coordinates ``p`` over ``P``, ``g`` over
``G \\ P`` and ``z`` over ``O \\ G`` (each row-major in mesh order). Then every level is a
contiguous run of optimizer chunks, in every plan segment:

* the *parameter chunk* of ``p``: the ``|O \\ P|`` optimizer chunks ``p * |O \\ P|`` onwards
  (:func:`~ragged_placement.fsdp.mesh.coarsen_segments` by ``|O \\ P|``);
* the *gradient chunk* of ``(p, g)``: the ``|O \\ G|`` chunks from ``(p * |G \\ P| + g) *
  |O \\ G|``, inside the parameter chunk;
* the *optimizer chunk* ``o``: inside the gradient chunk.

So each rank keeps, persistently: its optimizer chunk (``FlatBuffer.sharded``, in the
parameters' dtype: the sharded parameters, ``model.parameters()``, are RaggedShard DTensors over
it on a ``(R, O)`` mesh whose ``O`` dim lists the ranks in the order above), its parameter chunk
in ``param_dtype`` (:attr:`NestedBuffer.chunk`; for ``P = ()`` the unsharded buffer itself) and,
after backward, its gradient chunk's optimizer part (the sharded ``.grad``).

**Per step**, per unit (one collective per pass and per dim set; a set spanning one rank costs
nothing):

1. *refresh*: the optimizer chunks all-gathered over ``O \\ P`` into the parameter chunk,
   issued asynchronously by each optimizer step over the unit's parameters (a global step
   post-hook, in the optimizer's parameter order) so that it runs while the next forward
   starts, and waited on at the unit's next unshard; after another change (a load, a write, a
   move) the next unshard issues it;
2. forward and backward all-gather the parameter chunks over ``P`` (``reshard_after_forward``
   as without a ``state_sharding``);
3. backward reduce-scatters the gradients over ``P`` into a parameter-chunk-sized buffer, then
   over ``G \\ P`` into the gradient chunk, then all-reduces that over ``R`` and ``O \\ G``; the
   optimizer chunk's part of it, averaged over the data-parallel world, lands in ``.grad``.

What persists between steps is the optimizer chunk's part of the reduction (``.grad``), whatever
``grads`` is: sharding gradients over fewer dims than ``optim`` (ZeRO-1) only replaces the
reduce-scatter over ``optim \\ grads`` with an all-reduce, and the gradient chunk is transient.

Gradient accumulation (``set_requires_gradient_sync(False)``) keeps, as without a
``state_sharding`` (and as FSDP2), the unsharded gradients until the synchronizing backward,
which runs all three reductions once: between micro-batches every unit holds its whole
unsharded gradient buffer (the model's gradients in ``param_dtype``, with the plan's padding)
and issues nothing; the gradient shard is never held unreduced.

**Staleness.** When a unit refreshes (an optimizer step, a write, a state dict taken, a move)
and how the ranks agree on it: :mod:`ragged_placement.fsdp.nested_refresh`.

**Process groups.** Created once per ``(mesh, state_sharding)``, by their members only; the
``O \\ P`` and ``O`` groups list their ranks in the order above, not sorted where it is not the
mesh's (:func:`ragged_placement._compat.new_group_in_order`: ``new_group(sort_ranks=False)`` on
torch 2.13, checked emulation on 2.11).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ragged_placement._compat import concatenate_meshes, new_group_in_order
from ragged_placement.fsdp.collectives import Gather, Reduction, reduce_scatter_parts
from ragged_placement.fsdp.common import CommStats
from ragged_placement.fsdp.mesh import (
    BufferComm,
    GatherBuffers,
    ParamRefresh,
    PostForwardMesh,
    UnitMesh,
    coarsen_segments,
)
from ragged_placement.fsdp.nested_refresh import ChunkRefresh
from ragged_placement.planner.sharding import StateSharding
from ragged_placement.planner.plan import Segment

if TYPE_CHECKING:
    from ragged_placement.fsdp.unit import FSDPUnit
    from ragged_placement.planner.layout import FlatLayout

__all__ = [
    "Level", "NestedBuffer", "StateShardedMesh", "check_state_sharding", "nest_segments",
    "state_sharded_mesh",
]


@dataclass(frozen=True)
class Level:
    """One dim set of the nested layout: ``size`` ranks, this rank's index ``rank`` among them,
    their process group (``None`` when ``size`` is 1) and the mesh dims it spans (in mesh
    order; the group's rank order is the nested layout's, see the module docstring)."""

    size: int
    rank: int
    group: dist.ProcessGroup | None
    dims: tuple[str, ...]


def _rank_grid(
    mesh: DeviceMesh, sharding: StateSharding, ranks: torch.Tensor | None = None
) -> tuple[torch.Tensor, list[tuple[str, ...]]]:
    """``mesh``'s global ranks as a ``(R, P, G \\ P, O \\ G)`` tensor and those four dim
    sets; ``ranks``: the ranks of ``mesh`` and trailing dims beside it (kept last)."""
    names = list(mesh.mesh_dim_names)
    ranks = mesh.mesh if ranks is None else ranks
    params = sharding.params
    grads = tuple(d for d in sharding.grads if d not in params)
    zero = tuple(d for d in sharding.optim if d not in sharding.grads)
    replicate = tuple(d for d in names if d not in sharding.optim)
    sets = [replicate, params, grads, zero]
    order = [names.index(d) for dims in sets for d in dims]
    sizes = [math.prod(mesh.shape[names.index(d)] for d in dims) for dims in sets]
    trailing = list(range(len(names), ranks.ndim))
    return ranks.permute(*order, *trailing).reshape(*sizes, *ranks.shape[len(names):]), sets


class _Groups:
    """Creates each group once by its ranks, in their order (members only)."""

    def __init__(self) -> None:
        self._made: dict[tuple[int, ...], dist.ProcessGroup | None] = {}

    def level(self, ranks: torch.Tensor, dims: tuple[str, ...]) -> Level:
        order = tuple(int(r) for r in ranks.reshape(-1).tolist())
        if order not in self._made:
            self._made[order] = new_group_in_order(list(order)) if len(order) > 1 else None
        return Level(len(order), order.index(dist.get_rank()), self._made[order], dims)


@dataclass(frozen=True, eq=False)
class StateShardedMesh(UnitMesh):
    """The process groups and the parameter mesh of a unit under a ``state_sharding`` that is
    not ``fully_shard``'s default (see the module docstring): a
    :class:`~ragged_placement.fsdp.mesh.UnitMesh` over the optimizer ranks (``mesh`` is the
    ``(R, O)`` mesh of the sharded parameters, ``shard_*`` its ``O`` dim), so that the flat
    buffer is planned over ``|O|`` ranks, with the levels of the nested layout.

    Build with :meth:`of` (cached per mesh and sharding: group creation is collective over each
    group's members)."""

    sharding: StateSharding
    source: DeviceMesh  # the user's data-parallel mesh
    mesh: DeviceMesh  # the (R, O) mesh of the sharded parameters ((O,) when R is empty)
    params: Level  # P: the all-gather of forward and backward, the first reduce-scatter
    grads: Level  # G \ P: the second reduce-scatter
    refresh: Level  # O \ P: the all-gather of updated optimizer chunks
    reduce: Level  # R and O \ G: the all-reduce of the gradient chunk
    optim: Level  # O
    replicate: Level  # R
    # id(tp mesh) -> (the tp mesh, kept alive; the (R, O, tp) mesh): with_tp's
    _with_tp: dict[int, tuple[DeviceMesh, DeviceMesh]] = field(default_factory=dict)

    @staticmethod
    def of(mesh: DeviceMesh, sharding: StateSharding) -> StateShardedMesh:
        """The state-sharded mesh of ``sharding`` on ``mesh`` (validated by the caller)."""
        key = id(mesh)
        entry = _MESHES.get(key)
        if entry is None or entry[0]() is not mesh:
            entry = (weakref.ref(mesh), {})
            _MESHES[key] = entry
        if sharding not in entry[1]:
            entry[1][sharding] = StateShardedMesh._build(mesh, sharding)
        return entry[1][sharding]

    @staticmethod
    def _build(mesh: DeviceMesh, sharding: StateSharding) -> StateShardedMesh:
        grid, (rep, params, grads, zero) = _rank_grid(mesh, sharding)

        def in_mesh_order(*dims: tuple[str, ...]) -> tuple[str, ...]:  # a Level's dims
            return tuple(d for d in mesh.mesh_dim_names if any(d in ds for ds in dims))

        r, p, g, z = (int(i) for i in (grid == dist.get_rank()).nonzero()[0])
        groups = _Groups()
        optim = groups.level(grid[r], sharding.optim)
        replicate = groups.level(grid[:, p, g, z], rep)
        levels = {
            "params": groups.level(grid[r, :, g, z], params),
            "grads": groups.level(grid[r, p, :, z], grads),
            "refresh": groups.level(grid[r, p], in_mesh_order(grads, zero)),
            "reduce": groups.level(grid[:, p, g, :], in_mesh_order(rep, zero)),
        }
        flat = grid.reshape(replicate.size, optim.size)
        if replicate.size == 1:
            pmesh = DeviceMesh.from_group(
                optim.group, mesh.device_type, mesh=flat[0].tolist(), mesh_dim_names=("optim",)
            )
        else:
            pmesh = DeviceMesh.from_group(
                [replicate.group, optim.group], mesh.device_type, mesh=flat,
                mesh_dim_names=("replicate", "optim"),
            )
        return StateShardedMesh(sharding, mesh, pmesh, optim=optim, replicate=replicate, **levels)

    def with_tp(self, tp_mesh: DeviceMesh) -> DeviceMesh:
        """The mesh of the sharded parameters beside ``tp_mesh`` (a sibling of ``source`` in
        one root mesh): ``mesh``'s dims, then ``tp_mesh``'s, built once per ``tp_mesh`` from
        the groups of this rank (the tensor-parallel one is ``tp_mesh``'s)."""
        key = id(tp_mesh)
        if key not in self._with_tp:
            full = concatenate_meshes([self.source, tp_mesh]).mesh
            grid, _ = _rank_grid(self.source, self.sharding, full)
            ranks = grid.reshape(self.replicate.size, self.optim.size, tp_mesh.size())
            groups = [self.optim.group, tp_mesh.get_group()]
            names = ("optim", *tp_mesh.mesh_dim_names)
            if self.hsdp:
                groups, names = [self.replicate.group, *groups], ("replicate", *names)
            else:
                ranks = ranks[0]
            self._with_tp[key] = (tp_mesh, DeviceMesh.from_group(
                groups, self.source.device_type, mesh=ranks, mesh_dim_names=names
            ))
        return self._with_tp[key][1]

    # -- the UnitMesh interface, over the optimizer ranks ---------------------------------------
    @property
    def shard_group(self) -> dist.ProcessGroup:
        return self.optim.group

    @property
    def shard_rank(self) -> int:
        return self.optim.rank

    @property
    def shard_size(self) -> int:
        return self.optim.size

    @property
    def replicate_group(self) -> dist.ProcessGroup | None:
        return self.replicate.group

    @property
    def replicate_size(self) -> int:
        return self.replicate.size

    def buffer_comm(self, plan: FlatLayout) -> NestedBuffer:
        return NestedBuffer(plan, self)

    @property
    def refreshes(self) -> bool:
        """Whether updated optimizer chunks must be all-gathered into a parameter chunk of
        their own: ``optim`` spans more ranks than ``params``, or ``params=()`` (the unsharded
        buffer is then the parameter chunk). Else (``params == optim``) the all-gather over
        ``P`` sends the optimizer chunk itself, as without a ``state_sharding``."""
        return self.params_factor > 1 or self.params.size == 1

    @property
    def keeps_params_unsharded(self) -> bool:
        """``params=()``: the unsharded buffer is the parameter chunk, filled by the refresh."""
        return self.params.size == 1

    @property
    def replicas_group(self) -> None:
        """None: :meth:`NestedBuffer.start_rest` all-reduces over ``R`` itself."""
        return None

    @property
    def reduces_over_all_ranks(self) -> bool:
        """False: the reductions past the reduce-scatter run over other groups, in
        :meth:`NestedBuffer.start_rest`."""
        return False

    def param_refresh(self, unit: FSDPUnit) -> ParamRefresh:
        """``unit``'s :class:`ChunkRefresh` where the parameter chunks are refreshed
        (:attr:`refreshes`) and it holds parameters; else nothing to refresh."""
        if not (self.refreshes and unit.slots):
            return ParamRefresh()
        return ChunkRefresh(unit, self)

    def check_supported(self, what: str, where: str) -> None:
        raise ValueError(
            f"{what} on {where}, sharded with state_sharding={self.sharding}: not "
            f"supported under a state_sharding (its reductions run over several groups); "
            f"drop the call, or shard without state_sharding"
        )

    def fixed_all_gather(self, buffers, gathers) -> None:
        del buffers, gathers  # it gathers parameter chunks of its own, refreshed before each unshard

    def count(self, stats: CommStats, kind: str, level: str, nbytes: int) -> None:
        stats.count_dims(kind, getattr(self, level).dims, nbytes)

    # -- the nested layout ----------------------------------------------------------------------
    @property
    def params_factor(self) -> int:
        """Optimizer chunks per parameter chunk, ``|O \\ P|``."""
        return self.refresh.size

    @property
    def grads_factor(self) -> int:
        """Optimizer chunks per gradient chunk, ``|O \\ G|``."""
        return self.optim.size // (self.params.size * self.grads.size)

    @property
    def grads_index(self) -> int:
        """This rank's gradient chunk among the ``|G|`` of them."""
        return self.params.rank * self.grads.size + self.grads.rank


def state_sharded_mesh(sharding: StateSharding, mesh: DeviceMesh) -> StateShardedMesh:
    """The unit's :class:`StateShardedMesh` for ``sharding`` (checked by
    :func:`check_state_sharding`, and against ``fully_shard``'s other arguments by
    :func:`ragged_placement.combinations.check_combinations`) on ``mesh``; collective over its
    groups the first time."""
    return StateShardedMesh.of(mesh, sharding)


def check_state_sharding(state_sharding: object, mesh: object) -> StateSharding | None:
    """``state_sharding`` checked against ``mesh``: the sharding the nested runtime takes, or
    ``None`` for ``None`` or ``mesh``'s default (:meth:`StateSharding.is_default`: the runtime
    without nesting). No communication. Its combinations with ``fully_shard``'s other
    arguments are :data:`ragged_placement.combinations.REFUSED`'s.

    Raises:
        TypeError: ``state_sharding`` is not a ``StateSharding``.
        ValueError: ``mesh`` is not a ``DeviceMesh``, or ``state_sharding`` does not fit it
            (:meth:`StateSharding.validate`) or shards nothing.
    """
    if state_sharding is None:
        return None
    if not isinstance(state_sharding, StateSharding):
        raise TypeError(
            f"state_sharding must be a ragged_placement.fsdp.StateSharding, got "
            f"{type(state_sharding).__name__}"
        )
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"mesh must be a DeviceMesh with mesh_dim_names, got {mesh!r}")
    state_sharding.validate(mesh)
    if state_sharding.is_default(mesh):
        return None
    if not state_sharding.optim:
        raise ValueError(
            f"state_sharding={state_sharding} shards no state: name at least one mesh dim in "
            f"optim (replicating everything is DDP: torch.nn.parallel.DistributedDataParallel)"
        )
    return state_sharding


# id(mesh) -> (a weak reference to the mesh, {sharding: its StateShardedMesh})
_MESHES: dict[int, tuple[weakref.ref, dict[StateSharding, StateShardedMesh]]] = {}


def level_layout(segments: Sequence[Segment], factor: int, world_size: int) -> list[Segment]:
    """Where each segment's chunk of a level of ``factor`` optimizer chunks sits in that level's
    buffer: the plan's own layout for ``factor`` 1, the unsharded buffer's for ``world_size``,
    else :func:`~ragged_placement.fsdp.mesh.coarsen_segments`."""
    if factor == 1:
        return list(segments)
    if factor == world_size:
        return [
            Segment(s.buffer_offset, s.buffer_offset, s.buffer_numel(world_size)) for s in segments
        ]
    return coarsen_segments(segments, factor)


def nest_segments(
    segments: Sequence[Segment], world_size: int, outer: int, inner: int, index: int
) -> list[Segment]:
    """The segments of a collective among the ``outer // inner`` chunks of ``inner`` optimizer
    chunks that make up chunk ``index`` of ``outer`` optimizer chunks: each segment's "buffer"
    is its run of the outer chunk (at its place in the outer level's buffer,
    :func:`level_layout`), split in member order; each member's "chunk" is its run at its place
    in the inner level's buffer. All-gathering over them assembles the outer chunk from the
    inner ones; reduce-scattering splits it."""
    outer_layout = level_layout(segments, outer, world_size)
    inner_layout = level_layout(segments, inner, world_size)
    members = outer // inner
    out = []
    for seg, o, i in zip(segments, outer_layout, inner_layout):
        if seg.rank_starts is None:
            out.append(Segment(i.chunk_offset, o.chunk_offset, seg.chunk_numel * inner))
            continue
        base = index * outer
        starts = tuple(
            seg.rank_starts[base + j * inner] - seg.rank_starts[base] for j in range(members + 1)
        )
        numel = max(b - a for a, b in zip(starts, starts[1:]))
        out.append(Segment(i.chunk_offset, o.chunk_offset, numel, starts))
    return out


def _level_segments(segments: Sequence[Segment], factor: int) -> list[Segment]:
    """The segments of a collective over ``P`` (parameter chunks of ``factor`` optimizer
    chunks each): the plan's own for ``factor`` 1, else coarsened."""
    return list(segments) if factor == 1 else coarsen_segments(segments, factor)


def _layout_numel(layout: Sequence[Segment]) -> int:
    return max((s.chunk_offset + s.chunk_numel for s in layout), default=0)


class NestedBuffer(BufferComm):
    """The nested layout of one flat buffer (see the module docstring): its parameter chunk and
    the segments of its four collectives; the buffer's communication on a
    :class:`StateShardedMesh`.

    Args:
        plan: the flat buffer's layout, over the optimizer ranks of ``mesh``.
        mesh: the unit's state-sharded mesh.
    """

    mesh: StateShardedMesh
    # the parameter side, laid out as the all-gather's segments (the plan's, or an FP8 buffer's
    # one segment of send buffers), set by allocate() once the gather exists
    chunk: torch.Tensor | None  # the parameter chunk (None for P = (), or params == optim)
    gather_segments: list[Segment]  # the all-gather over P
    refresh_segments: list[Segment]  # the all-gather over O \ P
    # the gradient side, laid out as the plan's segments (in reduce_dtype)
    reduce_segments: list[Segment]  # the reduce-scatter over P
    grads_segments: list[Segment]  # the reduce-scatter over G \ P
    optim_segments: list[Segment]  # the optimizer chunk inside the gradient chunk
    reduced_numel: int  # the reduce-scatter over P's output
    grads_numel: int
    _chunk_numel: int  # the plan's (the optimizer chunk's)
    _gather: GatherBuffers | None  # the buffer's (allocate)
    _send: torch.Tensor | None  # the refresh's input, alive until it is waited on

    def __init__(self, plan: FlatLayout, mesh: StateShardedMesh) -> None:
        self.mesh = mesh
        self._chunk_numel = plan.chunk_numel
        self._gather = None
        segs, world = plan.segments, mesh.optim.size
        fp, fg = mesh.params_factor, mesh.grads_factor
        self.reduce_segments = _level_segments(segs, fp)
        self.grads_segments = nest_segments(segs, world, fp, fg, mesh.params.rank)
        self.optim_segments = nest_segments(segs, world, fg, 1, mesh.grads_index)
        self.reduced_numel = _layout_numel(level_layout(segs, fp, world))
        self.grads_numel = _layout_numel(level_layout(segs, fg, world))
        self.chunk = None
        self._send = None
        self.gather_segments = self.refresh_segments = []

    @property
    def refreshes(self) -> bool:
        """Whether the parameter chunk is refreshed (:attr:`StateShardedMesh.refreshes`)."""
        return self.mesh.refreshes

    @property
    def param_chunk(self) -> torch.Tensor | None:
        """The parameter chunk, or the unsharded buffer for ``params=()``; ``None`` for
        ``params == optim``."""
        if self.sharded_params:
            return self.chunk
        return self._gather.gathered if self._gather is not None else None

    @property
    def sharded_params(self) -> bool:
        """Whether the parameters are sharded (``P`` spans ranks): else the unsharded buffer is
        the parameter chunk and stays allocated."""
        return self.mesh.params.size > 1

    def allocate(self, gather: GatherBuffers | None, chunk: torch.Tensor | None) -> None:
        """Lay out the parameter side after ``gather``'s segments and allocate the parameter
        chunk (or the persistent unsharded buffer) on the buffer's device in the all-gather's
        dtype (nothing on meta, where ``gather`` is ``None``)."""
        del chunk  # the all-gathers over P and O \ P send the gather's packing
        self._gather = gather
        self.chunk = None
        if gather is None:
            return
        segs, world, fp = gather.send_segments, self.mesh.optim.size, self.mesh.params_factor
        self.gather_segments = _level_segments(segs, fp)
        self.refresh_segments = nest_segments(segs, world, fp, 1, self.mesh.params.rank)
        if not self.sharded_params:
            gather.allocate()
        elif self.refreshes:
            numel = _layout_numel(level_layout(segs, fp, world))
            self.chunk = gather.gathered.new_empty(numel)

    # -- refresh: the updated optimizer chunks into the parameter chunk -------------------------
    def prepare_refresh(self, pack: Callable[[None], torch.Tensor]) -> Gather:
        """The all-gather over ``O \\ P`` of this rank's optimizer chunk, packed as the
        all-gather sends it (``pack(None)``: cast to ``param_dtype``, or FP8 blocks and
        scales), into the parameter chunk."""
        out = self.chunk if self.sharded_params else self._gather.gathered
        self._send = pack(None)
        level = self.mesh.refresh
        return Gather(out, self._send, self.refresh_segments, level.size, level.group, False)

    def finish_refresh(self) -> None:
        """Once the refresh is waited on: release its send buffer; with ``params=()`` the
        refresh filled the unsharded buffer, so assemble the FP8 weights from it."""
        self._send = None
        if not self.sharded_params:
            self._gather.assemble()

    def prepare_unshard(self, pack: Callable[[PostForwardMesh | None], torch.Tensor],
                        pf: PostForwardMesh | None) -> Gather:
        """The all-gather over ``P`` of the parameter chunks into the unsharded buffer
        (``pf`` is ``None``: an ``int`` ``reshard_after_forward`` is refused with a
        ``state_sharding``)."""
        gather = self._gather
        gather.allocate()
        send = self.chunk
        if send is None:  # params == optim: the optimizer chunk, cast as without nesting
            send = pack(pf)
        level = self.mesh.params
        return Gather(gather.gathered, send, self.gather_segments, level.size, level.group,
                      False)

    # -- gradients ------------------------------------------------------------------------------
    def reduction(self, inputs: list[torch.Tensor],
                  group: dist.ProcessGroup | None) -> Reduction:
        """The reduce-scatter over ``P`` of the per-segment unsharded gradients ``inputs`` into
        a parameter-chunk-sized buffer; for ``P = ()`` a reduction with no output, which the
        unit does not issue (:meth:`start_rest` takes its inputs). ``group`` is ``None``
        (``set_separate_reduce_scatter_group`` is refused with a ``state_sharding``)."""
        del group
        level = self.mesh.params
        if not self.sharded_params:
            return Reduction(None, inputs, self.reduce_segments, 1, None)
        out = inputs[0].new_empty(self.reduced_numel)
        return Reduction(out, inputs, self.reduce_segments, level.size, level.group)

    @property
    def overlaps(self) -> bool:
        """Whether :meth:`start_rest` leaves a collective in flight (a reduce-scatter over
        ``G \\ P``)."""
        return self.mesh.grads.size > 1

    def start_rest(self, reduction: Reduction,
                   stats: CommStats) -> Callable[[], torch.Tensor]:
        """The gradient sum over the whole data-parallel world of this rank's optimizer chunk,
        in the plan's chunk layout, from the finished reduce-scatter over ``P``
        (:meth:`reduction`), in two halves: issues the reduce-scatter over ``G \\ P``
        asynchronously and returns what finishes it (waits, all-reduces over ``R`` and
        ``O \\ G``, takes the optimizer part). Between the two the unit's backward goes on: the
        reduction across ``G \\ P`` (across nodes, where ``P`` is a node) overlaps the next
        unit's gradients."""
        mesh = self.mesh
        reduced, inputs = reduction.output, reduction.inputs
        if reduced is not None:
            src = [reduced[s.buffer_offset:s.buffer_offset + s.buffer_numel(mesh.grads.size)]
                   for s in self.grads_segments]
        else:
            src = list(inputs)
        if mesh.grads.size == 1 and reduced is not None:
            chunk, work = reduced, None  # G = P: the parameter chunk's layout is the gradient chunk's
        else:
            chunk, work = self._grads_chunk(src, stats)

        def finish() -> torch.Tensor:
            if work is not None:
                work.wait()
            if mesh.reduce.size > 1:
                dist.all_reduce(chunk, group=mesh.reduce.group)
                _count(stats, "all_reduce", mesh.reduce.dims, chunk)
            if mesh.grads_factor == 1:
                return chunk
            return self._optim_part(chunk)

        return finish

    def _grads_chunk(self, src: list[torch.Tensor],
                     stats: CommStats) -> tuple[torch.Tensor, object | None]:
        """The gradient chunk (in the gradient level's layout) from the parameter chunk's
        segments ``src``: reduce-scattered over ``G \\ P`` (its work returned, in flight), or
        laid out as it is (``None``)."""
        level = self.mesh.grads
        out = src[0].new_empty(self.grads_numel)
        if level.size > 1:
            work = reduce_scatter_parts([(out, src, self.grads_segments)], level.size,
                                        group=level.group, async_op=True)
            _count(stats, "reduce_scatter", level.dims, *src)
            return out, work
        for s, x in zip(self.grads_segments, src):
            out[s.chunk_offset:s.chunk_offset + x.numel()].copy_(x)
        return out, None

    def _optim_part(self, chunk: torch.Tensor) -> torch.Tensor:
        """This rank's optimizer chunk (the plan's chunk layout) out of its gradient chunk."""
        z = self.mesh.optim.rank % self.mesh.grads_factor
        out = chunk.new_zeros(self._chunk_numel)
        for s in self.optim_segments:
            lo, hi = s.rank_range(z)
            out[s.chunk_offset:s.chunk_offset + hi - lo].copy_(
                chunk[s.buffer_offset + lo:s.buffer_offset + hi]
            )
        return out


def _count(stats: CommStats, kind: str, dims: tuple[str, ...], *tensors: torch.Tensor) -> None:
    stats.count_dims(kind, dims, sum(t.numel() * t.element_size() for t in tensors))
