"""Where the elements of a parameter live, and the batched exchange that brings pieces to owners.

Every placement the optimizers accept on a 1-D mesh (``RaggedShard`` with any ``dims``,
``Shard(0)``) has one property they build on: the full tensor, flattened, is the concatenation of
the ranks' local tensors in rank order. So a parameter's layout is one ``[start, end)`` range of
flat elements per rank (:class:`Layout`), and any contiguous piece of the full tensor (one matrix
of a stacked 3-D tensor, one row slab of a matrix: an :class:`Item`) is spread over the ranks whose
ranges it overlaps.

:func:`assign_owners` gives every item one owner rank: the rank holding all of it when there is
one (that item never moves), otherwise greedy longest-processing-time over the items' costs.
:class:`Exchange` moves every non-owned piece of every item to its owner with ONE
``all_to_all_single`` (uneven splits), and the owners' results back with one more; it issues none
when no item has a piece off its owner. Plans are pure functions of the layouts and the owners,
identical on every rank, so ranks agree on split sizes without talking.

Plain tensors and ``Replicate`` DTensors are unsharded (``Layout.group is None``): every rank
has the full tensor and computes its items itself.

This batched path handles parameters sharded over one mesh dim: 1-D meshes, and N-D meshes whose
other dims are ``Replicate`` (HSDP), where it runs over the sharded dim's process group.
Parameters sharded over several mesh dims (FSDP x TP) take the per-matrix DTensor-redistribution
path in :mod:`._mesh_nd`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from ragged_placement.placement import RaggedShard

__all__ = [
    "Exchange",
    "Item",
    "Layout",
    "assign_owners",
    "check_grad_placement",
    "layout_of",
    "local_flat",
    "local_tensor",
]


@dataclass(frozen=True)
class Layout:
    """Per-rank ``[start, end)`` ranges of the flattened full tensor, in rank order."""

    shape: tuple[int, ...]
    group: dist.ProcessGroup | None  # None: unsharded (plain tensor or Replicate)
    rank: int
    flat_ranges: tuple[tuple[int, int], ...]

    @property
    def world_size(self) -> int:
        return len(self.flat_ranges)

    @property
    def local_range(self) -> tuple[int, int]:
        return self.flat_ranges[self.rank]


def _whole(shape: tuple[int, ...]) -> Layout:
    return Layout(shape, None, 0, ((0, math.prod(shape)),))


def layout_of(tensor: torch.Tensor) -> Layout:
    """The :class:`Layout` of a plain tensor or a DTensor sharded over at most one mesh dim.

    On an N-D mesh whose other dims are ``Replicate`` (HSDP), the layout is the one over the
    sharded dim's process group: every replica group holds the same ranges. Raises
    ``ValueError`` for placements whose local tensors are not contiguous runs of the flattened
    full tensor (``Shard(d)`` with ``d > 0``, strided shards, partial) and for tensors sharded
    over more than one mesh dim (those go through :mod:`._mesh_nd`).
    """
    shape = tuple(int(s) for s in tensor.shape)
    if not isinstance(tensor, DTensor):
        return _whole(shape)
    sharded = [m for m, pl in enumerate(tensor.placements) if not isinstance(pl, Replicate)]
    if not sharded:
        return _whole(shape)
    if len(sharded) > 1:
        raise ValueError(
            f"layout_of handles tensors sharded over one mesh dim; placements "
            f"{tensor.placements} shard over {len(sharded)} and go through optim._mesh_nd"
        )
    (dim,) = sharded
    placement, mesh = tensor.placements[dim], tensor.device_mesh
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
    return Layout(shape, mesh.get_group(dim), rank, ranges)


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
    """Owner rank of every item (all on one group) and the resulting cost per rank.

    An item held entirely by one rank is owned by it (zero bytes to move). The others go, by
    decreasing cost, to the least-loaded rank (greedy LPT), ties to the rank that holds the most
    of the item, then to the lowest rank.
    """
    if not items:
        return [], []
    world = layouts[items[0].param].world_size
    loads = [0.0] * world
    owners = [-1] * len(items)
    held: list[list[int]] = []
    for k, item in enumerate(items):
        ranges = layouts[item.param].flat_ranges
        if len(ranges) != world:
            raise ValueError("all items of one exchange must live on one process group")
        amounts = [0] * world
        for r, (a, b) in enumerate(ranges):
            ov = _overlap(item.start, item.end, a, b)
            if ov:
                amounts[r] = ov[1] - ov[0]
        held.append(amounts)
        if max(amounts) == item.numel:
            owners[k] = amounts.index(item.numel)
            loads[owners[k]] += item.cost
    rest = sorted((k for k in range(len(items)) if owners[k] < 0), key=lambda k: -items[k].cost)
    for k in rest:
        best = min(range(world), key=lambda r: (loads[r], -held[k][r], r))
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

    Args:
        items: the items, all of parameters on ``group``.
        owners: owner rank of every item (from :func:`assign_owners`).
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
        world = layouts[items[0].param].world_size if items else 1
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
        for k, (item, owner) in enumerate(zip(self.items, self.owners)):
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
