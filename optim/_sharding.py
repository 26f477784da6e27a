"""Where the elements of a parameter live, and the batched exchange that brings pieces to owners.

Every placement the optimizers accept on a 1-D mesh (``RaggedShard`` with any ``dims``,
``Shard(0)``) has one property they build on: the full tensor, flattened, is the concatenation of
the ranks' local tensors in rank order. So a parameter's layout is one ``[start, end)`` range of
flat elements per rank (:class:`Layout`), and any contiguous piece of the full tensor (one matrix
of a stacked 3-D tensor, one row slab of a matrix: an :class:`Item`) is spread over the ranks whose
ranges it overlaps.

:func:`assign_owners` gives every item one owner rank: on a 1-D mesh the rank holding all of it
when there is one (that item never moves), otherwise greedy longest-processing-time over the items' costs.
:class:`Exchange` moves every non-owned piece of every item to its owner with ONE
``all_to_all_single`` (uneven splits), and the owners' results back with one more; it issues none
when no item has a piece off its owner. Plans are pure functions of the layouts and the owners,
identical on every rank, so ranks agree on split sizes without talking.

Plain tensors and ``Replicate`` DTensors are unsharded (``Layout.group is None``): every rank
has the full tensor and computes its items itself.

This batched path handles parameters sharded over one mesh dim: 1-D meshes, and N-D meshes whose
other dims are ``Replicate`` (HSDP: ``(replicate, shard)``). There the sharded dim's process
group is a replica row's, and every row holds the full tensor. Each item still has ONE owner in
the whole mesh (an owner slot: a row and a rank of that row's group), so its math runs once in
the world, not once per row: the pieces travel to the owner inside its row (the all-to-all over
the row's group), and the results go back inside the row, then to the other rows with one
all-gather per ``Replicate`` dim (each rank sends its pieces of the results owned in its row,
padded to the largest peer's). Optimizer state that is elementwise (Muon's momentum) stays
replicated over the rows with the parameter; state of the item's math (Shampoo's statistics)
lives on its owner. Parameters sharded over several mesh dims (FSDP x TP) take the per-matrix
DTensor-redistribution path in :mod:`._mesh_nd`.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from ragged_placement._compat import all_gather_single
from ragged_placement.placement import RaggedShard

__all__ = [
    "Exchange",
    "Item",
    "Layout",
    "ReplicaDim",
    "assign_owners",
    "check_grad_placement",
    "layout_of",
    "local_flat",
    "local_tensor",
    "stack_layout",
]


@dataclass(frozen=True)
class ReplicaDim:
    """A ``Replicate`` mesh dim of a sharded parameter: its process group, this rank's
    coordinate on it and its size."""

    group: dist.ProcessGroup
    rank: int
    size: int


@dataclass(frozen=True)
class Layout:
    """Per-rank ``[start, end)`` ranges of the flattened full tensor, in rank order.

    ``replicas``: the ``Replicate`` dims of an N-D mesh, in mesh order. A replica row is one
    coordinate on each of them (row-major); every row holds the full tensor, cut by
    ``flat_ranges`` over ``group``. A 1-D mesh has one row.

    ``offset``: where the flattened tensor of ``shape`` starts in the parameter's (0 but for a
    block of a stack, :func:`stack_layout`), so state kept per piece can be named by its place
    in the whole parameter.
    """

    shape: tuple[int, ...]
    group: dist.ProcessGroup | None  # None: unsharded (plain tensor or Replicate)
    rank: int
    flat_ranges: tuple[tuple[int, int], ...]
    replicas: tuple[ReplicaDim, ...] = ()
    offset: int = 0

    @property
    def world_size(self) -> int:
        return len(self.flat_ranges)

    @property
    def local_range(self) -> tuple[int, int]:
        return self.flat_ranges[self.rank]

    @property
    def exchange_key(self) -> tuple:
        """Layouts with equal keys can share one :class:`Exchange`: the same group and rows."""
        return self.group, self.replicas

    @property
    def rows(self) -> int:
        """The number of replica rows."""
        return math.prod(r.size for r in self.replicas)

    @property
    def row(self) -> int:
        """This rank's replica row."""
        row = 0
        for r in self.replicas:
            row = row * r.size + r.rank
        return row


def _row_coords(row: int, replicas: Sequence[ReplicaDim]) -> tuple[int, ...]:
    """The coordinates on the replica dims of replica row ``row`` (inverse of ``Layout.row``)."""
    coords = []
    for r in reversed(replicas):
        row, c = divmod(row, r.size)
        coords.append(c)
    return tuple(reversed(coords))


def _whole(shape: tuple[int, ...]) -> Layout:
    return Layout(shape, None, 0, ((0, math.prod(shape)),))


def layout_of(tensor: torch.Tensor) -> Layout:
    """The :class:`Layout` of a plain tensor or a DTensor sharded over at most one mesh dim, or
    of a stack of matrices split by whole matrices on all its sharded dims but one
    (:func:`stack_layout`).

    On an N-D mesh whose other dims are ``Replicate`` (HSDP), the layout is the one over the
    sharded dim's process group: every replica group holds the same ranges. Raises
    ``ValueError`` for placements whose local tensors are not contiguous runs of the flattened
    full tensor (``Shard(d)`` with ``d > 0``, strided shards, partial) and for other tensors
    sharded over more than one mesh dim (those go through :mod:`._mesh_nd`).
    """
    if not isinstance(tensor, DTensor):
        return _whole(tuple(int(s) for s in tensor.shape))
    spec = tensor._spec
    with _LAYOUTS_LOCK:
        hit = _LAYOUTS.get(id(spec))
        if (hit is not None and hit[0] is spec and hit[1] is spec.mesh and hit[2] == spec.placements
                and hit[3] == spec.shape):
            _LAYOUTS.move_to_end(id(spec))
            return hit[4]
    layout = _layout_of_dtensor(tensor)
    with _LAYOUTS_LOCK:
        _LAYOUTS[id(spec)] = (spec, spec.mesh, spec.placements, spec.shape, layout)
        while len(_LAYOUTS) > _LAYOUTS_CAPACITY:
            _LAYOUTS.popitem(last=False)
    return layout


# id(spec) -> (spec, its mesh, placements and shape, its Layout): a DTensor's layout is a function
# of its spec's mesh (this thread's rank on it), placements and shape, and a RaggedShard's row
# ranges cost a walk of its units, so a step reads each spec's layout here, not derives it again.
# The spec is held, so that its id stays its own; the hit is checked against its fields, which a
# spec's owner may reassign.
_LAYOUTS: OrderedDict[int, tuple] = OrderedDict()
_LAYOUTS_LOCK = threading.Lock()
_LAYOUTS_CAPACITY = 1 << 16


def _layout_of_dtensor(tensor: DTensor) -> Layout:
    shape = tuple(int(s) for s in tensor.shape)
    sharded = _sharded_mesh_dims(tensor)
    if not sharded:
        return _whole(shape)
    if len(sharded) > 1:
        layout = stack_layout(tensor)
        if layout is None:
            raise ValueError(
                f"layout_of handles tensors sharded over one mesh dim; placements "
                f"{tensor.placements} shard over {len(sharded)} and go through optim._mesh_nd"
            )
        return layout
    (dim,) = sharded
    return _layout_over(tensor, dim, tensor.placements[dim], shape)


def stack_layout(tensor: torch.Tensor) -> Layout | None:
    """The layout of this rank's block of a stack of matrices (a DTensor of >= 3 dims, e.g. the
    ``[E, out, in]`` experts) whose sharded mesh dims are all ``Shard(0)`` by whole matrices
    (expert parallelism: ``E`` divisible by their size) but one, a ``RaggedShard`` applied to
    each block (``split_factor`` the number of blocks; the FSDP x EP composition of
    ``fully_shard``), or ``None`` for another tensor.

    The matrices of a stack are independent, so each block is its own problem over the
    ``RaggedShard`` dim's group: the layout is that of the block (``E / blocks`` matrices), cut
    by the ``RaggedShard``'s units, the ranks of the group sharing the block; the other
    ``Replicate`` dims are its replicas. A matrix held whole by a rank then never moves.
    """
    if not isinstance(tensor, DTensor) or tensor.ndim < 3:
        return None
    placements, mesh = tensor.placements, tensor.device_mesh
    sharded = _sharded_mesh_dims(tensor)
    by_matrix = [m for m in sharded if type(placements[m]) is Shard and placements[m].dim == 0]
    rest = [m for m in sharded if m not in by_matrix]
    blocks = math.prod(mesh.size(m) for m in by_matrix)
    if len(rest) != 1 or not by_matrix or tensor.shape[0] % blocks:
        return None
    (dim,) = rest
    placement = placements[dim]
    if (
        not isinstance(placement, RaggedShard)
        or placement.split_factor != blocks
        or any(m < dim for m in by_matrix)  # the RaggedShard cuts each block: it comes first
    ):
        return None
    shape = (int(tensor.shape[0]) // blocks, *(int(s) for s in tensor.shape[1:]))
    index = 0  # this rank's block: its coordinates on the by-matrix dims, row-major
    for m in by_matrix:
        index = index * mesh.size(m) + mesh.get_local_rank(m)
    layout = _layout_over(tensor, dim, RaggedShard(placement.dims, placement.local_units), shape,
                          replicas_skip=by_matrix)
    return dataclasses.replace(layout, offset=index * math.prod(shape))


def _sharded_mesh_dims(tensor: DTensor) -> list[int]:
    return [m for m, pl in enumerate(tensor.placements) if not isinstance(pl, Replicate)]


def _layout_over(
    tensor: DTensor, dim: int, placement: object, shape: tuple[int, ...],
    replicas_skip: Sequence[int] = (),
) -> Layout:
    """The layout of a ``shape`` tensor cut by ``placement`` over mesh dim ``dim`` of
    ``tensor``'s mesh, the mesh's other dims (but ``replicas_skip``) its replicas."""
    mesh = tensor.device_mesh
    world, rank = mesh.size(dim), mesh.get_local_rank(dim)
    if isinstance(placement, RaggedShard):
        placement.check_mesh_size(world, mesh_dim=dim)
        row_numel = math.prod(placement.row_shape(shape))
        ranges = tuple((a * row_numel, b * row_numel) for a, b in placement.row_ranges(shape))
    elif type(placement) is Shard and placement.dim == 0:
        rows = shape[0]
        row_numel = math.prod(shape[1:])
        chunk = -(-rows // world)  # torch.chunk semantics: ceil-sized chunks, trailing ranks short
        ranges = tuple(
            (min(i * chunk, rows) * row_numel, min((i + 1) * chunk, rows) * row_numel)
            for i in range(world)
        )
    else:
        raise ValueError(
            f"placement {placement!r} is not supported: the optimizers need RaggedShard, Shard(0) "
            f"or Replicate (local tensors that are contiguous runs of the flattened tensor)"
        )
    replicas = tuple(
        ReplicaDim(mesh.get_group(m), mesh.get_local_rank(m), mesh.size(m))
        for m in range(mesh.ndim)
        if m != dim and m not in replicas_skip
    )
    return Layout(shape, mesh.get_group(dim), rank, ranges, replicas)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a DTensor's local tensor, a plain tensor itself."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def local_flat(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's elements of ``tensor`` as a 1-D view (DTensor: its local tensor)."""
    local = local_tensor(tensor)
    if not local.is_contiguous():
        raise ValueError(f"local tensor of shape {tuple(local.shape)} must be contiguous")
    return local.view(-1)


def check_grad_placement(param: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``param.grad`` is laid out like ``param``."""
    grad = param.grad
    p_placements = param.placements if isinstance(param, DTensor) else None
    g_placements = grad.placements if isinstance(grad, DTensor) else None
    if p_placements != g_placements or grad.shape != param.shape:
        raise ValueError(
            "param.grad must have the parameter's shape and placements: parameter "
            f"{tuple(param.shape)} {p_placements}, grad {tuple(grad.shape)} {g_placements}"
        )


@dataclass(frozen=True)
class Item:
    """A contiguous piece ``[start, start + numel)`` of the flattened full tensor ``param``."""

    param: int
    start: int
    shape: tuple[int, ...]
    cost: float

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        return self.start + self.numel


def _overlap(a0: int, a1: int, b0: int, b1: int) -> tuple[int, int] | None:
    lo, hi = max(a0, b0), min(a1, b1)
    return (lo, hi) if lo < hi else None


def assign_owners(
    items: Sequence[Item], layouts: Sequence[Layout]
) -> tuple[list[int], list[float]]:
    """Owner slot of every item (all on one group) and the resulting cost per slot.

    Slot ``row * world_size + r`` is rank ``r`` of the group in replica row ``row`` (see
    :class:`Layout`; on a 1-D mesh, the rank), so every item has one owner in the whole mesh.
    An item held entirely by one rank of a 1-D mesh is owned by it (zero bytes to move). The
    others go, by decreasing cost, to the least-loaded slot (greedy LPT) among the slots that
    hold all of the item when some do (with replicas: that rank in every row), else among all;
    ties to the slot that holds the most of the item, then to the lowest slot.
    """
    if not items:
        return [], []
    first = layouts[items[0].param]
    world, rows = first.world_size, first.rows
    loads = [0.0] * (world * rows)
    owners = [-1] * len(items)
    held: list[list[int]] = []
    candidates: list[list[int]] = []
    for k, item in enumerate(items):
        layout = layouts[item.param]
        if (layout.world_size, layout.rows) != (world, rows):
            raise ValueError("all items of one exchange must live on one process group and mesh")
        amounts = [0] * world
        for r, (a, b) in enumerate(layout.flat_ranges):
            ov = _overlap(item.start, item.end, a, b)
            if ov:
                amounts[r] = ov[1] - ov[0]
        held.append(amounts)
        whole = [r for r in range(world) if amounts[r] == item.numel]
        if whole and rows == 1:
            owners[k] = whole[0]
            loads[owners[k]] += item.cost
        candidates.append([row * world + r for row in range(rows) for r in whole or range(world)])
    rest = sorted((k for k in range(len(items)) if owners[k] < 0), key=lambda k: -items[k].cost)
    for k in rest:
        best = min(candidates[k], key=lambda o: (loads[o], -held[k][o % world], o))
        owners[k] = best
        loads[best] += items[k].cost
    return owners, loads


class _Pending:
    """An in-flight ``all_to_all_single`` (or none) and its receive buffer."""

    def __init__(self, work, recv: torch.Tensor) -> None:
        self.work = work
        self.recv = recv

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.recv


class Exchange:
    """Gather items to their owners and return the owners' results, one all-to-all each way.

    With replica rows (:class:`Layout`), an item travels only inside its owner's row (the
    all-to-alls run over ``group``, which is this rank's row), and :meth:`finish_scatter` then
    copies every result to the other rows: one all-gather per ``Replicate`` mesh dim.

    Args:
        items: the items, all of parameters on ``group``.
        owners: owner slot of every item (from :func:`assign_owners`).
        layouts: layouts indexed by ``Item.param``.
        group: the process group of the layouts.
        rank: this rank in ``group``.
        dtype: the dtype on the wire (every rank must pass the same).
        device: the device of the local tensors.
    """

    def __init__(
        self,
        items: Sequence[Item],
        owners: Sequence[int],
        layouts: Sequence[Layout],
        group: dist.ProcessGroup,
        rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        first = layouts[items[0].param] if items else _whole(())
        world = first.world_size
        self.items = list(items)
        self.owners = list(owners)
        self.layouts = layouts
        self.group = group
        self.rank = rank
        self.world = world
        self.dtype = dtype
        self.device = device
        # Gather direction. send[d]: my pieces of items owned by d; recv[s]: s's pieces of my items.
        # Pieces are (item index, lo, hi) in flat coordinates of the item's parameter.
        self.send: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
        self.recv: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
        self.self_pieces: list[tuple[int, int, int]] = []
        self.traffic = 0  # elements moved per direction, summed over all ranks
        self.owned: list[int] = []
        self.remote_owned: set[int] = set()
        for k, (item, slot) in enumerate(zip(self.items, self.owners)):
            row, owner = divmod(slot, world)
            if row != first.row:  # owned in another replica row: the replica gather brings it
                continue
            if owner == rank:
                self.owned.append(k)
            for r, (a, b) in enumerate(layouts[item.param].flat_ranges):
                ov = _overlap(item.start, item.end, a, b)
                if ov is None:
                    continue
                piece = (k, *ov)
                if r != owner:
                    self.traffic += ov[1] - ov[0]
                    if owner == rank:
                        self.recv[r].append(piece)
                        self.remote_owned.add(k)
                    elif r == rank:
                        self.send[owner].append(piece)
                elif r == rank:
                    self.self_pieces.append(piece)
        self.send_splits = [sum(hi - lo for _, lo, hi in pieces) for pieces in self.send]
        self.recv_splits = [sum(hi - lo for _, lo, hi in pieces) for pieces in self.recv]
        self.replica_steps = self._plan_replica_gather(first)

    def _plan_replica_gather(
        self, first: Layout
    ) -> list[tuple[ReplicaDim, list[list[tuple[int, int, int]]]]]:
        """Per ``Replicate`` dim ``d``, the pieces each peer on ``d`` sends: its pieces of the
        items owned in rows that agree with its own on dims ``d`` and after (what it holds once
        the dims before ``d`` are gathered). Peers on a replica dim are the same rank of
        ``group``, so they hold the same ranges and every rank knows every peer's pieces."""
        mine: dict[int, tuple[int, int]] = {}
        coords: dict[int, tuple[int, ...]] = {}
        for k, item in enumerate(self.items):
            ov = _overlap(item.start, item.end, *self.layouts[item.param].local_range)
            if ov is not None:
                mine[k] = ov
                coords[k] = _row_coords(self.owners[k] // self.world, first.replicas)
        here = tuple(r.rank for r in first.replicas)
        return [
            (
                dim,
                [
                    [(k, *mine[k]) for k in mine if coords[k][d] == v and coords[k][d + 1 :] == here[d + 1 :]]
                    for v in range(dim.size)
                ],
            )
            for d, dim in enumerate(first.replicas)
        ]

    def replica_gather_stats(self) -> tuple[int, int]:
        """Collectives and bytes this rank sends in :meth:`finish_scatter`'s replica gathers."""
        calls = sent = 0
        for dim, pieces in self.replica_steps:
            width = max(sum(hi - lo for _, lo, hi in ps) for ps in pieces)
            if width:
                calls += 1
                sent += width * (dim.size - 1) * self.dtype.itemsize
        return calls, sent

    @property
    def local_owned(self) -> list[int]:
        """Items I own whose every element is already here."""
        return [k for k in self.owned if k not in self.remote_owned]

    def _local_offset(self, k: int, lo: int) -> int:
        return lo - self.layouts[self.items[k].param].local_range[0]

    def _pack(self, chunks: list[torch.Tensor]) -> torch.Tensor:
        """One wire-dtype send buffer of ``chunks`` in order (empty when nothing is sent)."""
        if not chunks:
            return torch.empty(0, dtype=self.dtype, device=self.device)
        return torch.cat(chunks).to(self.dtype)

    def _all_to_all(
        self, send: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> _Pending:
        out = send.new_empty(sum(out_splits))
        if self.traffic == 0:
            return _Pending(None, out)
        work = dist.all_to_all_single(
            out, send, out_splits, in_splits, group=self.group, async_op=True
        )
        return _Pending(work, out)

    def start_gather(self, flats: Sequence[torch.Tensor | None]) -> _Pending:
        """Send my pieces of others' items (``flats[param]``: my local elements, 1-D)."""
        chunks = [
            flats[self.items[k].param][self._local_offset(k, lo) : self._local_offset(k, hi)]
            for pieces in self.send
            for k, lo, hi in pieces
        ]
        return self._all_to_all(self._pack(chunks), self.recv_splits, self.send_splits)

    def assemble(
        self, k: int, flats: Sequence[torch.Tensor | None], recv: torch.Tensor | None
    ) -> torch.Tensor:
        """Item ``k`` (owned here) in full, shaped ``items[k].shape``.

        ``recv`` is the gathered buffer (unused for items in :attr:`local_owned`).
        """
        item = self.items[k]
        flat = flats[item.param]
        if k not in self.remote_owned:
            lo = self._local_offset(k, item.start)
            return flat[lo : lo + item.numel].view(item.shape)
        out = flat.new_empty(item.numel)
        for kk, lo, hi in self.self_pieces:
            if kk == k:
                out[lo - item.start : hi - item.start] = flat[
                    self._local_offset(k, lo) : self._local_offset(k, hi)
                ]
        offset = 0
        for pieces in self.recv:
            for kk, lo, hi in pieces:
                if kk == k:
                    out[lo - item.start : hi - item.start] = recv[offset : offset + hi - lo]
                offset += hi - lo
        return out.view(item.shape)

    def start_scatter(self, results: dict[int, torch.Tensor]) -> _Pending:
        """Send the owners' results (item index -> tensor of the item's numel) back to holders."""
        chunks = []
        for pieces in self.recv:  # exactly the pieces others hold of my items
            for k, lo, hi in pieces:
                start = self.items[k].start
                chunks.append(results[k].reshape(-1)[lo - start : hi - start])
        return self._all_to_all(self._pack(chunks), self.send_splits, self.recv_splits)

    def finish_scatter(
        self,
        pending: _Pending,
        results: dict[int, torch.Tensor],
        outs: Sequence[torch.Tensor | None],
    ) -> None:
        """Write my elements of every item's result into ``outs[param]`` (1-D, local layout).

        Pieces of items owned here are copied from ``results`` first, so call this right after
        :meth:`start_scatter`: those copies overlap the collective.
        """
        for k, lo, hi in self.self_pieces:
            start = self.items[k].start
            a = self._local_offset(k, lo)
            outs[self.items[k].param][a : a + hi - lo] = results[k].reshape(-1)[
                lo - start : hi - start
            ]
        recv = pending.wait()
        offset = 0
        for pieces in self.send:  # the pieces I hold of items owned elsewhere
            for k, lo, hi in pieces:
                a = self._local_offset(k, lo)
                outs[self.items[k].param][a : a + hi - lo] = recv[offset : offset + hi - lo]
                offset += hi - lo
        for dim, pieces in self.replica_steps:
            self._gather_replicas(dim, pieces, outs)

    def _gather_replicas(
        self,
        dim: ReplicaDim,
        pieces: list[list[tuple[int, int, int]]],
        outs: Sequence[torch.Tensor | None],
    ) -> None:
        """One all-gather over ``dim``: peer ``v`` sends ``pieces[v]`` (padded to the largest)."""
        sizes = [sum(hi - lo for _, lo, hi in ps) for ps in pieces]
        width = max(sizes)
        if width == 0:
            return
        send = torch.zeros(width, dtype=self.dtype, device=self.device)
        chunks = [
            outs[self.items[k].param][self._local_offset(k, lo) : self._local_offset(k, hi)]
            for k, lo, hi in pieces[dim.rank]
        ]
        if chunks:
            send[: sizes[dim.rank]] = torch.cat(chunks)
        recv = send.new_empty(width * dim.size)
        all_gather_single(recv, send, group=dim.group)
        for v, peer_pieces in enumerate(pieces):
            offset = v * width
            for k, lo, hi in peer_pieces if v != dim.rank else ():
                a = self._local_offset(k, lo)
                outs[self.items[k].param][a : a + hi - lo] = recv[offset : offset + hi - lo]
                offset += hi - lo
