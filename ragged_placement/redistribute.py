"""Redistribution of DTensors whose current or target placements contain a ``RaggedShard``.

Entry point: :func:`redistribute_local_tensor`, installed in front of torch's function of the
same name (see :mod:`ragged_placement._install`); specs without a RaggedShard never reach it.

The plan works one mesh dimension at a time, as torch does:

1. right to left, any sharded mesh dim whose cut overlaps a tensor dim that an earlier, changing
   mesh dim needs is first gathered to ``Replicate`` (splits on other tensor dims commute and
   stay put);
2. left to right, every mesh dim that differs is transformed directly.

A one-dimension change (the usual case, and every case on a 1-D mesh) is one collective:

=====================  =====================  ==========================================
current                target                 collective
=====================  =====================  ==========================================
RaggedShard / Shard    RaggedShard / Shard    one ``all_to_all_single`` with split sizes
RaggedShard / Shard    Replicate              one ``all_gather_single``, padded
Partial                RaggedShard / Shard    one ``reduce_scatter_single``, padded
Replicate              RaggedShard / Shard    none (local copy of the rank's region)
RaggedShard / Shard    Partial(sum / avg)     none (local, zeros outside the region)
Partial                Replicate              the placement's own all-reduce
Replicate              Partial                the placement's own partition (local)
=====================  =====================  ==========================================

No step materializes a full replica unless the target is ``Replicate``. Pack and unpack use
``as_strided`` views of the regions (see :mod:`ragged_placement.regions`), so the only copies
are into the send buffer and out of the receive buffer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from ragged_placement import _compat
from ragged_placement.placement import RaggedShard
from ragged_placement.regions import (
    Layout,
    box_numel,
    cut_shape,
    intersect,
    involved_dims,
    layout,
)

__all__ = ["redistribute_local_tensor", "validate_placements", "has_ragged"]

# Dtypes the CPU/GPU backends move natively; others travel as bytes (data movement only).
_NATIVE_DTYPES = {
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int8, torch.uint8,
}
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
               "min": dist.ReduceOp.MIN}


def has_ragged(placements: Sequence[Placement]) -> bool:
    return any(isinstance(p, RaggedShard) for p in placements)


def _is_sharded(p: Placement) -> bool:
    return isinstance(p, (RaggedShard, Shard))


def _cut_dims(p: Placement) -> set[int]:
    if isinstance(p, RaggedShard):
        return set(range(len(p.dims)))
    if isinstance(p, Shard):
        return {p.dim}
    return set()


def validate_placements(mesh: DeviceMesh, placements: Sequence[Placement], ndim: int) -> None:
    """Check a placement list that contains a RaggedShard; ``ValueError`` on misuse."""
    if len(placements) != mesh.ndim:
        raise ValueError(
            f"placements has {len(placements)} entries but the mesh has {mesh.ndim} dims: {tuple(placements)}"
        )
    multi = [p for p in placements if isinstance(p, RaggedShard) and len(p.dims) > 1]
    for i, p in enumerate(placements):
        if isinstance(p, RaggedShard):
            p.check_mesh_size(mesh.size(i), mesh_dim=i)
            if len(p.dims) > ndim:
                raise ValueError(f"{p!r} on mesh dim {i} flattens {len(p.dims)} dims of a {ndim}-d tensor")
        elif type(p).__name__ == "_StridedShard":
            raise ValueError(f"_StridedShard on mesh dim {i} cannot be combined with RaggedShard: {tuple(placements)}")
        elif isinstance(p, Shard) and multi:
            raise ValueError(
                f"{multi[0]!r} flattens several tensor dims; combining it with Shard on another mesh "
                f"dim is not supported (use dims=(0,) for composition): {tuple(placements)}"
            )
    if len(multi) > 1 or (multi and sum(_is_sharded(p) for p in placements) > 1):
        raise ValueError(
            f"a RaggedShard over several dims must be the only sharded placement: {tuple(placements)}"
        )


# ---------------------------------------------------------------------------------------------
# shapes
# ---------------------------------------------------------------------------------------------
def _step_shapes(global_shape, placements, mesh: DeviceMesh, coord, i: int, k: int):
    """``(lead, trail)`` for a step on mesh dim ``i`` that involves the leading ``k`` dims:
    ``lead`` are those dims of the level tensor (after the cuts of mesh dims ``< i``), ``trail``
    the remaining dims of the local tensor (after the cuts of every other mesh dim)."""
    level = list(global_shape)
    for m in range(i):
        level = cut_shape(level, placements[m], coord[m], mesh.size(m))
    full = list(level)
    for m in range(i + 1, mesh.ndim):
        full = cut_shape(full, placements[m], coord[m], mesh.size(m))
    return tuple(level[:k]), tuple(full[k:])


# ---------------------------------------------------------------------------------------------
# collectives (data movement in bytes for dtypes the backend lacks)
# ---------------------------------------------------------------------------------------------
def _as_movable(flat: torch.Tensor) -> tuple[torch.Tensor, int]:
    if flat.dtype in _NATIVE_DTYPES:
        return flat, 1
    return flat.view(torch.uint8), flat.element_size()


def _layouts(p: Placement, lead, row: int, n: int) -> list[Layout]:
    return [layout(p, lead, row, r, n) for r in range(n)]


def _exchange(x, p, q, lead, trail, group, me: int, n: int) -> torch.Tensor:
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
    return out_flat.view(_local_shape(q, lead, trail, me, n))


def _gather(x, p, lead, trail, group, me: int, n: int) -> torch.Tensor:
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


def _slice(x, q, lead, trail, me: int, n: int) -> torch.Tensor:
    """``Replicate`` -> sharded ``q``: copy this rank's region (no communication)."""
    row = math.prod(trail)
    dst = layout(q, lead, row, me, n)
    full = layout(Replicate(), lead, row, 0, 1)
    src_flat = x.contiguous().view(-1)
    out = torch.empty(dst.local_numel, dtype=x.dtype, device=x.device)
    for i, b in enumerate(dst.boxes):
        dst.view(out, b, i).copy_(full.view(src_flat, b, 0))
    return out.view(_local_shape(q, lead, trail, me, n))


def _reduce_scatter(x, partial: Partial, q, lead, trail, group, me: int, n: int) -> torch.Tensor:
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
    return out.view(_local_shape(q, lead, trail, me, n))


def _to_partial(x, p, partial: Partial, lead, trail, me: int, n: int) -> torch.Tensor:
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


def _local_shape(q: Placement, lead, trail, me: int, n: int) -> tuple[int, ...]:
    return (*cut_shape(list(lead), q, me, n), *trail)


def _wait(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _transform(x, p, q, mesh: DeviceMesh, i: int, global_shape, placements, coord) -> torch.Tensor:
    """Transform the local tensor from ``p`` to ``q`` on mesh dim ``i``; ``placements`` are the
    current placements of every mesh dim (``placements[i] == p``)."""
    n, me = mesh.size(i), coord[i]
    k = max(involved_dims(p), involved_dims(q))
    lead, trail = _step_shapes(global_shape, placements, mesh, coord, i, k)
    group = mesh.get_group(i)
    if _is_sharded(p) and _is_sharded(q):
        return _exchange(x, p, q, lead, trail, group, me, n)
    if _is_sharded(p) and isinstance(q, Replicate):
        return _gather(x, p, lead, trail, group, me, n)
    if isinstance(p, Replicate) and _is_sharded(q):
        return _slice(x, q, lead, trail, me, n)
    if _is_sharded(p) and isinstance(q, Partial):
        return _to_partial(x, p, q, lead, trail, me, n)
    if isinstance(p, Partial) and _is_sharded(q):
        if type(p) is Partial and p.reduce_op in _REDUCE_OPS:
            return _reduce_scatter(x, p, q, lead, trail, group, me, n)
        # A custom Partial (norms, weighted means) reduces with its own rule first.
        return _slice(_wait(p._reduce_value(x, mesh, i)), q, lead, trail, me, n)
    if isinstance(p, Partial) and isinstance(q, Replicate):
        return _wait(p._reduce_value(x, mesh, i))
    if isinstance(p, Replicate) and isinstance(q, Partial):
        return q._partition_value(x, mesh, i)
    raise ValueError(f"cannot redistribute {p!r} -> {q!r} on mesh dim {i}")


def plan_steps(current: Sequence[Placement], target: Sequence[Placement]) -> list[tuple[int, Placement]]:
    """The ordered ``(mesh_dim, new_placement)`` steps from ``current`` to ``target``."""
    cur = list(current)
    steps: list[tuple[int, Placement]] = []

    def needed_dims(m: int) -> set[int]:
        k = max(involved_dims(cur[m]), involved_dims(target[m]))
        return set(range(k))

    for i in reversed(range(len(cur))):
        if not _is_sharded(cur[i]):
            continue
        if any(cur[m] != target[m] and _cut_dims(cur[i]) & needed_dims(m) for m in range(i)):
            steps.append((i, Replicate()))
            cur[i] = Replicate()
    for i in range(len(cur)):
        if cur[i] != target[i]:
            steps.append((i, target[i]))
            cur[i] = target[i]
    return steps


def redistribute_local_tensor(
    local_tensor: torch.Tensor,
    current_spec: DTensorSpec,
    target_spec: DTensorSpec,
    *,
    async_op: bool = False,
    **_: object,
) -> torch.Tensor:
    """Redistribute ``local_tensor`` from ``current_spec`` to ``target_spec`` (a RaggedShard on
    either side). Synchronous: ``async_op`` is accepted for signature compatibility."""
    mesh = current_spec.mesh
    if mesh != target_spec.mesh:
        raise NotImplementedError("redistribution across different device meshes is not supported")
    if not mesh._is_current_rank_part_of_mesh():
        return local_tensor
    shape = tuple(current_spec.shape)
    validate_placements(mesh, current_spec.placements, len(shape))
    validate_placements(mesh, target_spec.placements, len(shape))
    partials = {p.reduce_op for p in (*current_spec.placements, *target_spec.placements) if isinstance(p, Partial)}
    if len(partials) > 1:
        raise ValueError(f"mixed Partial reduce ops are not supported: {sorted(partials)}")
    coord = mesh.get_coordinate()
    cur = list(current_spec.placements)
    x = local_tensor
    for i, q in plan_steps(cur, target_spec.placements):
        x = _transform(x, cur[i], q, mesh, i, shape, cur, coord)
        cur[i] = q
    return x
