"""Sharding rules for ops on DTensors that carry a RaggedShard.

:func:`propagate` is consulted (see :mod:`ragged_placement._install`) before torch's own sharding
propagation, for every op whose inputs include a RaggedShard spec; it returns the
``OutputSharding`` torch's dispatcher then executes (redistributing inputs where it says so,
running the op on local tensors, wrapping outputs). Output shapes and dtypes come from torch's
own fake-tensor propagation; the rules here only choose placements:

* pointwise ops (``torch.Tag.pointwise``), the ``_foreach_*`` family torch's optimizers call,
  ``*_like`` factories, casts, ``clone``/``copy_``/``fill_``/``zero_``: run locally when every
  tensor operand has the same placements and shape; a same-shaped operand with other placements
  is redistributed to the RaggedShard operand's placements; a replicated scalar (0-d or one
  element) broadcasts; anything else is an error.
* reductions ``sum``, ``mean``, ``linalg_vector_norm``, ``_foreach_norm``: reduce locally; every
  sharded mesh dim whose cut dims are all reduced becomes ``Partial`` (sum), a
  :class:`RaggedMeanPartial` (mean: each rank weighted by its share, exact for uneven and empty
  shards) or torch's ``_NormPartial``; dims that are not reduced keep their placement.
* ``x.new_empty_strided(x.shape, ...)`` and the other ``new_*`` factories (autograd calls them to
  accumulate gradients) keep ``x``'s placements.
* random ops (:data:`ragged_placement.rng.RANDOM_OPS`) keep the input's placements;
  :mod:`ragged_placement.rng` computes the local values.
* every other op raises ``NotImplementedError`` naming the op and the placements.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
from torch.utils._pytree import tree_flatten, tree_map

from ragged_placement._compat import NormPartial
from ragged_placement.placement import RaggedShard
from ragged_placement.redistribute import has_ragged
from ragged_placement.regions import cut_shape as _apply_cut
from ragged_placement.regions import shard_size_and_offset
from ragged_placement.rng import RANDOM_OPS

aten = torch.ops.aten

__all__ = ["propagate", "RaggedMeanPartial", "spec_has_ragged"]

_LIKE_OPS = {
    aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
    aten.clone.default, aten.detach.default, aten.alias.default, aten._to_copy.default,
    aten.copy_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default,
    aten.lerp_.Scalar, aten.lerp_.Tensor, aten.lerp.Scalar, aten.lerp.Tensor,
}
# new_* factories: (index of the size arg, index of the stride arg or None)
_NEW_FACTORIES = {
    aten.new_empty_strided.default: (1, 2), aten.new_empty.default: (1, None),
    aten.new_zeros.default: (1, None), aten.new_ones.default: (1, None), aten.new_full.default: (1, None),
}
_NON_POINTWISE_FOREACH = {"_foreach_norm", "_foreach_max"}
_SUM_OPS = {aten.sum.default, aten.sum.dim_IntList}
_MEAN_OPS = {aten.mean.default, aten.mean.dim}
_NORM_OPS = {aten.linalg_vector_norm.default}


class RaggedMeanPartial(Partial):
    """A pending mean over unevenly sharded data: rank ``c`` of the mesh dim holds the mean of
    its share, and the global mean is ``sum_c weights[c] * value_c``.

    Ranks with weight 0 (an empty shard, whose local mean is NaN) contribute exactly zero.
    Linear, so sums and scalings of two such partials with equal weights stay exact.
    """

    def __init__(self, weights: Sequence[float]):
        super().__init__("sum")
        object.__setattr__(self, "weights", tuple(float(w) for w in weights))

    def _weighted(self, tensor: torch.Tensor, mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
        w = self.weights[mesh.get_local_rank(mesh_dim)]
        return torch.zeros_like(tensor) if w == 0 else tensor * w

    def _reduce_value(self, tensor, mesh, mesh_dim):
        return funcol.all_reduce(self._weighted(tensor, mesh, mesh_dim), reduceOp="sum", group=(mesh, mesh_dim))

    def _reduce_shard_value(self, tensor, mesh, mesh_dim, shard_spec):
        return super()._reduce_shard_value(self._weighted(tensor, mesh, mesh_dim), mesh, mesh_dim, shard_spec)

    def _partition_value(self, tensor, mesh, mesh_dim):
        return tensor

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RaggedMeanPartial) and self.weights == other.weights

    def __hash__(self) -> int:
        return hash(("RaggedMeanPartial", self.weights))

    def __repr__(self) -> str:
        return f"RaggedMeanPartial(weights={self.weights})"

    __str__ = __repr__


def spec_has_ragged(op_schema: OpSchema) -> bool:
    return any(isinstance(s, DTensorSpec) and has_ragged(s.placements)
               for s in tree_flatten((op_schema.args_schema, op_schema.kwargs_schema))[0])


def _unsupported(op_schema: OpSchema, why: str = "") -> NotImplementedError:
    placements = sorted({str(s.placements) for s in tree_flatten(op_schema.args_schema)[0]
                         if isinstance(s, DTensorSpec)})
    return NotImplementedError(
        f"{op_schema.op} has no RaggedShard rule{': ' + why if why else ''} "
        f"(input placements: {', '.join(placements)}). Redistribute the inputs first, e.g. "
        f"dt.redistribute(mesh, [Replicate()]) or to Shard."
    )


def _is_pointwise(op) -> bool:
    name = op.name()
    if name.startswith("aten::_foreach_"):
        return name[len("aten::"):].split(".")[0].rstrip("_") not in _NON_POINTWISE_FOREACH
    return torch.Tag.pointwise in op.tags or op in _LIKE_OPS


def _with_meta(spec: DTensorSpec, placements, meta: TensorMeta | None) -> DTensorSpec:
    return DTensorSpec(spec.mesh, tuple(placements), tensor_meta=meta)


def _output_specs(meta, lead_for):
    """Map the output TensorMeta structure to specs; ``lead_for(i)`` gives (spec, placements)."""
    if meta is None:
        return None
    if isinstance(meta, TensorMeta):
        spec, placements = lead_for(0)
        return _with_meta(spec, placements, meta)
    out = []
    for i, m in enumerate(meta):
        spec, placements = lead_for(i)
        out.append(None if m is None else _with_meta(spec, placements, m))
    return type(meta)(out) if isinstance(meta, tuple) else out


def _is_scalar_replica(spec: DTensorSpec) -> bool:
    return spec.tensor_meta.shape.numel() == 1 and all(p.is_replicate() for p in spec.placements)


def _pointwise(op_schema: OpSchema, meta) -> OutputSharding:
    args = op_schema.args_schema
    is_foreach = op_schema.op.name().startswith("aten::_foreach_")
    inplace = op_schema.is_inplace_op() or op_schema.is_out_variant_op()

    def operands(i: int) -> list[DTensorSpec]:
        """The tensor operands of element ``i`` (a foreach op's ``i``-th tensor of each list)."""
        out = []
        for a in args:
            if isinstance(a, DTensorSpec):
                out.append(a)
            elif is_foreach and isinstance(a, (list, tuple)) and a and isinstance(a[0], DTensorSpec):
                out.append(a[i])
        for v in op_schema.kwargs_schema.values():
            if isinstance(v, DTensorSpec):
                out.append(v)
        return out

    width = max((len(a) for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], DTensorSpec)),
                default=1) if is_foreach else 1
    leads: list[DTensorSpec] = []
    desired: dict[int, DTensorSpec] = {}  # id(spec) -> spec to redistribute to
    for i in range(width):
        ops_i = operands(i)
        lead = ops_i[0] if inplace else next((s for s in ops_i if has_ragged(s.placements)), ops_i[0])
        for s in ops_i:
            if s is lead or (s.placements == lead.placements and s.shape == lead.shape):
                continue
            if _is_scalar_replica(s) and s.ndim <= lead.ndim:
                continue
            if s.shape == lead.shape and s.mesh == lead.mesh:
                desired[id(s)] = DTensorSpec(s.mesh, lead.placements, tensor_meta=s.tensor_meta)
                continue
            raise _unsupported(
                op_schema, f"operands of shapes {tuple(lead.shape)} with {lead.placements} and "
                           f"{tuple(s.shape)} with {s.placements} do not broadcast under RaggedShard",
            )
        leads.append(lead)

    out = _output_specs(meta, lambda i: (leads[min(i, len(leads) - 1)], leads[min(i, len(leads) - 1)].placements))
    if not desired:
        return OutputSharding(out)
    new_args = tree_map(lambda s: desired.get(id(s), s) if isinstance(s, DTensorSpec) else s, args)
    new_kwargs = tree_map(lambda s: desired.get(id(s), s) if isinstance(s, DTensorSpec) else s,
                          op_schema.kwargs_schema)
    suggestion = OpSchema(op_schema.op, new_args, new_kwargs, schema_info=op_schema.schema_info)
    return OutputSharding(out, suggestion, needs_redistribute=True)


def _reduced_dims(op_schema: OpSchema, ndim: int) -> tuple[set[int], bool]:
    """(reduced dims, keepdim) of a reduction op call."""
    op, args, kwargs = op_schema.op, op_schema.args_schema, op_schema.kwargs_schema
    if op in (aten.sum.default, aten.mean.default):
        return set(range(ndim)), False
    if op in _NORM_OPS:
        dim = args[2] if len(args) > 2 else kwargs.get("dim")
        keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
    else:
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return set(range(ndim)), bool(keepdim)
    dims = [dim] if isinstance(dim, int) else list(dim)
    return {d % max(ndim, 1) for d in dims}, bool(keepdim)


def _reduce_placements(op_schema, spec: DTensorSpec, reduced: set[int], keepdim: bool, kind: str, ord_=2.0):
    """Output placements of a reduction of ``spec`` over ``reduced`` tensor dims."""
    mesh = spec.mesh
    coord = mesh.get_coordinate()
    out: list[Placement] = []
    for m, p in enumerate(spec.placements):
        if isinstance(p, RaggedShard):
            cut = set(range(len(p.dims)))
        elif isinstance(p, Shard):
            cut = {p.dim}
        else:
            if isinstance(p, Partial) and not (kind == "sum" and p.reduce_op == "sum"):
                raise _unsupported(op_schema, f"a {kind} of {p!r} data; redistribute it to Replicate first")
            out.append(p)
            continue
        if not cut & reduced:
            if isinstance(p, Shard) and not keepdim:
                out.append(Shard(p.dim - sum(1 for d in reduced if d < p.dim)))
            else:
                out.append(p)
            continue
        if not cut <= reduced:
            raise _unsupported(op_schema, f"reducing part of the dims that {p!r} flattens")
        if kind == "sum":
            out.append(Partial("sum"))
        elif kind == "norm":
            out.append(NormPartial(ord_))
        else:  # mean: each rank's share of the reduced elements
            n = mesh.size(m)
            level = _level_shape(spec, m, coord)
            if isinstance(p, RaggedShard):
                weights = [u / sum(p.local_units) for u in p.local_units]
            else:
                weights = [shard_size_and_offset(level[p.dim], n, c)[0] / level[p.dim] for c in range(n)]
            out.append(RaggedMeanPartial(weights))
    return out


def _level_shape(spec: DTensorSpec, mesh_dim: int, coord) -> list[int]:
    shape = list(spec.shape)
    for m in range(mesh_dim):
        shape = _apply_cut(shape, spec.placements[m], coord[m], spec.mesh.size(m))
    return shape


def _reduction(op_schema: OpSchema, meta) -> OutputSharding:
    op = op_schema.op
    if op is aten._foreach_norm.Scalar:
        specs, ord_ = op_schema.args_schema[0], (op_schema.args_schema[1] if len(op_schema.args_schema) > 1 else 2)
        outs = [_reduce_placements(op_schema, s, set(range(s.ndim)), False, "norm", ord_) for s in specs]
        return OutputSharding([_with_meta(s, pl, m) for s, pl, m in zip(specs, outs, meta)])
    spec = op_schema.args_schema[0]
    reduced, keepdim = _reduced_dims(op_schema, spec.ndim)
    if op in _SUM_OPS:
        placements = _reduce_placements(op_schema, spec, reduced, keepdim, "sum")
    elif op in _MEAN_OPS:
        placements = _reduce_placements(op_schema, spec, reduced, keepdim, "mean")
    else:
        args = op_schema.args_schema
        ord_ = args[1] if len(args) > 1 else op_schema.kwargs_schema.get("ord", 2)
        if math.isinf(ord_) and any(isinstance(p, RaggedShard) and 0 in p.local_units for p in spec.placements):
            raise _unsupported(op_schema, "an inf-norm over shards that may be empty (it has no identity)")
        placements = _reduce_placements(op_schema, spec, reduced, keepdim, "norm", ord_)
    return OutputSharding(_with_meta(spec, placements, meta))


def _new_factory(op_schema: OpSchema, meta) -> OutputSharding:
    """``x.new_*(x.shape)`` keeps ``x``'s placements; the local call gets the local size."""
    from ragged_placement.distribute import local_shape

    spec = op_schema.args_schema[0]
    size_idx, stride_idx = _NEW_FACTORIES[op_schema.op]
    if tuple(op_schema.args_schema[size_idx]) != tuple(spec.shape):
        raise _unsupported(op_schema, f"a new tensor of another shape than {tuple(spec.shape)}")
    local = local_shape(spec.shape, spec.mesh, spec.placements)
    args = list(op_schema.args_schema)
    args[size_idx] = list(local)
    if stride_idx is not None:
        args[stride_idx] = list(torch.empty(local, device="meta").stride())
    suggestion = OpSchema(op_schema.op, tuple(args), op_schema.kwargs_schema, schema_info=op_schema.schema_info)
    return OutputSharding(_with_meta(spec, spec.placements, meta), suggestion, needs_redistribute=True,
                          use_val_from_redistribute_schema=True)


def _random(op_schema: OpSchema, meta) -> OutputSharding:
    """Random ops keep the input's placements and run locally; :mod:`ragged_placement.rng`
    draws each rank's region of the single-device result."""
    spec = op_schema.args_schema[0]
    if any(p.is_partial() for p in spec.placements):
        raise _unsupported(op_schema, "random values for Partial data are undefined")
    return OutputSharding(_output_specs(meta, lambda i: (spec, spec.placements)))


def propagate(propagator, op_schema: OpSchema) -> OutputSharding:
    """The ``OutputSharding`` of an op with RaggedShard inputs (see the module docstring)."""
    op = op_schema.op
    meta = propagator._propagate_tensor_meta_non_cached(op_schema)
    if op in RANDOM_OPS:
        return _random(op_schema, meta)
    if op in _SUM_OPS or op in _MEAN_OPS or op in _NORM_OPS or op is aten._foreach_norm.Scalar:
        return _reduction(op_schema, meta)
    if op in _NEW_FACTORIES:
        return _new_factory(op_schema, meta)
    if _is_pointwise(op):
        return _pointwise(op_schema, meta)
    if op in (aten.view.default, aten._unsafe_view.default, aten.reshape.default) and \
            tuple(op_schema.args_schema[1]) == tuple(op_schema.args_schema[0].shape):
        return _pointwise(OpSchema(op, op_schema.args_schema[:1], {}), meta)
    raise _unsupported(op_schema)

