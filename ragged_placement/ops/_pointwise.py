"""Rules for element-wise ops on RaggedShard tensors (and on its 2-D transpose).

Pointwise ops (``torch.Tag.pointwise``, ``masked_fill``), the ``_foreach_*`` family torch's
optimizers call and their fused kernels (``_fused_adamw_``, ...), ``*_like`` factories, casts,
``clone``/``copy_``/``fill_``/``zero_`` run locally. Operands with the lead's shape and other
placements are redistributed to its placements; an operand constant along the ragged rows (a
scalar, or size 1 / absent on the prefix dims) is replicated; a row-sharded operand with the same
rows broadcasts within rows; a pending sum stays pending only through ops linear in it
(``add``/``sub`` of equal partials, ``mul``/``div`` by a replica, scalings) and is reduced first
otherwise; anything else raises. On :class:`~ragged_placement.ops._matrix.TransposedRaggedShard`
operands, only element-wise ops whose operands all share one layout (or are replicated scalars)
run.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
from torch.utils._pytree import tree_flatten, tree_map

from ragged_placement.ops._common import output_specs as _output_specs
from ragged_placement.ops._common import ragged_of, respec
from ragged_placement.ops._common import unsupported as _unsupported
from ragged_placement.ops._matrix import transposed_of
from ragged_placement.ops._reductions import RaggedMeanPartial
from ragged_placement.placement import RaggedShard
from ragged_placement.redistribute import has_ragged

aten = torch.ops.aten

__all__ = ["is_pointwise", "pointwise", "transposed_pointwise"]

_LIKE_OPS = {
    aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
    aten.clone.default, aten.detach.default, aten.alias.default, aten._to_copy.default,
    aten.copy_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default,
    aten.lerp_.Scalar, aten.lerp_.Tensor, aten.lerp.Scalar, aten.lerp.Tensor,
}
_NON_POINTWISE_FOREACH = {"_foreach_norm", "_foreach_max"}


# Element-wise ops torch does not tag ``pointwise`` (broadcasting operands allowed, as for the rest).
_UNTAGGED_POINTWISE = {
    aten.masked_fill.Scalar, aten.masked_fill_.Scalar, aten.masked_fill.Tensor, aten.masked_fill_.Tensor,
}


# The fused optimizer kernels (``AdamW(fused=True)``): element-wise over lists, as ``_foreach_*``.
_FUSED_OPTIMIZER_OPS = ("aten::_fused_adam_", "aten::_fused_adamw_", "aten::_fused_sgd_",
                        "aten::_fused_adagrad_")


def _is_list_op(op) -> bool:
    """Whether ``op`` takes lists of tensors and works element ``i`` of each list together."""
    name = op._schema.name  # without the overload: ``_fused_adamw_.tensor_lr`` is a fused kernel
    return name.startswith("aten::_foreach_") or name in _FUSED_OPTIMIZER_OPS


def is_pointwise(op) -> bool:
    name = op._schema.name
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
    """Replace ``Partial`` by ``Replicate`` on every mesh dim where ``op`` is not linear in it.

    Operands on another mesh than the lead's are replicated scalars (torch replicates a plain
    0-dim tensor, e.g. an optimizer's step count, on the first DTensor operand's mesh, which
    for the elements of a fused optimizer op over parameters of several meshes is not theirs):
    ``Replicate`` on every dim of the lead's mesh."""
    out = list(specs)
    mesh = specs[lead_index].mesh
    for m in range(mesh.ndim):
        pl = [s.placements[m] if s.mesh == mesh else Replicate() for s in specs]
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


def pointwise(op_schema: OpSchema, meta) -> OutputSharding:
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
        if not ragged_ops:  # an element of a foreach list whose operands have no RaggedShard
            out_placements.append(_unragged_element(op_schema, i, ops_i))
            leads.append(ops_i[0])
            continue
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


def _unragged_element(op_schema: OpSchema, i: int, specs: list[DTensorSpec]) -> tuple[Placement, ...]:
    """The placements of element ``i`` of a foreach op none of whose operands is RaggedShard
    (e.g. a replicated parameter under ``implicit_replication`` in the optimizer's list next to
    sharded ones): its operands' common placements, when none is a pending reduction."""
    placements = specs[0].placements
    if any(s.placements != placements for s in specs) or any(p.is_partial() for p in placements):
        raise _unsupported(op_schema, f"element {i} of a foreach op has operands on "
                                      f"{[s.placements for s in specs]} (one layout without Partial needed)")
    return placements


def transposed_pointwise(op_schema: OpSchema, meta) -> OutputSharding:
    """An element-wise op on ``TransposedRaggedShard`` operands that all share one layout."""
    specs = [s for s in tree_flatten((op_schema.args_schema, op_schema.kwargs_schema))[0] if isinstance(s, DTensorSpec)]
    lead = next(s for s in specs if transposed_of(s) is not None)
    if not is_pointwise(op_schema.op) or op_schema.op in _FACTORY_LIKE or any(
        not (s.placements == lead.placements and s.shape == lead.shape)
        and not (_is_scalar(s) and all(p.is_replicate() for p in s.placements)) for s in specs
    ):
        raise _unsupported(op_schema, "the transpose of a RaggedShard matrix only feeds mm, t and element-wise "
                                      "ops with operands of its layout")
    return OutputSharding(_output_specs(meta, lambda i: (lead, lead.placements)))
