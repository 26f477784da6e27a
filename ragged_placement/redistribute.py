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

No step materializes a full replica unless the target is ``Replicate``. This module plans the
steps and runs each through :func:`ragged_placement.transforms.transform` (as
:meth:`RaggedShard._transform_to` / ``_transform_from`` do); the data movement is in
:mod:`ragged_placement.transforms`, which packs and unpacks through ``as_strided`` views of the
regions (:mod:`ragged_placement.regions`), so the only copies are into the send buffer and out of
the receive buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from ragged_placement import transforms
from ragged_placement.placement import RaggedShard
from ragged_placement.regions import cut_shape, involved_dims

__all__ = ["has_ragged", "plan_steps", "redistribute_local_tensor", "validate_placements"]


def has_ragged(placements: Sequence[Placement]) -> bool:
    """Whether ``placements`` contains a RaggedShard."""
    return any(isinstance(p, RaggedShard) for p in placements)


_is_sharded = transforms.is_sharded


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


def _level_shape(global_shape, placements, mesh: DeviceMesh, coord, i: int) -> list[int]:
    """The shape of the tensor mesh dim ``i`` splits: ``global_shape`` cut by mesh dims ``< i``."""
    level = list(global_shape)
    for m in range(i):
        level = cut_shape(level, placements[m], coord[m], mesh.size(m))
    return level


def _step(x, p: Placement, q: Placement, mesh: DeviceMesh, i: int, logical_shape) -> torch.Tensor:
    """One step on mesh dim ``i``, a RaggedShard on either side or neither (a step between
    torch's placements on a mesh dim of a spec with a RaggedShard elsewhere): the same
    region-based data movement (:func:`ragged_placement.transforms.transform`, which
    ``RaggedShard._transform_to`` / ``_transform_from`` also run)."""
    return transforms.transform(x, p, q, mesh, i, logical_shape)


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
        x = _step(x, cur[i], q, mesh, i, _level_shape(shape, cur, mesh, coord, i))
        cur[i] = q
    return x
