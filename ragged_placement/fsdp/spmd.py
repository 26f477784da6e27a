"""``fully_shard(mesh=spmd_mesh, dp_mesh_dims=...)``: torch FSDP2's full-SPMD-mesh call shape.

With ``dp_mesh_dims`` (torch's :class:`~torch.distributed.fsdp.DataParallelMeshDims`, torch >=
2.13), ``mesh`` is the whole SPMD mesh and every managed parameter is a DTensor on it with
``Replicate()`` on each data-parallel dim, as in FSDP2. The call maps onto this runtime's meshes
(:mod:`ragged_placement.fsdp.mesh`): the ``shard`` dim alone is 1-D FSDP, ``replicate`` then
``shard`` is HSDP, and one remaining (tensor-parallel) dim is the TP mesh of
:mod:`ragged_placement.fsdp.param`, so the sharded parameters are DTensors on
``(replicate, shard, tp)``: FSDP2's placements on the same dims, with ``RaggedShard`` for
``Shard(0)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ragged_placement._compat import DataParallelMeshDims
from ragged_placement.regions import contiguous_stride

__all__ = ["SPMDMesh", "check_dp_mesh_dims", "localize_spmd_params"]


@dataclass(frozen=True)
class SPMDMesh:
    """The full SPMD mesh of a unit sharded with ``dp_mesh_dims`` and which of its dims are
    data parallel. In forward and backward the unit's unsharded parameters are DTensors on it
    with ``Replicate()`` on the data-parallel dims (as FSDP2's), their gradients ``Partial()``
    there until the unit's reduce-scatter (and HSDP all-reduce) averages them."""

    mesh: DeviceMesh
    dp_dims: tuple[int, ...]

    def unsharded_spec(
        self, tp: DTensorSpec | None, shape: torch.Size, dtype: torch.dtype
    ) -> DTensorSpec:
        """The spec on :attr:`mesh` of an unsharded parameter whose spec without the
        data-parallel dims is ``tp`` (``None``: replicated)."""
        rest = iter(tp.placements if tp is not None else ())
        placements = tuple(
            Replicate() if i in self.dp_dims else next(rest, Replicate())
            for i in range(self.mesh.ndim)
        )
        return DTensorSpec(
            self.mesh, placements, TensorMeta(shape, contiguous_stride(shape), dtype)
        )

    def grad_spec(self, spec: DTensorSpec) -> DTensorSpec:
        """The spec of the gradient of an unsharded parameter of spec ``spec``: ``Partial()`` on
        the data-parallel dims, the placement DTensor's backward gives the gradient there, so
        accumulating it needs no collective; as FSDP2, the unit's reduction then averages the
        ranks' local gradients."""
        placements = tuple(
            Partial() if i in self.dp_dims else p for i, p in enumerate(spec.placements)
        )
        return DTensorSpec(self.mesh, placements, spec.tensor_meta)


    def rank_grad(self, grad: torch.Tensor) -> torch.Tensor | None:
        """``grad`` as this rank's contribution: ``Partial()`` on the data-parallel dims where
        it arrives ``Replicate()`` there (``None``: unchanged). A module that runs on its
        parameter's local tensor (``weight.to_local()``, torchtitan's ``Embedding``) gets its
        gradient back from ``to_local``'s backward with the parameter's placements,
        ``Replicate()``, though each rank holds its own batch's gradient; accumulated into the
        ``Partial()`` gradient (:meth:`grad_spec`), DTensor would divide it by the
        data-parallel size. FSDP2 reduces each rank's local gradient whatever its placements:
        so does this runtime."""
        if not isinstance(grad, DTensor) or grad.device_mesh != self.mesh:
            return None
        if not any(isinstance(grad.placements[i], Replicate) for i in self.dp_dims):
            return None
        return DTensor(grad._local_tensor, self.grad_spec(grad._spec), requires_grad=False)


def _one_name(value: object, field: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    names = tuple(value)  # type: ignore[arg-type]
    if len(names) == 1 and isinstance(names[0], str):
        return names[0]
    raise ValueError(
        f"dp_mesh_dims.{field}={value!r}: several mesh dims for one data-parallel role are not "
        f"supported; build the mesh with them as one dim (init_device_mesh over their product)"
    )


def _check_dims(mesh: DeviceMesh, dims: object) -> tuple[str | None, str, list[str]]:
    """``(replicate, shard, other dim names)`` of ``mesh`` named by ``dims``, validated."""
    if DataParallelMeshDims is None:
        raise TypeError(
            f"dp_mesh_dims needs torch >= 2.13 (torch.distributed.fsdp.DataParallelMeshDims), "
            f"got {dims!r}; pass the data-parallel sub-mesh as mesh instead"
        )
    if not isinstance(dims, DataParallelMeshDims):
        raise TypeError(
            f"dp_mesh_dims must be a torch.distributed.fsdp.DataParallelMeshDims, got {dims!r}"
        )
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(f"dp_mesh_dims={dims!r} needs a mesh with mesh_dim_names, got {mesh!r}")
    shard, replicate = _one_name(dims.shard, "shard"), _one_name(dims.replicate, "replicate")
    if shard is None:
        raise ValueError(
            f"dp_mesh_dims={dims!r}: replication without a shard dim (DDP) is not supported "
            f"by this runtime; name a shard dim (of size 1 for pure replication)"
        )
    for name in (replicate, shard):
        if name is not None and name not in names:
            raise ValueError(f"dp_mesh_dims names {name!r}, not a dim of mesh {names}")
    if replicate is not None and names.index(replicate) > names.index(shard):
        raise ValueError(
            f"dp_mesh_dims={dims!r}: the replicate dim must come before the shard dim in the "
            f"mesh, got {names}"
        )
    others = [n for n in names if n not in (replicate, shard)]
    if len(others) > 1:
        raise ValueError(
            f"dp_mesh_dims={dims!r}: mesh {names} has {len(others)} dims that are not data "
            f"parallel; this runtime takes at most one (tensor parallel)"
        )
    return replicate, shard, others


def _local_param(p: nn.Parameter, fqn: str, mesh: DeviceMesh, dp_idx: list[int],
                 other: DeviceMesh | None) -> nn.Parameter:
    """``p`` (a DTensor on the SPMD ``mesh``, Replicate on the DP dims) without those dims."""
    if not isinstance(p, DTensor) or p.device_mesh is not mesh:
        raise ValueError(
            f"with dp_mesh_dims every parameter must be a DTensor on the mesh passed to "
            f"fully_shard (e.g. via distribute_module), got {type(p).__name__} for {fqn!r}"
        )
    if not all(isinstance(p.placements[i], Replicate) for i in dp_idx):
        raise ValueError(
            f"parameter {fqn!r} has placements {p.placements}: expected Replicate() on the "
            f"data-parallel dims {[mesh.mesh_dim_names[i] for i in dp_idx]}"
        )
    if other is None:
        local = p._local_tensor
    else:
        (tp_idx,) = (i for i in range(mesh.ndim) if i not in dp_idx)
        local = DTensor.from_local(
            p._local_tensor, other, [p.placements[tp_idx]], run_check=False,
            shape=p.shape, stride=p.stride(),
        )
    return nn.Parameter(local, requires_grad=p.requires_grad)


def _dp_names(replicate: str | None, shard: str) -> tuple[str, ...]:
    return (shard,) if replicate is None else (replicate, shard)


def check_dp_mesh_dims(mesh: DeviceMesh, dims: object) -> DeviceMesh:
    """Validate ``dp_mesh_dims`` against the SPMD ``mesh``; its data-parallel sub-mesh (1-D
    shard or 2-D ``(replicate, shard)``)."""
    replicate, shard, _ = _check_dims(mesh, dims)
    names = _dp_names(replicate, shard)
    return mesh[names[0]] if len(names) == 1 else mesh[names]


def localize_spmd_params(
    mesh: DeviceMesh, dims: object, modules: Sequence[nn.Module], ignored: set[int],
    is_unit: type,
) -> SPMDMesh:
    """Replace each parameter of ``modules`` (not in ``ignored``, not below an ``is_unit``
    module), a DTensor on the SPMD ``mesh``, by itself without the data-parallel dims (a plain
    tensor, or a DTensor on the tensor-parallel dim); tied parameters stay tied. Every
    parameter is checked before any is replaced. Returns the unit's :class:`SPMDMesh`."""
    replicate, shard, others = _check_dims(mesh, dims)
    dp_idx = [mesh.mesh_dim_names.index(n) for n in _dp_names(replicate, shard)]
    other = mesh[others[0]] if others else None
    found: list[tuple[nn.Module, str, nn.Parameter]] = []
    stack = [(m, "") for m in modules]
    while stack:
        m, prefix = stack.pop()
        found += [(m, prefix + a, p) for a, p in m._parameters.items()
                  if p is not None and id(p) not in ignored]
        stack.extend(  # reversed: parameters are checked in registration order
            (c, f"{prefix}{n}.") for n, c in reversed(m._modules.items())
            if c is not None and not isinstance(c, is_unit)
        )
    new: dict[int, nn.Parameter] = {}
    for _, fqn, p in found:
        if id(p) not in new:
            new[id(p)] = _local_param(p, fqn, mesh, dp_idx, other)
    for m, fqn, p in found:
        m._parameters[fqn.rpartition(".")[2]] = new[id(p)]
    return SPMDMesh(mesh, tuple(dp_idx))
