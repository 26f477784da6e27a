"""One parameter of an FSDP unit: where it is registered, how it is placed, and its policy
(torch FSDP2's ``_fsdp_param.py``).

* :class:`ParamSlot`: every ``(module, attribute)`` that registers the parameter, its planned
  shape and ``requires_grad``.
* :func:`resolve_granularity`: the planner policy of a unit: the user's ``granularity``, then
  the tensor-parallel constraint (:func:`tp_policy`); the buffer's gather adds its own last
  (FP8: :meth:`~ragged_placement.fsdp.fp8.FP8Gathers.granularity`).
* :class:`ParamLayout`: the parameter's RaggedShard on its (TP-local) shape and the specs of its
  sharded and unsharded DTensors.
* :func:`alias` and :func:`rebind`: the unsharded parameter as an alias of the flat buffer's
  storage, and re-pointing a parameter object at new data (moves, casts).
* :func:`forward_tensors`: for each sharded parameter, the unsharded one its forward computes
  with (what torch's pipelining pairs with the autograd graph:
  :mod:`~ragged_placement.fsdp.fsdp2_state`).

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
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard

from ragged_placement._compat import concatenate_meshes
from ragged_placement.fsdp.mesh import UnitMesh
from ragged_placement.placement import RaggedShard
from ragged_placement.planner import Granularity
from ragged_placement.planner.granularity import resolve_policy
from ragged_placement.regions import contiguous_stride

__all__ = [
    "ParamLayout", "ParamSlot", "alias", "check_tp_dims_disjoint", "forward_tensors",
    "mesh_device", "rebind", "record_forward_tensors", "resolve_granularity", "spmd_mesh",
    "tp_policy", "tp_spec_of", "unit_tp_mesh",
]


@dataclass
class ParamSlot:
    """Where one managed parameter lives: every ``(module, attribute)`` that registers it.
    ``shape`` is the planned (for a tensor-parallel DTensor, the TP-local) shape."""

    fqn: str
    owners: list[tuple[nn.Module, str]]
    shape: torch.Size
    requires_grad: bool


def alias(
    storage: torch.UntypedStorage,
    dtype: torch.dtype,
    device: torch.device,
    offset: int,
    shape: torch.Size,
) -> torch.Tensor:
    """A tensor over ``storage`` with its own version counter (a plain view would share the
    buffer's, and the all-gather writing the buffer would invalidate tensors autograd saved)."""
    out = torch.empty(0, dtype=dtype, device=device)
    out.set_(storage, offset, shape, contiguous_stride(shape))
    return out


def resolve_granularity(
    granularity, slots: list[ParamSlot], tp_specs: list[DTensorSpec | None]
):
    """The planner policy of a unit: the user's ``granularity``, then the tensor-parallel
    constraint (never cut a TP-sharded dim). The buffer's gather adds its own after it
    (:meth:`~ragged_placement.fsdp.gather.PlainGather.granularity`).

    ``ValueError`` if the user's policy cuts what the constraint keeps whole."""
    if all(t is None for t in tp_specs):
        return granularity
    return tp_policy(granularity, {s.fqn: t for s, t in zip(slots, tp_specs)})


def tp_spec_of(fqn: str, param: torch.Tensor, dp: UnitMesh) -> DTensorSpec | None:
    """The tensor-parallel spec of ``param`` (``None`` for a plain tensor), validated.

    A DTensor parameter must live on a mesh of the same root as ``dp.source`` (the user's
    data-parallel mesh) that shares no dim with it, placed only by ``Shard`` (dividing its dim
    evenly) and ``Replicate``."""
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
    if mesh.device_type != dp.source.device_type:
        raise ValueError(
            f"parameter {fqn} is on a {mesh.device_type} mesh but mesh is on "
            f"{dp.source.device_type}"
        )
    try:
        concatenate_meshes([dp.source, mesh])
    except (RuntimeError, ValueError) as exc:
        raise ValueError(
            f"mesh {dp.source} and the mesh {mesh} of parameter {fqn} must be disjoint "
            f"sub-meshes of one root mesh ({exc})"
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


def spmd_mesh(dp: UnitMesh, tp_mesh: DeviceMesh | None) -> DeviceMesh:
    """The mesh of a unit's sharded parameters: ``dp.mesh``, then ``tp_mesh``'s dim if any."""
    return dp.mesh if tp_mesh is None else dp.with_tp(tp_mesh)


def rebind(param: nn.Parameter, value: torch.Tensor) -> None:
    """Point ``param`` at ``value``'s data, keeping the parameter object (optimizers hold it).

    Where ``.data`` can be assigned (same tensor type; any device but meta) the parameter also
    keeps its hooks and version counter, a DTensor taking over ``value``'s local tensor and
    spec; to or from the meta device the contents are swapped as ``nn.Module._apply`` does."""
    if torch._has_compatible_shallow_copy_type(param, value):
        param.data = value
        if isinstance(value, DTensor):
            param._local_tensor = value._local_tensor
            param._spec = value._spec
    else:
        torch.utils.swap_tensors(param, nn.Parameter(value, requires_grad=param.requires_grad))


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device of this rank on ``mesh`` (the current CUDA device for a CUDA mesh).

    ``ValueError`` for a device type that is not one to compute on: ``meta`` (initialize the
    model on the meta device instead, with the mesh on the real device), or one without a
    torch device module."""
    kind = mesh.device_type
    if kind == "cpu":
        return torch.device("cpu")
    module = getattr(torch, kind, None)
    if kind == "meta" or not hasattr(module, "current_device"):
        raise ValueError(
            f"fully_shard: mesh is on device type {kind!r}, which holds no data to shard or "
            f"gather; use a mesh on 'cpu' or an accelerator with a torch device module "
            f"('cuda', ...). For meta-device initialization keep the mesh on the real device, "
            f"build the model under torch.device('meta') and call to_empty after fully_shard"
        )
    return torch.device(kind, module.current_device())


def check_tp_dims_disjoint(mesh: DeviceMesh, modules: Sequence[nn.Module]) -> None:
    """``ValueError`` (before any collective) if a tensor-parallel parameter of ``modules``
    (a DTensor not yet sharded by ``fully_shard``) lives on a mesh dim that ``mesh`` has too:
    ``mesh`` must hold the data-parallel dims only."""
    names = set(mesh.mesh_dim_names or ())
    for m in modules:
        for fqn, p in m.named_parameters():
            if not isinstance(p, DTensor) or any(
                isinstance(pl, RaggedShard) for pl in p.placements
            ):
                continue
            shared = [n for n in p.device_mesh.mesh_dim_names or () if n in names]
            if shared:
                dp_dims = tuple(n for n in mesh.mesh_dim_names if n not in shared)
                dp = repr(dp_dims[0]) if len(dp_dims) == 1 else repr(dp_dims)
                fix = (
                    f"Pass the data-parallel dims only: mesh=mesh[{dp}] (a state_sharding over "
                    f"those dims composes with tensor parallel)" if dp_dims else
                    "Pass a mesh of the data-parallel dims (a sibling of the tensor-parallel "
                    "dims in one root mesh)"
                )
                raise ValueError(
                    f"fully_shard(mesh={mesh}): parameter {fqn} is tensor-parallel over mesh "
                    f"dim(s) {shared} of {p.device_mesh}, which mesh has too; a tensor-parallel "
                    f"dim cannot be a data-parallel (sharding) dim. {fix}"
                )




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

    def sharded_spec(self, dp: UnitMesh, dtype: torch.dtype) -> DTensorSpec:
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
            TensorMeta(shape, contiguous_stride(shape), dtype),
        )

    def unsharded_spec(self, dtype: torch.dtype) -> DTensorSpec | None:
        """The TP spec of the unsharded parameter in ``dtype`` (``None``: a plain tensor)."""
        if self.tp_spec is None:
            return None
        shape = self.global_shape
        return DTensorSpec(
            self.tp_spec.mesh,
            tuple(self.tp_spec.placements),
            TensorMeta(shape, contiguous_stride(shape), dtype),
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


# id of each sharded parameter of a flat buffer -> (a weak reference to the buffer, its index
# there). No reference to the parameters themselves: a weak one would block
# torch.utils.swap_tensors (meta-device moves), a strong one keep a unit alive.
_FORWARD_TENSOR: dict[int, tuple[weakref.ref, int]] = {}


def record_forward_tensors(buffer) -> None:
    """Record the parameters of ``buffer`` (a :class:`~ragged_placement.fsdp.buffer.FlatBuffer`,
    when it creates them): each sharded one's forward computes with the unsharded one at the
    same index. The entries go with the buffer."""
    keys = [id(p) for p in buffer.sharded_params]

    def forget(_ref, keys=keys) -> None:
        for k in keys:
            _FORWARD_TENSOR.pop(k, None)

    ref = weakref.ref(buffer, forget)
    for i, k in enumerate(keys):
        _FORWARD_TENSOR[k] = (ref, i)


def forward_tensors(weights: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """``weights`` with each sharded parameter of a ``fully_shard`` unit replaced by the
    unsharded parameter its forward computed with, every other tensor as it is: what
    ``torch.distributed.pipelining``'s ``stage_backward_input`` and ``stage_backward_weight``
    get for ``stage.submod.parameters()`` (see :mod:`ragged_placement.fsdp.fsdp2_state`)."""
    out = []
    for w in weights:
        entry = _FORWARD_TENSOR.get(id(w))
        buffer = entry[0]() if entry is not None else None
        if buffer is not None and buffer.sharded_params[entry[1]] is w:
            out.append(buffer.unsharded_params[entry[1]])
        else:
            out.append(w)
    return out
