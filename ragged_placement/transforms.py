"""Data movement of one redistribution step on one mesh dimension, for RaggedShard and Shard.

Each function moves a "level" tensor (the tensor one mesh dimension splits: ``lead`` are the
leading dims the step involves, ``trail`` the rest of the local tensor, carried whole) between
two placements of that mesh dimension with at most one collective, addressing the local tensors
through the ``as_strided`` views of :mod:`ragged_placement.regions` (no full replica unless the
target is ``Replicate``). :func:`transform` picks the function for a pair of placements;
:class:`~ragged_placement.placement.RaggedShard`'s transform methods (``_transform_to``,
``_to_replicate_tensor``, ..., torch's ``Shard`` methods of the same names) are its entry points,
defined at the end of this module and attached to the class here, so that ``placement.py``
imports nothing of this module; :mod:`ragged_placement.redistribute` plans the steps.

=====================  =====================  ==========================================
current                target                 function (collective)
=====================  =====================  ==========================================
RaggedShard / Shard    RaggedShard / Shard    :func:`exchange` (one ``all_to_all_single``)
RaggedShard / Shard    Replicate              :func:`gather` (one ``all_gather_single``)
Partial                RaggedShard / Shard    :func:`reduce_scatter` (one ``reduce_scatter_single``)
Replicate              RaggedShard / Shard    :func:`slice_region` (none)
RaggedShard / Shard    Partial(sum / avg)     :func:`to_partial` (none)
=====================  =====================  ==========================================
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from ragged_placement import _compat
from ragged_placement.placement import RaggedShard
from ragged_placement.regions import Layout, box_numel, cut_shape, intersect, involved_dims, layout

__all__ = [
    "exchange", "gather", "is_sharded", "local_shape_of", "native_reduce_op", "reduce_scatter", "slice_region",
    "step_shapes", "to_partial", "transform", "wait",
]

# Dtypes the CPU/GPU backends move natively; others travel as bytes (data movement only).
_NATIVE_DTYPES = {
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int8, torch.uint8,
}
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
               "min": dist.ReduceOp.MIN}


def native_reduce_op(partial: Placement) -> bool:
    """Whether :func:`reduce_scatter` can reduce ``partial`` itself (torch's ``Partial`` with a
    c10d reduce op); custom partials reduce with their own ``_reduce_value`` first."""
    return type(partial) is Partial and partial.reduce_op in _REDUCE_OPS


def _as_movable(flat: torch.Tensor) -> tuple[torch.Tensor, int]:
    if flat.dtype in _NATIVE_DTYPES:
        return flat, 1
    return flat.view(torch.uint8), flat.element_size()


def _layouts(p: Placement, lead, row: int, n: int) -> list[Layout]:
    return [layout(p, lead, row, r, n) for r in range(n)]


def exchange(x, p, q, lead, trail, group, me: int, n: int) -> torch.Tensor:
    """Sharded ``p`` -> sharded ``q`` with one ``all_to_all_single``."""
    row = math.prod(trail)
    src, dst = _layouts(p, lead, row, n), _layouts(q, lead, row, n)
    flat = x.contiguous().view(-1)
    out_flat = torch.empty(dst[me].local_numel, dtype=x.dtype, device=x.device)
    send, in_splits = [], []
    for peer in range(n):
        pieces = [src[me].view(flat, c, i) for i, a in enumerate(src[me].boxes) for b in dst[peer].boxes
                  if (c := intersect(a, b)) is not None]
        in_splits.append(sum(v.numel() for v in pieces))
        send += [v.reshape(-1) for v in pieces]
    recv_boxes, out_splits = [], []
    for peer in range(n):
        boxes = [(c, j) for a in src[peer].boxes for j, b in enumerate(dst[me].boxes)
                 if (c := intersect(a, b)) is not None]
        recv_boxes.append(boxes)
        out_splits.append(sum(box_numel(c) for c, _ in boxes) * row)
    total = sum(box_numel(b) for r in range(n) for b in src[r].boxes) * row
    if total:
        send_buf = torch.cat(send) if send else flat.new_empty(0)
        recv_buf = torch.empty(sum(out_splits), dtype=x.dtype, device=x.device)
        sb, scale = _as_movable(send_buf)
        rb, _ = _as_movable(recv_buf)
        dist.all_to_all_single(rb, sb, [s * scale for s in out_splits], [s * scale for s in in_splits],
                               group=group)
        offset = 0
        for boxes in recv_boxes:
            for c, j in boxes:
                target = dst[me].view(out_flat, c, j)
                target.copy_(recv_buf[offset:offset + target.numel()].view(target.shape))
                offset += target.numel()
    return out_flat.view(local_shape_of(q, lead, trail, me, n))


def gather(x, p, lead, trail, group, me: int, n: int) -> torch.Tensor:
    """Sharded ``p`` -> ``Replicate`` with one padded ``all_gather_single``."""
    row = math.prod(trail)
    src = _layouts(p, lead, row, n)
    pad = max(lay.local_numel for lay in src)
    out = torch.empty(math.prod(lead) * row, dtype=x.dtype, device=x.device)
    if pad:
        send = x.new_zeros(pad) if x.numel() != pad else None
        if send is None:
            send = x.contiguous().view(-1)
        else:
            send[: x.numel()].copy_(x.reshape(-1))
        gathered = torch.empty(n * pad, dtype=x.dtype, device=x.device)
        g, _ = _as_movable(gathered)
        s, _ = _as_movable(send)
        _compat.all_gather_single(g, s, group=group)
        contiguous = isinstance(p, RaggedShard) and p.split_factor == 1  # runs in rank order
        if contiguous and all(lay.local_numel == pad for lay in src):
            return gathered.view(*lead, *trail)  # equal runs: the gathered buffer is the tensor
        if contiguous:
            torch.cat([gathered[r * pad: r * pad + src[r].local_numel] for r in range(n)], out=out)
        else:
            full = _layouts(Replicate(), lead, row, 1)[0]
            for r in range(n):
                seg = gathered[r * pad: r * pad + src[r].local_numel]
                for i, b in enumerate(src[r].boxes):
                    full.view(out, b, 0).copy_(src[r].view(seg, b, i))
    return out.view(*lead, *trail)


def slice_region(x, q, lead, trail, me: int, n: int) -> torch.Tensor:
    """``Replicate`` -> sharded ``q``: copy this rank's region (no communication)."""
    row = math.prod(trail)
    dst = layout(q, lead, row, me, n)
    full = layout(Replicate(), lead, row, 0, 1)
    src_flat = x.contiguous().view(-1)
    out = torch.empty(dst.local_numel, dtype=x.dtype, device=x.device)
    for i, b in enumerate(dst.boxes):
        dst.view(out, b, i).copy_(full.view(src_flat, b, 0))
    return out.view(local_shape_of(q, lead, trail, me, n))


def reduce_scatter(x, partial: Partial, q, lead, trail, group, me: int, n: int) -> torch.Tensor:
    """``Partial`` -> sharded ``q`` with one padded ``reduce_scatter_single``."""
    row = math.prod(trail)
    dst = _layouts(q, lead, row, n)
    full = layout(Replicate(), lead, row, 0, 1)
    pad = max(lay.local_numel for lay in dst)
    out = torch.empty(dst[me].local_numel, dtype=x.dtype, device=x.device)
    if pad:
        src_flat = x.contiguous().view(-1)
        if isinstance(q, RaggedShard) and q.split_factor == 1 and all(lay.local_numel == pad for lay in dst):
            send = src_flat  # equal runs in rank order: the tensor is the send buffer
        else:
            send = x.new_zeros(n * pad)
            for r in range(n):
                seg = send[r * pad: r * pad + dst[r].local_numel]
                for i, b in enumerate(dst[r].boxes):
                    dst[r].view(seg, b, i).copy_(full.view(src_flat, b, 0))
        recv = x.new_empty(pad)
        _compat.reduce_scatter_single(recv, send, op=_REDUCE_OPS[partial.reduce_op], group=group)
        out.copy_(recv[: dst[me].local_numel])
        if partial.reduce_op == "avg":
            out.div_(n)
    return out.view(local_shape_of(q, lead, trail, me, n))


def to_partial(x, p, partial: Partial, lead, trail, me: int, n: int) -> torch.Tensor:
    """Sharded ``p`` -> ``Partial(sum | avg)``: zeros outside this rank's region (local)."""
    if partial.reduce_op not in ("sum", "avg"):
        raise ValueError(f"cannot redistribute {p!r} to {partial!r}: only Partial sum/avg can be formed locally")
    row = math.prod(trail)
    src = layout(p, lead, row, me, n)
    full = layout(Replicate(), lead, row, 0, 1)
    out = x.new_zeros(math.prod(lead) * row)
    flat = x.contiguous().view(-1)
    for i, b in enumerate(src.boxes):
        full.view(out, b, 0).copy_(src.view(flat, b, i))
    if partial.reduce_op == "avg":
        out.mul_(n)
    return out.view(*lead, *trail)


def local_shape_of(q: Placement, lead, trail, me: int, n: int) -> tuple[int, ...]:
    """Shape of rank ``me``'s local tensor of a level tensor ``(*lead, *trail)`` under ``q``."""
    return (*cut_shape(list(lead), q, me, n), *trail)


def wait(t: torch.Tensor) -> torch.Tensor:
    """The value of a possibly asynchronous functional-collective result."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def step_shapes(p: Placement, q: Placement, x: torch.Tensor, logical_shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(lead, trail)`` of a step ``p -> q`` on one mesh dim: ``lead`` the leading dims of the
    level tensor ``logical_shape`` that either placement cuts, ``trail`` the rest of the local
    tensor ``x`` (held whole by this mesh dim; later mesh dims may have cut it)."""
    k = max(involved_dims(p), involved_dims(q))
    lead = tuple(int(s) for s in logical_shape[:k])
    local_lead = k - len(p.dims) + 1 if isinstance(p, RaggedShard) else k
    return lead, tuple(x.shape[local_lead:])


def transform(x: torch.Tensor, p: Placement, q: Placement, mesh, mesh_dim: int, logical_shape) -> torch.Tensor:
    """Move the local tensor ``x`` from ``p`` to ``q`` on ``mesh_dim`` (``Shard`` / ``RaggedShard``
    / ``Replicate`` / ``Partial`` on either side), with at most one collective.

    ``logical_shape`` is the level tensor's shape: the global shape cut by the mesh dims before
    ``mesh_dim``."""
    n, me = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
    lead, trail = step_shapes(p, q, x, logical_shape)
    sharded_p, sharded_q = is_sharded(p), is_sharded(q)
    if sharded_p and sharded_q:
        return exchange(x, p, q, lead, trail, mesh.get_group(mesh_dim), me, n)
    if sharded_p and isinstance(q, Replicate):
        return gather(x, p, lead, trail, mesh.get_group(mesh_dim), me, n)
    if isinstance(p, Replicate) and sharded_q:
        return slice_region(x, q, lead, trail, me, n)
    if sharded_p and isinstance(q, Partial):
        return to_partial(x, p, q, lead, trail, me, n)
    if isinstance(p, Partial) and sharded_q:
        if native_reduce_op(p):
            return reduce_scatter(x, p, q, lead, trail, mesh.get_group(mesh_dim), me, n)
        # A custom Partial (norms, weighted means) reduces with its own rule first.
        return slice_region(wait(p._reduce_value(x, mesh, mesh_dim)), q, lead, trail, me, n)
    if isinstance(p, Partial) and isinstance(q, Replicate):
        return wait(p._reduce_value(x, mesh, mesh_dim))
    if isinstance(p, Replicate) and isinstance(q, Partial):
        return q._partition_value(x, mesh, mesh_dim)
    raise ValueError(f"cannot redistribute {p!r} -> {q!r} on mesh dim {mesh_dim}")


def is_sharded(p: Placement) -> bool:
    """Whether ``p`` cuts the tensor (``Shard`` or ``RaggedShard``)."""
    return isinstance(p, (RaggedShard, Shard))




# -- RaggedShard's transform methods ------------------------------------------------------------
# torch's ``Shard`` methods of the same names, for RaggedShard. Each moves the local tensor of one
# mesh dim with at most one collective; ``current_logical_shape`` is the tensor that mesh dim
# splits (the global shape cut by the mesh dims before it). They are defined here, with the data
# movement, and attached to the class below, so that ``placement.py`` imports none of the DTensor
# core (torch's order: redistribute -> transforms -> regions -> placement).
def _shard_tensor(self: RaggedShard, tensor: torch.Tensor, mesh, mesh_dim: int,
                  src_data_rank: int | None = 0) -> torch.Tensor:
    """This rank's local tensor of ``tensor`` (``distribute_tensor``): group rank
    ``src_data_rank`` sends every rank its run (one ``all_to_all_single``, only it sends);
    with ``None`` each rank cuts its own ``tensor`` (no communication)."""
    n, me = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
    self.check_mesh_size(n, mesh_dim=mesh_dim)
    lead, trail = step_shapes(Replicate(), self, tensor, tensor.shape)
    if src_data_rank is None:
        return slice_region(tensor, self, lead, trail, me, n)
    on_src = RaggedShard._unchecked(self.dims, tuple(int(r == src_data_rank) for r in range(n)))
    return exchange(tensor, on_src, self, lead, trail, mesh.get_group(mesh_dim), me, n)


def _to_replicate_tensor(self: RaggedShard, local_tensor: torch.Tensor, mesh, mesh_dim: int,
                         current_logical_shape) -> torch.Tensor:
    """The full tensor of this mesh dim from every rank's run (one ``all_gather_single``)."""
    return transform(local_tensor, self, Replicate(), mesh, mesh_dim, current_logical_shape)


def _replicate_to_ragged(self: RaggedShard, tensor: torch.Tensor, mesh, mesh_dim: int) -> torch.Tensor:
    """This rank's run of a replicated ``tensor`` (no communication; torch's
    ``Shard._replicate_to_shard``)."""
    return transform(tensor, Replicate(), self, mesh, mesh_dim, tensor.shape)


def _reduce_shard_tensor(self: RaggedShard, tensor: torch.Tensor, mesh, reduce_op,
                         mesh_dim: int) -> torch.Tensor:
    """This rank's run of the reduction of ``tensor`` over the mesh dim (``reduce_op`` a
    ``Partial`` or its op name; one ``reduce_scatter_single`` for torch's reduce ops)."""
    partial = reduce_op if isinstance(reduce_op, Partial) else Partial(reduce_op)
    return transform(tensor, partial, self, mesh, mesh_dim, tensor.shape)


def _transform_to(self: RaggedShard, other: Placement, local_tensor: torch.Tensor, mesh,
                  mesh_dim: int, current_logical_shape) -> torch.Tensor:
    """The local tensor under ``other`` (``RaggedShard`` / ``Shard``: one ``all_to_all_single``
    moving only the rows that change rank; ``Replicate``: one ``all_gather_single``;
    ``Partial(sum | avg)``: local)."""
    return transform(local_tensor, self, other, mesh, mesh_dim, current_logical_shape)


def _transform_from(self: RaggedShard, other: Placement, local_tensor: torch.Tensor, mesh,
                    mesh_dim: int, current_logical_shape) -> torch.Tensor:
    """The local tensor under this placement from ``other`` (``Shard``: one
    ``all_to_all_single``; ``Replicate``: local; ``Partial``: one ``reduce_scatter_single``)."""
    return transform(local_tensor, other, self, mesh, mesh_dim, current_logical_shape)


for _method in (_shard_tensor, _to_replicate_tensor, _replicate_to_ragged, _reduce_shard_tensor,
                _transform_to, _transform_from):
    _method.__qualname__ = f"RaggedShard.{_method.__name__}"
    setattr(RaggedShard, _method.__name__, _method)
del _method
