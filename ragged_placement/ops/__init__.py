"""Sharding rules for ops on DTensors that carry a RaggedShard: the one place to look up any op.

:func:`propagate` is consulted (see :mod:`ragged_placement._install`) before torch's own sharding
propagation, for every op whose inputs include a RaggedShard spec (or its 2-D transpose); it
returns the ``OutputSharding`` torch's dispatcher then executes (redistributing inputs where it
says so, running the op on local tensors, wrapping outputs). Output shapes and dtypes come from
torch's own fake-tensor propagation; the rules choose placements and, where the local tensor
differs from the global one (a flattened prefix is one local dim), the local dims and sizes.

Rules here, by tag or name:

* pointwise ops (``torch.Tag.pointwise``, ``masked_fill``), the ``_foreach_*`` family torch's
  optimizers call and their fused kernels (``_fused_adamw_``, ...), ``*_like`` factories,
  casts, ``clone``/``copy_``/``fill_``/``zero_``: run locally. Operands with the lead's shape
  and other placements are redistributed to its placements; an operand constant along the ragged rows (a scalar, or size 1 / absent on the
  prefix dims) is replicated; a row-sharded operand with the same rows broadcasts within rows; a
  pending sum stays pending only through ops linear in it (``add``/``sub`` of equal partials,
  ``mul``/``div`` by a replica, scalings) and is reduced first otherwise; anything else raises.
* reductions ``sum``, ``mean``, ``linalg_vector_norm``, ``_foreach_norm``: reduce locally; every
  sharded mesh dim whose cut dims are all reduced becomes ``Partial`` (sum), a
  :class:`RaggedMeanPartial` (mean: each rank weighted by its share, exact for uneven and empty
  shards) or, for a norm, ``Partial("max")`` / ``Partial("min")`` (``ord=inf`` / ``-inf``),
  ``Partial("sum")`` (``ord=0``, a count) or torch's ``_NormPartial`` (other orders); an empty
  shard's norm is the reduction's identity. Dims that are not reduced keep their placement.
* ``x.new_empty_strided(size, ...)`` and the other ``new_*`` factories (autograd calls them to
  accumulate gradients) keep ``x``'s placements when ``size`` has ``x``'s sizes on the cut dims.
* random ops (:data:`ragged_placement.rng.RANDOM_OPS`) keep the input's placements;
  :mod:`ragged_placement.rng` computes the local values.

Rules in the family modules, one table each (``_RULES`` below maps every op to its rule):

=====================  =========================================================================
module                 ops
=====================  =========================================================================
:mod:`._matrix`        ``mm``, ``addmm``, ``bmm`` (``matmul``, ``linear``); the transposed layout
:mod:`._views`         ``view``/``_unsafe_view``/``reshape``, ``expand``, ``unsqueeze``,
                       ``squeeze``, ``t``/``transpose``/``permute``, ``slice``, ``select``,
                       ``index_select``/``index_add``, ``cat``, ``stack``, ``split``, ``unbind``,
                       ``repeat``, ``slice_backward``, ``select_backward``
:mod:`._nn`            ``_softmax``/``_log_softmax`` (+ backward), ``native_layer_norm``,
                       ``_fused_rms_norm`` (+ backward), ``embedding`` (+ dense backward),
                       ``nll_loss_forward``/``nll_loss_backward``
:mod:`._stats`         ``var``/``std`` (exact, global), ``amax``/``amin``/``max``/``min``,
                       ``argmax``/``argmin``
=====================  =========================================================================

Every other op, and every use of these outside their rules, raises ``NotImplementedError`` naming
the op and the placements: never a silent wrong result.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
from torch.utils._pytree import tree_flatten, tree_map

from ragged_placement._compat import NormPartial
from ragged_placement.ops import _local_ops  # noqa: F401 - registers torch.ops.ragged_placement
from ragged_placement.ops._common import output_specs as _output_specs
from ragged_placement.ops._common import ragged_of, respec, rewrite
from ragged_placement.ops._common import unsupported as _unsupported
from ragged_placement.ops._common import with_meta as _with_meta
from ragged_placement.ops._matrix import MATRIX_RULES, TransposedRaggedShard, transposed_of
from ragged_placement.ops._nn import NN_RULES
from ragged_placement.ops._stats import STATS_RULES
from ragged_placement.ops._views import VIEW_RULES
from ragged_placement.placement import RaggedShard
from ragged_placement.redistribute import has_ragged
from ragged_placement.regions import cut_shape as _apply_cut
from ragged_placement.regions import shard_size_and_offset
from ragged_placement.rng import RANDOM_OPS

aten = torch.ops.aten
ours = torch.ops.ragged_placement

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
    """Whether an op's inputs carry a RaggedShard (or its transpose): the ops :func:`propagate` owns."""
    return any(isinstance(s, DTensorSpec) and any(isinstance(p, (RaggedShard, TransposedRaggedShard))
                                                  for p in s.placements)
               for s in tree_flatten((op_schema.args_schema, op_schema.kwargs_schema))[0])


# Element-wise ops torch does not tag ``pointwise`` (broadcasting operands allowed, as for the rest).
_UNTAGGED_POINTWISE = {
    aten.masked_fill.Scalar, aten.masked_fill_.Scalar, aten.masked_fill.Tensor, aten.masked_fill_.Tensor,
}


# The fused optimizer kernels (``AdamW(fused=True)``): element-wise over lists, as ``_foreach_*``.
_FUSED_OPTIMIZER_OPS = ("aten::_fused_adam_", "aten::_fused_adamw_", "aten::_fused_sgd_",
                        "aten::_fused_adagrad_")


def _is_list_op(op) -> bool:
    """Whether ``op`` takes lists of tensors and works element ``i`` of each list together."""
    return op.name().startswith("aten::_foreach_") or op.name() in _FUSED_OPTIMIZER_OPS


def _is_pointwise(op) -> bool:
    name = op.name()
    if name in _FUSED_OPTIMIZER_OPS:
        return True
    if name.startswith("aten::_foreach_"):
        return name[len("aten::"):].split(".")[0].rstrip("_") not in _NON_POINTWISE_FOREACH
    return torch.Tag.pointwise in op.tags or op in _LIKE_OPS or op in _UNTAGGED_POINTWISE


def _is_scalar(spec: DTensorSpec) -> bool:
    return spec.tensor_meta.shape.numel() == 1


# Ops linear in each tensor operand, so a pending sum stays pending through them.
_ADD_OPS = {aten.add.Tensor, aten.add_.Tensor, aten.sub.Tensor, aten.sub_.Tensor}
_MUL_OPS = {aten.mul.Tensor, aten.mul_.Tensor, aten.div.Tensor, aten.div_.Tensor}
_SCALE_OPS = {
    aten.mul.Scalar, aten.mul_.Scalar, aten.div.Scalar, aten.div_.Scalar, aten.neg.default,
    aten.clone.default, aten.detach.default, aten.alias.default, aten._to_copy.default,
}
_FACTORY_LIKE = {aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default}


def _is_sum_partial(p: Placement) -> bool:
    return type(p) in (Partial, RaggedMeanPartial) and p.reduce_op in ("sum", "avg")


def _operand_target(op_schema, s: DTensorSpec, lead: DTensorSpec, out_shape) -> DTensorSpec | None:
    """The spec operand ``s`` must have for a local op against ``lead`` (None: as it is)."""
    if s is lead or (s.placements == lead.placements and s.shape == lead.shape):
        return None
    ragged = ragged_of(lead)
    k = len(ragged[1].dims) if ragged else 0
    # (the lead's local tensor has ndim - k + 1 dims: a broadcast operand may not have more)
    if _is_scalar(s) and s.ndim <= lead.ndim - max(k - 1, 0):
        return None if all(p.is_replicate() for p in s.placements) else respec(s, [Replicate()] * s.mesh.ndim)
    if s.shape == lead.shape and s.mesh == lead.mesh:
        return respec(s, lead.placements)
    off = lead.ndim - s.ndim
    aligned = {d: (s.shape[d - off] if d >= off else 1) for d in range(lead.ndim)}
    if off >= 0 and s.mesh == lead.mesh and all(aligned[d] == 1 for d in range(k)) and s.ndim <= lead.ndim - k + 1:
        # constant along the ragged rows: replicated, or sharded like the lead on other mesh dims
        target = []
        for p in lead.placements:
            if isinstance(p, Shard) and aligned[p.dim] != 1:
                target.append(Shard(p.dim - off))
            else:
                target.append(Replicate())
        return None if tuple(target) == s.placements else respec(s, target)
    if off == 0 and k and tuple(s.shape[:k]) == tuple(lead.shape[:k]) and s.mesh == lead.mesh:
        # the same rows, broadcast within a row: the lead's layout, replicated on broadcast dims
        target = []
        for j, p in enumerate(lead.placements):
            if isinstance(p, Shard):
                target.append(p if s.shape[p.dim] == lead.shape[p.dim] else Replicate())
            elif p.is_partial() and s.placements[j].is_partial():
                target.append(s.placements[j])
            else:
                target.append(p if isinstance(p, RaggedShard) else Replicate())
        return None if tuple(target) == s.placements else respec(s, target)
    raise _unsupported(
        op_schema, f"operands of shapes {tuple(lead.shape)} with {lead.placements} and "
                   f"{tuple(s.shape)} with {s.placements} do not broadcast under RaggedShard",
    )


def _partial_dims_to_replicate(op, specs: list[DTensorSpec], lead_index: int) -> list[DTensorSpec]:
    """Replace ``Partial`` by ``Replicate`` on every mesh dim where ``op`` is not linear in it."""
    out = list(specs)
    for m in range(specs[0].mesh.ndim):
        pl = [s.placements[m] for s in specs]
        partial = [i for i, p in enumerate(pl) if p.is_partial()]
        if not partial:
            continue
        if all(_is_sum_partial(p) for p in pl) and op in _ADD_OPS and len(set(pl)) == 1:
            continue
        if len(partial) == 1 and _is_sum_partial(pl[partial[0]]) and (
            (op in _MUL_OPS and (op not in (aten.div.Tensor, aten.div_.Tensor) or partial[0] == 0)
             and all(p.is_replicate() for i, p in enumerate(pl) if i != partial[0]))
            or (op in _SCALE_OPS and len(specs) == 1)
        ):
            continue
        for i in partial:
            placements = list(out[i].placements)
            placements[m] = Replicate()
            out[i] = respec(out[i], placements)
    return out


def _pointwise(op_schema: OpSchema, meta) -> OutputSharding:
    args = op_schema.args_schema
    op = op_schema.op
    is_foreach = _is_list_op(op)
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

    def out_shape(i: int):
        m = meta if isinstance(meta, TensorMeta) else (meta[i] if meta else None)
        return tuple(m.shape) if isinstance(m, TensorMeta) else None

    width = max((len(a) for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], DTensorSpec)),
                default=1) if is_foreach else 1
    out_placements: list[tuple[Placement, ...]] = []
    desired: dict[int, DTensorSpec] = {}  # id(spec) -> spec to redistribute to
    leads: list[DTensorSpec] = []
    for i in range(width):
        ops_i = operands(i)
        shape = out_shape(i)
        ragged_ops = [s for s in ops_i if has_ragged(s.placements)]
        lead = ops_i[0] if inplace else next((s for s in ragged_ops if tuple(s.shape) == shape), ragged_ops[0])
        k = len(ragged_of(lead)[1].dims) if ragged_of(lead) else 0
        if shape is not None and (len(shape) != lead.ndim or shape[:k] != tuple(lead.shape[:k])):
            raise _unsupported(op_schema, f"the output shape {shape} changes the ragged rows of {tuple(lead.shape)}")
        targets = [_operand_target(op_schema, s, lead, shape) or s for s in ops_i]
        if op in _FACTORY_LIKE:  # values do not matter: a pending reduction becomes a replica
            placements = tuple(Replicate() if p.is_partial() else p for p in lead.placements)
        else:
            targets = _partial_dims_to_replicate(op, targets, ops_i.index(lead))
            placements = targets[ops_i.index(lead)].placements
            if inplace and placements != lead.placements:
                raise _unsupported(op_schema, f"an in-place op on {lead.placements} that needs a reduction first")
        for s, t in zip(ops_i, targets):
            if t is not s and t.placements != s.placements:
                desired[id(s)] = t
        out_placements.append(placements)
        leads.append(lead)

    out = _output_specs(meta, lambda i: (leads[min(i, len(leads) - 1)], out_placements[min(i, len(leads) - 1)]))
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
            out.append(_norm_partial(ord_))
        else:  # mean: each rank's share of the reduced elements
            n = mesh.size(m)
            level = _level_shape(spec, m, coord)
            if isinstance(p, RaggedShard):
                weights = [u / sum(p.local_units) for u in p.local_units]
            else:
                weights = [shard_size_and_offset(level[p.dim], n, c)[0] / level[p.dim] for c in range(n)]
            out.append(RaggedMeanPartial(weights))
    return out


def _norm_partial(ord_: float) -> Partial:
    """The pending reduction of per-rank ``ord``-norms: the max / min of the shards' norms for
    ``inf`` / ``-inf``, the sum of their nonzero counts for ``0``, else torch's ``_NormPartial``
    (``(sum_c value_c ** ord) ** (1 / ord)``, which excludes those three)."""
    if ord_ == math.inf:
        return Partial("max")
    if ord_ == -math.inf:
        return Partial("min")
    if ord_ == 0:
        return Partial("sum")
    return NormPartial(ord_)


def _may_be_empty(spec: DTensorSpec) -> bool:
    """Whether some rank's local tensor of ``spec`` may be empty (an empty RaggedShard run)."""
    return any(isinstance(p, RaggedShard) and 0 in p.local_units for p in spec.placements)


def _empty_shard_raises(ord_: float) -> bool:
    """Whether torch's norm kernel raises on an empty tensor for ``ord`` (no identity)."""
    return ord_ < 0 or ord_ == math.inf


def _check_inf_norm(op_schema: OpSchema, spec: DTensorSpec, ord_: float, reduced: set[int]) -> None:
    """As torch: a norm without identity over no elements raises (in the rule, on every rank)."""
    if _empty_shard_raises(ord_) and any(spec.shape[d] == 0 for d in reduced):
        raise RuntimeError(f"{op_schema.op}: the {ord_} norm of an empty tensor has no identity")


def _level_shape(spec: DTensorSpec, mesh_dim: int, coord) -> list[int]:
    shape = list(spec.shape)
    for m in range(mesh_dim):
        shape = _apply_cut(shape, spec.placements[m], coord[m], spec.mesh.size(m))
    return shape


def _reduction(op_schema: OpSchema, meta) -> OutputSharding:
    op = op_schema.op
    if op is aten._foreach_norm.Scalar:
        specs, ord_ = op_schema.args_schema[0], (op_schema.args_schema[1] if len(op_schema.args_schema) > 1 else 2)
        for s in specs:
            _check_inf_norm(op_schema, s, ord_, set(range(s.ndim)))
        outs = [_reduce_placements(op_schema, s, set(range(s.ndim)), False, "norm", ord_) for s in specs]
        out = [_with_meta(s, pl, m) for s, pl, m in zip(specs, outs, meta)]
        if _empty_shard_raises(ord_) and any(_may_be_empty(s) for s in specs):
            return rewrite(op_schema, out, op_schema.args_schema, op=ours.foreach_norm.default)
        return OutputSharding(out)
    spec = op_schema.args_schema[0]
    reduced, keepdim = _reduced_dims(op_schema, spec.ndim)
    local_op = None
    if op in _SUM_OPS:
        placements = _reduce_placements(op_schema, spec, reduced, keepdim, "sum")
    elif op in _MEAN_OPS:
        placements = _reduce_placements(op_schema, spec, reduced, keepdim, "mean")
    else:
        args = op_schema.args_schema
        ord_ = args[1] if len(args) > 1 else op_schema.kwargs_schema.get("ord", 2)
        _check_inf_norm(op_schema, spec, ord_, reduced)
        placements = _reduce_placements(op_schema, spec, reduced, keepdim, "norm", ord_)
        if _empty_shard_raises(ord_) and _may_be_empty(spec):
            local_op = ours.vector_norm.default  # an empty shard's norm is the identity
    out = _with_meta(spec, placements, meta)
    ragged = ragged_of(spec)
    if ragged is None or len(ragged[1].dims) == 1 or op in (aten.sum.default, aten.mean.default):
        if local_op is not None:
            return rewrite(op_schema, out, op_schema.args_schema, op=local_op)
        return OutputSharding(out)
    # The local tensor flattens the k > 1 prefix dims into one: pass it the local dims.
    k = len(ragged[1].dims)
    if keepdim and set(range(k)) <= reduced:
        raise _unsupported(op_schema, f"keepdim=True over the {k} dims that {ragged[1]!r} flattens")
    local = sorted({0 if d < k else d - k + 1 for d in reduced})
    at = 2 if op in _NORM_OPS else 1
    defaults = [None, 2, None] if op in _NORM_OPS else [None, None]  # (self, ord, dim) / (self, dim)
    args = list(op_schema.args_schema) + defaults[len(op_schema.args_schema):]
    args[at] = local
    return rewrite(op_schema, out, args, op=local_op)


def _same_cut_dims(spec: DTensorSpec, size: tuple[int, ...]) -> bool:
    """Whether a tensor of ``size`` has the sizes of ``spec`` on every dim its placements cut."""
    if len(size) != spec.ndim:
        return False
    cut = {d for p in spec.placements for d in (range(len(p.dims)) if isinstance(p, RaggedShard)
                                                 else [p.dim] if isinstance(p, Shard) else [])}
    return all(size[d] == spec.shape[d] for d in cut)


def _new_factory(op_schema: OpSchema, meta) -> OutputSharding:
    """``x.new_*(x.shape)`` keeps ``x``'s placements; the local call gets the local size."""
    from ragged_placement.distribute import local_shape

    spec = op_schema.args_schema[0]
    size_idx, stride_idx = _NEW_FACTORIES[op_schema.op]
    size = tuple(op_schema.args_schema[size_idx])
    if size != tuple(spec.shape) and not _same_cut_dims(spec, size):
        raise _unsupported(op_schema, f"a new tensor of shape {size}, whose sharded dims differ from "
                                      f"{tuple(spec.shape)}")
    local = local_shape(size, spec.mesh, spec.placements)
    args = list(op_schema.args_schema)
    args[size_idx] = list(local)
    if stride_idx is not None:
        args[stride_idx] = list(torch.empty(local, device="meta").stride())
    suggestion = OpSchema(op_schema.op, tuple(args), op_schema.kwargs_schema, schema_info=op_schema.schema_info)
    placements = [Replicate() if p.is_partial() else p for p in spec.placements]  # values do not matter
    return OutputSharding(_with_meta(spec, placements, meta), suggestion, needs_redistribute=True,
                          use_val_from_redistribute_schema=True)


def _random(op_schema: OpSchema, meta) -> OutputSharding:
    """Random ops keep the input's placements and run locally; :mod:`ragged_placement.rng`
    draws each rank's region of the single-device result."""
    spec = op_schema.args_schema[0]
    if any(p.is_partial() for p in spec.placements):
        raise _unsupported(op_schema, "random values for Partial data are undefined")
    return OutputSharding(_output_specs(meta, lambda i: (spec, spec.placements)))


# Every op with its own rule, by family (pointwise ops, reductions and ``new_*`` factories are
# recognized by their tags and names above).
_RULES = {**MATRIX_RULES, **VIEW_RULES, **NN_RULES, **STATS_RULES}


def _transposed_pointwise(op_schema: OpSchema, meta) -> OutputSharding:
    """An element-wise op on ``TransposedRaggedShard`` operands that all share one layout."""
    specs = [s for s in tree_flatten((op_schema.args_schema, op_schema.kwargs_schema))[0] if isinstance(s, DTensorSpec)]
    lead = next(s for s in specs if transposed_of(s) is not None)
    if not _is_pointwise(op_schema.op) or op_schema.op in _FACTORY_LIKE or any(
        not (s.placements == lead.placements and s.shape == lead.shape)
        and not (_is_scalar(s) and all(p.is_replicate() for p in s.placements)) for s in specs
    ):
        raise _unsupported(op_schema, "the transpose of a RaggedShard matrix only feeds mm, t and element-wise "
                                      "ops with operands of its layout")
    return OutputSharding(_output_specs(meta, lambda i: (lead, lead.placements)))


def propagate(propagator, op_schema: OpSchema) -> OutputSharding:
    """The ``OutputSharding`` of an op with RaggedShard inputs (see the module docstring)."""
    op = op_schema.op
    meta = propagator._propagate_tensor_meta_non_cached(op_schema)
    if any(transposed_of(s) is not None for s in tree_flatten(op_schema.args_schema)[0]
           if isinstance(s, DTensorSpec)) and op not in (aten.mm.default, aten.t.default, aten.transpose.int):
        return _transposed_pointwise(op_schema, meta)
    if op in RANDOM_OPS:
        return _random(op_schema, meta)
    if op in _RULES:
        return _RULES[op](op_schema, meta)
    if op in _SUM_OPS or op in _MEAN_OPS or op in _NORM_OPS or op is aten._foreach_norm.Scalar:
        return _reduction(op_schema, meta)
    if op in _NEW_FACTORIES:
        return _new_factory(op_schema, meta)
    if _is_pointwise(op):
        return _pointwise(op_schema, meta)
    raise _unsupported(op_schema)
