"""Rules for statistics of RaggedShard tensors: ``var`` / ``std``, ``amax`` / ``amin`` (and the
full ``max`` / ``min``), ``argmax`` / ``argmin``.

Over dims after the prefix they are local and keep the rows. Over the ragged rows:

* ``var`` / ``std`` are global and exact: every rank gathers the per-rank ``(count, sum, M2)``
  and combines them with Chan et al.'s parallel formula (``ragged_placement::global_var``); the
  output is replicated. Never a mean of per-rank variances, and empty runs count for nothing.
* ``amax`` / ``amin`` / ``max`` / ``min`` are ``Partial("max")`` / ``Partial("min")``; an empty run
  contributes the reduction's identity (``-inf`` / ``inf``, or the integer bounds).
* ``argmax`` / ``argmin`` run through torch's own handler, which needs a dim after the prefix; an
  index over the ragged rows raises.

Reducing part of a flattened prefix raises.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding

from ragged_placement.ops import _local_ops  # noqa: F401 - registers torch.ops.ragged_placement
from ragged_placement.ops._common import local_dim, norm_dim, output_specs, ragged_of, rewrite, unsupported
from ragged_placement.ops._views import settle

aten = torch.ops.aten
ours = torch.ops.ragged_placement

__all__ = ["STATS_RULES"]


def _lead(op_schema: OpSchema):
    spec = op_schema.args_schema[0]
    m, p = ragged_of(spec)
    return spec, m, p


def _reduced(spec, dim) -> set[int]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return set(range(spec.ndim))
    return {norm_dim(d, spec.ndim) for d in (dim if isinstance(dim, (list, tuple)) else [dim])}


def _split(op_schema, spec, p, reduced: set[int]) -> bool:
    """Whether the reduction covers the ragged prefix (True) or stays after it (False)."""
    prefix = set(range(len(p.dims)))
    if reduced & prefix and not prefix <= reduced:
        raise unsupported(op_schema, f"reducing part of the dims that {p!r} flattens")
    return prefix <= reduced


def _local_dims(p, reduced: set[int]) -> list[int]:
    k = len(p.dims)
    return sorted({0 if d < k else local_dim(p, d) for d in reduced})


def _var(op_schema: OpSchema, meta) -> OutputSharding:
    spec, m, p = _lead(op_schema)
    dim = op_schema.args_schema[1] if len(op_schema.args_schema) > 1 else None
    reduced = _reduced(spec, dim)
    src = settle(spec, m, linear=False)
    if not _split(op_schema, spec, p, reduced):
        return rewrite(op_schema, output_specs(meta, lambda i: (spec, src.placements)),
                       [src, _local_dims(p, reduced)])
    group = spec.mesh.get_group(m).group_name
    take_sqrt = op_schema.op is aten.std.correction
    out = output_specs(meta, lambda i: (spec, [Replicate()] * spec.mesh.ndim))
    return rewrite(op_schema, out, [src, dim, _local_dims(p, reduced), list(meta.shape), take_sqrt, group],
                   op=ours.global_var.default)


_IS_MAX = {aten.amax.default: True, aten.max.default: True, aten.amin.default: False, aten.min.default: False}


def _extreme(op_schema: OpSchema, meta) -> OutputSharding:
    spec, m, p = _lead(op_schema)
    args = op_schema.args_schema
    dim = args[1] if len(args) > 1 else []
    keepdim = bool(args[2]) if len(args) > 2 else False
    reduced = _reduced(spec, dim)
    src = settle(spec, m, linear=False)
    if not _split(op_schema, spec, p, reduced):
        return rewrite(op_schema, output_specs(meta, lambda i: (spec, src.placements)),
                       [src, _local_dims(p, reduced), keepdim])
    if keepdim and len(p.dims) > 1:
        raise unsupported(op_schema, f"keepdim=True over the {len(p.dims)} dims that {p!r} flattens")
    if any(spec.shape[d] == 0 for d in reduced):  # as torch: an empty max or min has no value
        raise RuntimeError(f"{op_schema.op}: reducing over a zero-size dimension, which has no identity")
    is_max = _IS_MAX[op_schema.op]
    placements = [Partial("max" if is_max else "min") if i == m else q for i, q in enumerate(src.placements)]
    return rewrite(op_schema, output_specs(meta, lambda i: (spec, placements)),
                   [src, _local_dims(p, reduced), keepdim, is_max], op=ours.extreme.default)


def _argmax(op_schema: OpSchema, meta) -> OutputSharding:
    """Consulted by torch's ``argmax`` handler, which runs the op on the local tensor as it is."""
    spec, m, p = _lead(op_schema)
    dim = op_schema.args_schema[1] if len(op_schema.args_schema) > 1 else None
    if dim is None or norm_dim(dim, spec.ndim) < len(p.dims) or len(p.dims) != 1:
        raise unsupported(op_schema, f"an index over the rows that {p!r} shards (pass a later dim, with "
                                     f"RaggedShard((0,), ...))")
    if any(not q.is_replicate() for i, q in enumerate(spec.placements) if i != m):
        raise unsupported(op_schema, "other mesh dims must be replicated")
    return OutputSharding(output_specs(meta, lambda i: (spec, spec.placements)))


STATS_RULES = {
    aten.var.correction: _var,
    aten.std.correction: _var,
    aten.amax.default: _extreme,
    aten.amin.default: _extreme,
    aten.max.default: _extreme,
    aten.min.default: _extreme,
    aten.argmax.default: _argmax,
    aten.argmin.default: _argmax,
}
