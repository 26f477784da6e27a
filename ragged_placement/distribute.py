"""Creating RaggedShard DTensors, and where their local tensors sit in the global tensor.

* :func:`distribute_tensor` is what ``torch.distributed.tensor.distribute_tensor`` runs when a
  placement list contains a RaggedShard.
* :func:`local_chunks` gives the boxes (offset, size) of this rank's local tensor in the global
  tensor: one box for ``dims=(0,)``, up to ``2 * len(dims) - 1`` for a flattened run. Distributed
  checkpoint uses it, so a RaggedShard DTensor saves without any resharding traffic.
* :func:`global_shape_and_stride` infers the global shape for ``DTensor.from_local``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ragged_placement.placement import RaggedShard
from ragged_placement.redistribute import validate_placements
from ragged_placement.regions import cut_shape, flat_range_boxes, shard_size_and_offset

__all__ = [
    "check_local_shape",
    "distribute_tensor",
    "global_shape_and_stride",
    "local_boxes",
    "local_chunks",
    "local_shape",
    "local_shape_and_global_offset",
    "local_tensor_from_full",
]


def local_tensor_from_full(
    tensor: torch.Tensor, device_mesh: DeviceMesh, placements: Sequence[Placement], *, src_data_rank: int | None = None
) -> torch.Tensor:
    """This rank's local tensor of ``tensor`` under ``placements`` (validated, negative ``Shard``
    dims normalized). With ``src_data_rank=None`` every rank holds the same ``tensor`` and no
    data moves; otherwise group rank ``src_data_rank`` sends each rank its region."""
    local = tensor.detach()
    for idx, p in enumerate(placements):
        if isinstance(p, RaggedShard):
            local = p._shard_tensor(local, device_mesh, idx, src_data_rank)
        elif isinstance(p, Shard):
            local = Shard._make_shard_tensor(p.dim, local, device_mesh, idx, src_data_rank)
        elif isinstance(p, Replicate):
            local = Replicate._make_replicate_tensor(local, device_mesh, idx, src_data_rank)
        elif isinstance(p, Partial):
            local = Replicate._make_replicate_tensor(local, device_mesh, idx, src_data_rank)
            local = p._partition_value(local, device_mesh, idx)
        else:
            raise ValueError(f"unsupported placement {p!r} on mesh dim {idx}")
    return local


def _already_distributed(
    tensor: DTensor, device_mesh: DeviceMesh, placements: Sequence[Placement]
) -> DTensor:
    """``tensor`` if it is on ``device_mesh`` with ``placements`` (torch's messages otherwise)."""
    if tensor.device_mesh != device_mesh:
        raise ValueError(
            f"Cannot distribute a DTensor with device mesh {tensor.device_mesh} to a different "
            f"device mesh {device_mesh}."
        )
    if tensor.placements != tuple(placements):
        raise ValueError(
            f"Cannot distribute a DTensor with placements {tensor.placements} to a different "
            f"placements {tuple(placements)}. do you want to call `redistribute` instead?"
        )
    return tensor


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh,
    placements: Sequence[Placement],
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """``distribute_tensor`` for placement lists that contain a RaggedShard.

    Placements apply in mesh-dim order, like torch's. A RaggedShard mesh dim moves only each
    rank's run (one ``all_to_all_single`` from ``src_data_rank``), never a full replica. A
    ``tensor`` that is a DTensor already is returned as is when its mesh and placements are
    these (torch's rule; e.g. ``check_sharded_parity`` of two sharded models), else
    ``ValueError`` (use ``redistribute``).
    """
    if not tensor.is_leaf:
        raise RuntimeError("`distribute_tensor` should be used to distribute leaf tensors! but found non-leaf tensor!")
    if isinstance(tensor, DTensor):
        return _already_distributed(tensor, device_mesh, normalize_placements(placements, tensor.ndim))
    if device_mesh.device_type != tensor.device.type and not tensor.is_meta:
        tensor = tensor.to(device_mesh.device_type)
    placements = normalize_placements(placements, tensor.ndim)
    validate_placements(device_mesh, placements, tensor.ndim)
    local = local_tensor_from_full(tensor, device_mesh, placements, src_data_rank=src_data_rank)
    spec = DTensorSpec(
        mesh=device_mesh,
        placements=tuple(placements),
        tensor_meta=TensorMeta(shape=tensor.size(), stride=tensor.stride(), dtype=tensor.dtype),
    )
    return DTensor(local.requires_grad_(tensor.requires_grad), spec, requires_grad=tensor.requires_grad)


def normalize_placements(placements: Sequence[Placement], ndim: int) -> list[Placement]:
    """``placements`` with negative ``Shard`` dims made non-negative."""
    return [Shard(p.dim + ndim) if isinstance(p, Shard) and p.dim < 0 else p for p in placements]


Chunk = tuple[tuple[int, ...], tuple[int, ...], int]


def local_chunks(global_shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]) -> list[Chunk]:
    """``(offsets, sizes, flat_offset)`` of each box of this rank's local tensor.

    ``flat_offset`` is where the box starts in the flattened local tensor; every box is
    contiguous there. One box for Shard / ``dims=(0,)`` placements; one per run for a strided
    RaggedShard; up to ``2 * len(dims) - 1`` for a flattened prefix. Replicated mesh dims give the
    full extent. A rank that holds nothing gets one empty box.
    """
    return local_boxes(global_shape, tuple(mesh.shape), mesh.get_coordinate(), placements)


def local_boxes(
    global_shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int], placements: Sequence[Placement]
) -> list[Chunk]:
    """:func:`local_chunks` from plain data: the mesh's shape and this rank's coordinate."""
    shape = [int(s) for s in global_shape]
    # dim 0 of the level tensor as segments (global start, length) of global rows
    segments = [(0, shape[0])] if shape else []
    offsets = [0] * len(shape)
    for m, p in enumerate(placements):
        n, c = int(mesh_shape[m]), int(coord[m])
        if isinstance(p, RaggedShard) and len(p.dims) > 1:  # validated: the only sharded placement
            return _flattened_chunks(shape, p, c)
        if isinstance(p, Shard) and p.dim > 0:
            size, off = shard_size_and_offset(shape[p.dim], n, c)
            offsets[p.dim] += off
            shape[p.dim] = size
        elif isinstance(p, (Shard, RaggedShard)):
            rows = sum(length for _, length in segments)
            if isinstance(p, Shard):
                size, off = shard_size_and_offset(rows, n, c)
                wanted = [(off, off + size)]
            else:
                wanted = p.runs([rows, *shape[1:]], c)
            segments = _select_rows(segments, wanted)
    inner = math.prod(shape[1:])
    out, flat = [], 0
    for start, length in segments:
        if length:
            out.append(((start, *offsets[1:]), (length, *shape[1:]), flat))
            flat += length * inner
    if not out:
        out.append((tuple(offsets), (0, *shape[1:]), 0) if shape else ((), (), 0))
    return out


def local_shape_from_plain(
    global_shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int], placements: Sequence[Placement]
) -> tuple[int, ...]:
    """Shape of the local tensor of the rank at ``coord`` (see :func:`local_shape`)."""
    shape = [int(s) for s in global_shape]
    for m, p in enumerate(placements):
        shape = cut_shape(shape, p, int(coord[m]), int(mesh_shape[m]))
    return tuple(shape)


def _merge_adjacent_rows(boxes: list[Chunk]) -> list[Chunk]:
    """Chunks in local order, with each run of boxes that continue one another along dim 0
    (same offset and size in every other dim) merged into one: a strided RaggedShard whose rank
    holds consecutive blocks holds one box."""
    merged: list[Chunk] = []
    for offset, size, flat in boxes:
        offset, size = tuple(offset), tuple(size)
        if merged:
            o, z, f = merged[-1]
            if o[1:] == offset[1:] and z[1:] == size[1:] and o[0] + z[0] == offset[0]:
                merged[-1] = (o, (z[0] + size[0], *z[1:]), f)
                continue
        merged.append((offset, size, flat))
    return merged


def local_shape_and_global_offset(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coord: Sequence[int],
    placements: Sequence[Placement],
    *,
    skip_offset: bool = False,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """torch's ``_compute_local_shape_and_global_offset`` for placements with a RaggedShard.

    Returns the shape of the local tensor of the rank at ``coord`` and, unless ``skip_offset``,
    the global index of its first element, under torch's contract that the local tensor *is*
    the box ``global[offset : offset + shape]``. That holds for ``dims=(0,)`` whenever the rank's
    rows are one run (``split_factor=1``, or a ``(RaggedShard(sf=T), Shard(0))`` pair); an empty
    local tensor gets torch's offset for empty shards (the global size of dim 0). Otherwise the
    local tensor is several boxes (a strided RaggedShard) or a flattened prefix whose local
    tensor has fewer dims than the global one, and there is no single offset:
    ``NotImplementedError`` points to :func:`local_chunks`, which lists every box.
    """
    if len(placements) != len(mesh_shape):
        raise ValueError(f"placements has {len(placements)} entries but the mesh has {len(mesh_shape)} dims")
    for m, p in enumerate(placements):
        if isinstance(p, RaggedShard):
            p.check_mesh_size(int(mesh_shape[m]), mesh_dim=m)
        elif type(p).__name__ == "_StridedShard":
            raise ValueError(f"_StridedShard on mesh dim {m} cannot be combined with RaggedShard: {tuple(placements)}")
    local = local_shape_from_plain(global_shape, mesh_shape, coord, placements)
    if skip_offset:
        return local, ()
    flattened = [p for p in placements if isinstance(p, RaggedShard) and len(p.dims) > 1]
    boxes = _merge_adjacent_rows(
        [b for b in local_boxes(global_shape, mesh_shape, coord, placements) if math.prod(b[1])]
    )
    if flattened or len(boxes) > 1:
        why = (f"{flattened[0]!r} flattens dims {flattened[0].dims}, so the local tensor has fewer dims than "
               f"the global one" if flattened else f"the local tensor is {len(boxes)} boxes of the global tensor")
        raise NotImplementedError(
            f"compute_local_shape_and_global_offset cannot describe this rank's local tensor under "
            f"{tuple(placements)} for shape {tuple(global_shape)} as one (shape, offset): {why}. Use "
            f"ragged_placement.distribute.local_chunks(global_shape, mesh, placements), which lists every box."
        )
    if not boxes:
        offset = list(local_boxes(global_shape, mesh_shape, coord, placements)[0][0])
        if offset and math.prod(global_shape):
            offset[0] = int(global_shape[0])
        return local, tuple(offset)
    return local, tuple(boxes[0][0])


def _select_rows(segments: list[tuple[int, int]], wanted: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The segments of global rows that level rows ``wanted`` (ranges, in order) map to."""
    out = []
    for lo, hi in wanted:
        base = 0
        for start, length in segments:
            a, b = max(lo, base), min(hi, base + length)
            if a < b:
                out.append((start + a - base, b - a))
            base += length
    return out


def _flattened_chunks(shape: list[int], p: RaggedShard, c: int):
    j = len(p.dims)
    start, end = p.local_row_range(shape, c)
    out, flat = [], 0
    for box in flat_range_boxes(shape[:j], start, end):
        sizes = tuple(e - s for s, e in box) + tuple(shape[j:])
        out.append((tuple(s for s, _ in box) + (0,) * (len(shape) - j), sizes, flat))
        flat += math.prod(sizes)
    return out or [((0,) * len(shape), (0, *shape[1:]), 0)]


def global_shape_and_stride(
    local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], *, strict: bool = True
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Infer the global shape of a DTensor from this rank's local tensor, without communication.

    A RaggedShard needs this rank to hold at least one unit (``L = rows * sum / units[rank]``);
    with zero-unit ranks every rank must pass ``shape=`` and ``stride=`` to ``from_local``
    (inferring would need a collective on some ranks only, which could hang). With
    ``strict=False`` an uninferable dim 0 is returned as 0: the row-major stride, which is all
    ``from_local``'s backward asks for, does not depend on it.
    """
    coord = mesh.get_coordinate()
    shape = list(local.shape)
    for m in reversed(range(len(placements))):
        p, n = placements[m], mesh.size(m)
        if isinstance(p, RaggedShard):
            if not strict and (len(p.dims) > 1 or p.local_units[coord[m]] == 0):
                shape = [0, *shape[1:]] if len(p.dims) == 1 else list(local.shape)
                continue
            if strict and 0 in p.local_units:
                raise ValueError(
                    f"DTensor.from_local with {p!r} (zero units on some ranks) needs shape= and stride="
                )
            if len(p.dims) > 1:
                raise ValueError(f"DTensor.from_local with {p!r} (flattened dims) needs shape= and stride=")
            rows = shape[0] * sum(p.local_units)
            if rows % p.local_units[coord[m]]:
                raise ValueError(f"local tensor of shape {tuple(local.shape)} does not match {p!r}")
            shape[0] = rows // p.local_units[coord[m]]
        elif isinstance(p, Shard):
            shape[p.dim] *= n
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(shape), tuple(reversed(stride))


def local_shape(global_shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]) -> tuple[int, ...]:
    """Shape of this rank's local tensor."""
    return local_shape_from_plain(global_shape, tuple(mesh.shape), mesh.get_coordinate(), placements)


def check_local_shape(
    local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int], run_check: bool
) -> None:
    """``DTensor.from_local(..., shape=shape)``: raise if ``local``'s shape is not the one
    ``placements`` give this rank's part of ``shape``, naming the rank and both shapes. With
    ``run_check`` every rank raises (the mesh's ranks exchange their verdicts, as ``run_check``
    permits a collective); without it only the rank whose local shape is wrong."""
    expected = local_shape(shape, mesh, placements)
    ok = tuple(local.shape) == tuple(expected)
    bad = [(dist.get_rank(), tuple(local.shape), expected)] if not ok else []
    if run_check:
        gathered: list[list] = [[] for _ in range(mesh.size())]
        dist.all_gather_object(gathered, bad, group=_flat_group(mesh))
        bad = [b for rank_bad in gathered for b in rank_bad]
    if bad:
        rank, got, want = bad[0]
        raise ValueError(
            f"DTensor.from_local: rank {rank}'s local tensor has shape {got}, but {tuple(placements)} "
            f"gives it shape {want} of the global shape {tuple(shape)}"
        )


def _flat_group(mesh: DeviceMesh):
    """The process group of all of ``mesh``'s ranks."""
    return mesh.get_group() if mesh.ndim == 1 else mesh._flatten().get_group()
