"""Sharding rules for ops on DTensors that carry a RaggedShard: the one place to look up any op.

:func:`propagate` is consulted (see :mod:`ragged_placement._install`) before torch's own sharding
propagation, for every op whose inputs include a RaggedShard spec (or its 2-D transpose); it
returns the ``OutputSharding`` torch's dispatcher then executes (redistributing inputs where it
says so, running the op on local tensors, wrapping outputs). Output shapes and dtypes come from
torch's own fake-tensor propagation; the rules choose placements and, where the local tensor
differs from the global one (a flattened prefix is one local dim), the local dims and sizes.

Rules here, by tag or name:

* ``x.new_empty_strided(size, ...)`` and the other ``new_*`` factories (autograd calls them to
  accumulate gradients) keep ``x``'s placements when ``size`` has ``x``'s sizes on the cut dims;
  any other ``size`` gives a ``Replicate`` tensor, as torch's rule for its placements.
* random ops (:data:`ragged_placement.rng.RANDOM_OPS`) keep the input's placements;
  :mod:`ragged_placement.rng` computes the local values.

Rules in the family modules (``_RULES`` below maps every op with its own rule; pointwise ops and
reductions are recognized by their tags and names):

=====================  =========================================================================
module                 ops
=====================  =========================================================================
:mod:`._pointwise`     pointwise ops (``torch.Tag.pointwise``, ``masked_fill``), ``_foreach_*``
                       and the fused optimizer kernels, ``*_like``, casts, ``clone``/``copy_``/
                       ``fill_``/``zero_``; element-wise ops on the transposed layout
:mod:`._reductions`    ``sum``, ``mean``, ``linalg_vector_norm``, ``_foreach_norm``
                       (:class:`RaggedMeanPartial`, the pending mean of uneven shards);
                       ``any``/``all`` over every element (``Replicate``, all-reduced in the op:
                       ``if mask.any():`` agrees on every rank, as ``trunc_normal_`` needs)
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

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
from torch.utils._pytree import tree_flatten

from ragged_placement.ops._common import output_specs as _output_specs
from ragged_placement.ops._common import unsupported as _unsupported
from ragged_placement.ops._common import with_meta as _with_meta
from ragged_placement.ops._matrix import MATRIX_RULES, TransposedRaggedShard, transposed_of
from ragged_placement.ops._nn import NN_RULES
from ragged_placement.ops._pointwise import is_pointwise, pointwise, transposed_pointwise
from ragged_placement.ops._reductions import (
    ANY_ALL_RULES,
    REDUCTION_OPS,
    RaggedMeanPartial,
    reduction,
)
from ragged_placement.ops._stats import STATS_RULES
from ragged_placement.ops._views import VIEW_RULES
from ragged_placement.placement import RaggedShard
from ragged_placement.rng import RANDOM_OPS

aten = torch.ops.aten

__all__ = ["propagate", "RaggedMeanPartial", "spec_has_ragged"]

# new_* factories: (index of the size arg, index of the stride arg or None)
_NEW_FACTORIES = {
    aten.new_empty_strided.default: (1, 2), aten.new_empty.default: (1, None),
    aten.new_zeros.default: (1, None), aten.new_ones.default: (1, None), aten.new_full.default: (1, None),
}


def spec_has_ragged(op_schema: OpSchema) -> bool:
    """Whether an op's inputs carry a RaggedShard (or its transpose): the ops :func:`propagate` owns."""
    return any(isinstance(s, DTensorSpec) and any(isinstance(p, (RaggedShard, TransposedRaggedShard))
                                                  for p in s.placements)
               for s in tree_flatten((op_schema.args_schema, op_schema.kwargs_schema))[0])


def _same_cut_dims(spec: DTensorSpec, size: tuple[int, ...]) -> bool:
    """Whether a tensor of ``size`` has the sizes of ``spec`` on every dim its placements cut."""
    if len(size) != spec.ndim:
        return False
    cut = {d for p in spec.placements for d in (range(len(p.dims)) if isinstance(p, RaggedShard)
                                                 else [p.dim] if isinstance(p, Shard) else [])}
    return all(size[d] == spec.shape[d] for d in cut)


def _new_factory(op_schema: OpSchema, meta) -> OutputSharding:
    """``x.new_*(size)``: with ``x``'s sizes on the dims its placements cut, ``x``'s placements
    (the local call gets the local size); with any other size, a ``Replicate`` tensor of
    ``size`` on every rank, as torch's rule for its own placements (e.g. a fused QKV
    initialization's ``w.new_empty(other_shape)``)."""
    from ragged_placement.distribute import local_shape

    spec = op_schema.args_schema[0]
    size_idx, stride_idx = _NEW_FACTORIES[op_schema.op]
    size = tuple(op_schema.args_schema[size_idx])
    if size != tuple(spec.shape) and not _same_cut_dims(spec, size):
        return OutputSharding(_with_meta(spec, [Replicate()] * spec.mesh.ndim, meta))
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
# recognized by their tags and names).
_RULES = {**MATRIX_RULES, **VIEW_RULES, **NN_RULES, **STATS_RULES, **ANY_ALL_RULES}


def propagate(propagator, op_schema: OpSchema) -> OutputSharding:
    """The ``OutputSharding`` of an op with RaggedShard inputs (see the module docstring)."""
    op = op_schema.op
    meta = propagator._propagate_tensor_meta_non_cached(op_schema)
    if any(transposed_of(s) is not None for s in tree_flatten(op_schema.args_schema)[0]
           if isinstance(s, DTensorSpec)) and op not in (aten.mm.default, aten.t.default, aten.transpose.int):
        return transposed_pointwise(op_schema, meta)
    if op in RANDOM_OPS:
        return _random(op_schema, meta)
    if op in _RULES:
        return _RULES[op](op_schema, meta)
    if op in REDUCTION_OPS:
        return reduction(op_schema, meta)
    if op in _NEW_FACTORIES:
        return _new_factory(op_schema, meta)
    if is_pointwise(op):
        return pointwise(op_schema, meta)
    raise _unsupported(op_schema)
