"""The meshes of a ``fully_shard`` unit: data parallel (shard, optional replicate) and tensor parallel.

``fully_shard(module, mesh=...)`` takes FSDP2's call shapes:

* a 1-D mesh: FSDP over its only dim;
* a 2-D ``(replicate, shard)`` mesh: HSDP. The unit is all-gathered and reduce-scattered over
  the shard dim; gradients are then all-reduced over the replicate dim.

Parameters may already be DTensors on a tensor-parallel mesh (after ``parallelize_module``) that
is a sibling sub-mesh of the same root mesh. The planner then cuts the TP-local tensor
(``to_local()``), and the sharded parameter is a DTensor on the concatenated ``(dp..., tp)`` mesh:

==================  =================================================================
TP placement        sharded placements (``units`` planned on the TP-local shape)
==================  =================================================================
``Shard(0)``        ``(RaggedShard((0,), units, split_factor=tp), Shard(0))``
``Shard(k)``, k>0   ``(RaggedShard(dims, units), Shard(k))`` with ``len(dims) <= k``
``Replicate()``     ``(RaggedShard(dims, units), Replicate())``
plain parameter     ``(RaggedShard(dims, units), Replicate())`` in a unit that has TP ones
==================  =================================================================

HSDP prepends ``Replicate()`` for the replicate dim. For forward and backward the unsharded
TP-local tensor is wrapped back as a DTensor on the TP mesh with its original placements, so
tensor parallel's module hooks and DTensor ops run unchanged.

With an ``int`` ``reshard_after_forward`` ``N`` a unit keeps, between forward and backward, a
shard of its unsharded parameters over groups of ``N`` consecutive ranks of the shard dim
(:class:`PostForwardMesh`, FSDP2's post-forward mesh), and backward all-gathers within the group.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard

from ragged_placement._compat import concatenate_meshes
from ragged_placement.placement import RaggedShard
from ragged_placement.planner import Granularity
from ragged_placement.planner.granularity import resolve_policy

__all__ = [
    "DataParallelMesh",
    "ParamLayout",
    "PostForwardMesh",
    "spmd_mesh",
    "tp_policy",
    "tp_spec_of",
    "unit_tp_mesh",
]


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    return torch.empty(tuple(shape), device="meta").stride()


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


def tp_spec_of(fqn: str, param: torch.Tensor, dp: DataParallelMesh) -> DTensorSpec | None:
    """The tensor-parallel spec of ``param`` (``None`` for a plain tensor), validated.

    A DTensor parameter must live on a mesh of the same root as ``dp.mesh`` that shares no dim
    with it, placed only by ``Shard`` (dividing its dim evenly) and ``Replicate``."""
    if not isinstance(param, DTensor):
        return None
    spec = param._spec
    mesh = spec.mesh
    for i, p in enumerate(spec.placements):
        if isinstance(p, RaggedShard):
            raise ValueError(
                f"parameter {fqn} has {p!r} on mesh dim {i} ({_dim_name(mesh, i)}) of its mesh "
                f"{mesh}: fully_shard plans RaggedShard only on the dim of its mesh argument"
            )
        if isinstance(p, _StridedShard) or not (type(p) is Shard or isinstance(p, Replicate)):
            raise ValueError(
                f"parameter {fqn} has placement {p!r} on mesh dim {i}: fully_shard composes "
                f"with Shard(d) and Replicate() tensor-parallel placements only"
            )
        if type(p) is Shard:
            size = param.shape[p.dim]
            if size % mesh.size(i):
                raise ValueError(
                    f"parameter {fqn} of shape {tuple(param.shape)} is sharded unevenly on dim "
                    f"{p.dim} ({size} rows over {mesh.size(i)} ranks): fully_shard needs even "
                    f"tensor-parallel shards"
                )
    if mesh.ndim != 1:
        raise ValueError(
            f"parameter {fqn} lives on a {mesh.ndim}-D mesh {mesh}: fully_shard "
            f"composes with a 1-D tensor-parallel mesh"
        )
    if mesh.device_type != dp.mesh.device_type:
        raise ValueError(
            f"parameter {fqn} is on a {mesh.device_type} mesh but mesh is on {dp.mesh.device_type}"
        )
    try:
        concatenate_meshes([dp.mesh, mesh])
    except (RuntimeError, ValueError) as exc:
        raise ValueError(
            f"mesh {dp.mesh} and the mesh {mesh} of parameter {fqn} must be disjoint sub-meshes "
            f"of one root mesh ({exc})"
        ) from None
    return spec


def _dim_name(mesh: DeviceMesh, i: int) -> str:
    names = mesh.mesh_dim_names
    return repr(names[i]) if names else f"dim {i}"


def unit_tp_mesh(fqns: Sequence[str], specs: Sequence[DTensorSpec | None]) -> DeviceMesh | None:
    """The one tensor-parallel mesh of a unit's DTensor parameters (``ValueError`` if several)."""
    mesh, first = None, None
    for fqn, spec in zip(fqns, specs):
        if spec is None:
            continue
        if mesh is None:
            mesh, first = spec.mesh, fqn
        elif spec.mesh != mesh:
            raise ValueError(
                f"parameters {first} and {fqn} of one unit live on different tensor-parallel "
                f"meshes ({mesh} and {spec.mesh})"
            )
    return mesh


def _tp_dim(spec: DTensorSpec | None) -> int | None:
    if spec is None:
        return None
    p = spec.placements[0]
    return p.dim if type(p) is Shard else None


def tp_policy(policy, tp_specs: dict[str, DTensorSpec | None]):
    """``policy`` with the tensor-parallel constraint added: a TP-sharded dim ``k`` of the
    TP-local tensor is never cut through (``keep_dims_whole`` gains ``max(k, 1)``, so a strided
    ``Shard(0)`` composition keeps ``dims=(0,)``)."""

    def resolved(name: str, shape: tuple[int, ...]) -> Granularity:
        gran = resolve_policy(policy, name, shape)
        k = _tp_dim(tp_specs.get(name))
        if k is None or gran.kind in ("matrix", "matrices") or len(shape) < 2:
            return gran
        keep = max(k, 1)
        if keep >= len(shape) or keep in gran.keep_dims_whole:
            return gran
        return replace(gran, keep_dims_whole=(*gran.keep_dims_whole, keep))

    return resolved


def spmd_mesh(dp: DataParallelMesh, tp_mesh: DeviceMesh | None) -> DeviceMesh:
    """The mesh of a unit's sharded parameters: ``dp.mesh``, then ``tp_mesh``'s dim if any."""
    return dp.mesh if tp_mesh is None else concatenate_meshes([dp.mesh, tp_mesh])


@dataclass(frozen=True)
class ParamLayout:
    """How one parameter of a unit is placed.

    Args:
        fqn: the parameter's name in the unit.
        fsdp: the planner's RaggedShard on the TP-local shape (over the shard dim).
        local_shape: the TP-local shape (the planned one).
        tp_spec: the parameter's tensor-parallel spec, ``None`` for a plain parameter.
        tp_mesh: the unit's tensor-parallel mesh (``None`` if the unit has no TP parameter).
        mesh: the unit's :func:`spmd_mesh`, the mesh of the sharded parameter.
    """

    fqn: str
    fsdp: RaggedShard
    local_shape: torch.Size
    tp_spec: DTensorSpec | None
    tp_mesh: DeviceMesh | None
    mesh: DeviceMesh

    @property
    def global_shape(self) -> torch.Size:
        return self.tp_spec.shape if self.tp_spec is not None else self.local_shape

    def check(self, granularity: Granularity) -> None:
        """``ValueError`` unless the planned cut composes with the TP placement."""
        k = _tp_dim(self.tp_spec)
        if k is None:
            return
        if len(self.fsdp.dims) > max(k, 1):
            raise ValueError(
                f"granularity {granularity} of parameter {self.fqn} makes the planner cut "
                f"tensor-parallel-sharded dim {k} ({self.fsdp!r})"
            )
        if k == 0 and granularity.kind in ("rows", "block"):
            band, rows = granularity.band_rows, self.local_shape[0]
            if rows % band:
                raise ValueError(
                    f"granularity {granularity} of parameter {self.fqn}: its {band}-row blocks "
                    f"straddle the tensor-parallel shards ({self.global_shape[0]} rows over "
                    f"{self.tp_spec.mesh.size(0)} ranks = {rows} rows per rank)"
                )

    def sharded_spec(self, dp: DataParallelMesh, dtype: torch.dtype) -> DTensorSpec:
        """The spec of the sharded parameter (and its gradient) on the ``(dp..., tp)`` mesh."""
        fsdp = self.fsdp
        if self.tp_mesh is None:
            tp_placements: tuple[Placement, ...] = ()
        elif self.tp_spec is None:
            tp_placements = (Replicate(),)
        else:
            tp_placements = tuple(self.tp_spec.placements)
            if _tp_dim(self.tp_spec) == 0:
                fsdp = RaggedShard._unchecked(
                    fsdp.dims, fsdp.local_units, self.tp_spec.mesh.size(0)
                )
        shape = self.global_shape
        return DTensorSpec(
            self.mesh,
            (*dp.placements(fsdp), *tp_placements),
            TensorMeta(shape, _contiguous_stride(shape), dtype),
        )

    def unsharded_spec(self, dtype: torch.dtype) -> DTensorSpec | None:
        """The TP spec of the unsharded parameter in ``dtype`` (``None``: a plain tensor)."""
        if self.tp_spec is None:
            return None
        shape = self.global_shape
        return DTensorSpec(
            self.tp_spec.mesh,
            tuple(self.tp_spec.placements),
            TensorMeta(shape, _contiguous_stride(shape), dtype),
        )

    def local_from_full(self, full: torch.Tensor, shard_rank: int) -> torch.Tensor:
        """This rank's sharded local tensor from the full (global) tensor, with no communication."""
        local = full
        if self.tp_spec is not None:
            p = self.tp_spec.placements[0]
            if type(p) is Shard:
                t, n = self.tp_spec.mesh.get_local_rank(0), self.tp_spec.mesh.size(0)
                size = full.shape[p.dim] // n
                local = full.narrow(p.dim, t * size, size)
        if tuple(local.shape) != tuple(self.local_shape):
            raise ValueError(
                f"{self.fqn}: a full tensor of shape {tuple(full.shape)} gives a TP-local shape "
                f"{tuple(local.shape)}, expected {tuple(self.local_shape)}"
            )
        return self.fsdp.shard_local(local.contiguous(), shard_rank)
