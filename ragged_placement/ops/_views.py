"""Rules for views, indexing and joins of RaggedShard tensors.

A rank holds whole rows of the flattened prefix, so any op that leaves the prefix alone and acts
within rows runs on the local tensor with the dims (and sizes) translated to local ones:
``transpose`` / ``permute`` / ``unsqueeze`` / ``squeeze`` / ``expand`` / slicing / ``select`` /
``index_select`` / ``cat`` / ``stack`` / ``split`` on dims after the prefix, and their backward ops.
``cat`` along the prefix (``parameters_to_vector``) gathers its operands: the result is replicated.

``view`` / ``reshape`` keep row-major element order, and a rank's share of a RaggedShard tensor
is one contiguous range of that order (``split_factor == 1``): its ``[c_i, c_i + u_i) * numel /
sum(units)`` elements whatever the prefix. So a view keeps the same units on the shortest output
prefix whose row count ``sum(units)`` divides, and the local op is a local view. With
``split_factor > 1`` the output prefix must be one dim divisible by ``split_factor * sum(units)``.

The 2-D transpose ``t()`` of ``RaggedShard((0,))`` holds uneven runs of columns: that is
:class:`~ragged_placement.ops._matrix.TransposedRaggedShard`, which ``mm`` contracts (autograd's
weight gradient of ``linear``).

Other mesh dims must be ``Replicate`` (or a pending sum, for linear ops); other placements there
are redistributed to ``Replicate`` first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed.tensor import Placement, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding

from ragged_placement.ops._common import (
    local_dim,
    norm_dim,
    output_specs,
    ragged_of,
    replicated,
    respec,
    rewrite,
    unsupported,
    with_meta,
)
from ragged_placement.ops._matrix import TransposedRaggedShard, transposed_of
from ragged_placement.placement import RaggedShard

aten = torch.ops.aten

__all__ = ["VIEW_RULES"]


def settle(spec: DTensorSpec, mesh_dim: int, linear: bool = True) -> DTensorSpec:
    """``spec`` with every mesh dim but ``mesh_dim`` replicated (a pending sum stays for a linear
    op): the input layout the rules here run on."""
    keep: dict[int, Placement] = {mesh_dim: spec.placements[mesh_dim]}
    for m, p in enumerate(spec.placements):
        if m != mesh_dim and linear and p.is_partial() and getattr(p, "reduce_op", None) == "sum" \
                and type(p).__name__ in ("Partial", "RaggedMeanPartial"):
            keep[m] = p
    return replicated(spec, keep)


def _lead(op_schema: OpSchema, what: str = "") -> tuple[DTensorSpec, int, RaggedShard]:
    spec = op_schema.args_schema[0]
    ragged = ragged_of(spec) if isinstance(spec, DTensorSpec) else None
    if ragged is None:
        raise unsupported(op_schema, what or "the RaggedShard operand must be the first argument")
    return spec, ragged[0], ragged[1]


def _check_after_prefix(op_schema, p: RaggedShard, dims: Sequence[int]) -> None:
    k = len(p.dims)
    if any(d < k for d in dims):
        raise unsupported(op_schema, f"dim(s) {sorted(dims)} touch the prefix dims {p.dims} that {p!r} shards")


def _same_rows(op_schema, lead: DTensorSpec, m: int, other: DTensorSpec | None) -> DTensorSpec | None:
    """The spec a second operand needs to be combined row by row with ``lead``."""
    if other is None:
        return None
    p = lead.placements[m]
    k = len(p.dims)
    if other.ndim < k or tuple(other.shape[:k]) != tuple(lead.shape[:k]):
        raise unsupported(op_schema, f"operand of shape {tuple(other.shape)} does not have the rows "
                                     f"{tuple(lead.shape[:k])} of {tuple(lead.shape)}")
    return settle(respec(other, lead.placements), m)


def _local_size(p: RaggedShard, shape: Sequence[int], spec: DTensorSpec, m: int) -> list[int]:
    return list(p.local_shape(list(shape), spec.mesh.get_local_rank(m)))


def _simple(op_schema, meta, dims_at: dict[int, int | None], out_placement=None) -> OutputSharding:
    """A local op with the dims at ``dims_at`` (arg index -> normalizing ndim) after the prefix."""
    spec, m, p = _lead(op_schema)
    args = list(op_schema.args_schema)
    for i, ndim in dims_at.items():
        if i >= len(args) or args[i] is None:
            continue
        raw = args[i]
        dims = [norm_dim(d, ndim) for d in (raw if isinstance(raw, (list, tuple)) else [raw])]
        _check_after_prefix(op_schema, p, dims)
        local = [local_dim(p, d) for d in dims]
        args[i] = local if isinstance(raw, (list, tuple)) else local[0]
    args[0] = settle(spec, m)
    q = out_placement or p
    placements = [q if i == m else pl for i, pl in enumerate(args[0].placements)]
    return rewrite(op_schema, output_specs(meta, lambda i: (spec, placements)), args)


# -- views ------------------------------------------------------------------------------------------
def _view(op_schema: OpSchema, meta) -> OutputSharding:
    spec, m, p = _lead(op_schema)
    out_shape = tuple(meta.shape)
    total = sum(p.local_units) * p.split_factor
    candidates = range(1, 2 if p.split_factor > 1 else len(out_shape) + 1)
    j = next((j for j in candidates if math.prod(out_shape[:j]) % total == 0), None)
    if j is None:
        raise unsupported(op_schema, f"no prefix of the view shape {out_shape} splits into {p!r}'s units")
    src = settle(spec, m)
    if j > 1 and any(not pl.is_replicate() for i, pl in enumerate(src.placements) if i != m):
        raise unsupported(op_schema, f"a view to a {j}-dim RaggedShard prefix next to {src.placements}")
    q = RaggedShard(tuple(range(j)), p.local_units, split_factor=p.split_factor)
    placements = [q if i == m else pl for i, pl in enumerate(src.placements)]
    args = [src, _local_size(q, out_shape, spec, m), *op_schema.args_schema[2:]]
    return rewrite(op_schema, with_meta(spec, placements, meta), args)


def _expand(op_schema: OpSchema, meta) -> OutputSharding:
    spec, m, p = _lead(op_schema)
    size = list(meta.shape)
    k = len(p.dims)
    if len(size) != spec.ndim or tuple(size[:k]) != tuple(spec.shape[:k]):
        raise unsupported(op_schema, f"expanding {tuple(spec.shape)} to {tuple(size)} changes the ragged rows")
    src = settle(spec, m)
    args = [src, _local_size(p, size, spec, m), *op_schema.args_schema[2:]]
    return rewrite(op_schema, with_meta(spec, src.placements, meta), args)


def _unsqueeze(op_schema, meta):
    return _simple(op_schema, meta, {1: op_schema.args_schema[0].ndim + 1})


def _squeeze(op_schema: OpSchema, meta) -> OutputSharding:
    spec, m, p = _lead(op_schema)
    if op_schema.op is aten.squeeze.default:
        dims = [d for d in range(spec.ndim) if spec.shape[d] == 1]
        _check_after_prefix(op_schema, p, dims)
        rewritten = OpSchema(aten.squeeze.dims, (spec, dims), {}, schema_info=op_schema.schema_info)
        out = _simple(rewritten, meta, {1: spec.ndim})
        return rewrite(op_schema, out.output_spec, out.redistribute_schema.args_schema, op=aten.squeeze.dims)
    return _simple(op_schema, meta, {1: spec.ndim})


def _transpose(op_schema: OpSchema, meta) -> OutputSharding:
    spec = op_schema.args_schema[0]
    cols = transposed_of(spec)
    if cols is not None:  # the transpose of a transpose: rows again
        if spec.ndim != 2 or (op_schema.op is aten.transpose.int
                              and {norm_dim(d, 2) for d in op_schema.args_schema[1:3]} != {0, 1}):
            raise unsupported(op_schema)
        src = replicated(spec, {cols[0]: cols[1]})
        placements = [cols[1].rows if i == cols[0] else pl for i, pl in enumerate(src.placements)]
        return rewrite(op_schema, with_meta(spec, placements, meta), [src, *op_schema.args_schema[1:]])
    spec, m, p = _lead(op_schema)
    swaps_both = spec.ndim == 2 and {norm_dim(d, 2) for d in op_schema.args_schema[1:3]} == {0, 1}
    if op_schema.op is aten.t.default or swaps_both:
        if spec.ndim < 2:
            return OutputSharding(with_meta(spec, spec.placements, meta))
        if len(p.dims) != 1:
            raise unsupported(op_schema, f"the transpose of a matrix that {p!r} shards element-wise")
        src = settle(spec, m)
        placements = [TransposedRaggedShard(p) if i == m else pl for i, pl in enumerate(src.placements)]
        return rewrite(op_schema, with_meta(spec, placements, meta), [src, *op_schema.args_schema[1:]])
    return _simple(op_schema, meta, {1: spec.ndim, 2: spec.ndim})


def _permute(op_schema: OpSchema, meta) -> OutputSharding:
    spec, m, p = _lead(op_schema)
    k = len(p.dims)
    dims = [norm_dim(d, spec.ndim) for d in op_schema.args_schema[1]]
    if dims[:k] != list(range(k)):
        raise unsupported(op_schema, f"permutation {dims} moves the prefix dims {p.dims} that {p!r} shards")
    src = settle(spec, m)
    return rewrite(op_schema, with_meta(spec, src.placements, meta), [src, [0] + [local_dim(p, d) for d in dims[k:]]])


# -- indexing ---------------------------------------------------------------------------------------
def _slice_or_select(op_schema, meta):
    args = op_schema.args_schema
    if len(args) < 2:  # slice.Tensor defaults to dim 0
        op_schema = OpSchema(op_schema.op, (args[0], 0), op_schema.kwargs_schema, schema_info=op_schema.schema_info)
    return _simple(op_schema, meta, {1: op_schema.args_schema[0].ndim})


def _index_select(op_schema: OpSchema, meta) -> OutputSharding:
    spec, m, p = _lead(op_schema)
    x, dim, index = op_schema.args_schema[:3]
    out = _simple(OpSchema(op_schema.op, (x, dim), {}), meta, {1: spec.ndim})
    args = list(out.redistribute_schema.args_schema) + [replicated(index) if isinstance(index, DTensorSpec) else index]
    return rewrite(op_schema, out.output_spec, args)


def _index_add(op_schema: OpSchema, meta) -> OutputSharding:
    spec, m, p = _lead(op_schema)
    x, dim, index, source = op_schema.args_schema[:4]
    out = _simple(OpSchema(op_schema.op, (x, dim), {}), meta, {1: spec.ndim})
    args = [*out.redistribute_schema.args_schema, replicated(index), _same_rows(op_schema, spec, m, source),
            *op_schema.args_schema[4:]]
    return rewrite(op_schema, out.output_spec, args)


def _slice_select_backward(op_schema: OpSchema, meta) -> OutputSharding:
    """``slice_backward(grad, input_sizes, dim, ...)`` / ``select_backward``: the gradient keeps
    the rows; the local call gets the local input size and dim."""
    spec, m, p = _lead(op_schema)
    sizes = list(op_schema.args_schema[1])
    dim = norm_dim(op_schema.args_schema[2], len(sizes))
    _check_after_prefix(op_schema, p, [dim])
    src = settle(spec, m)
    args = [src, _local_size(p, sizes, spec, m), local_dim(p, dim), *op_schema.args_schema[3:]]
    return rewrite(op_schema, with_meta(spec, src.placements, meta), args)


# -- joins and splits -------------------------------------------------------------------------------
def _join(op_schema: OpSchema, meta) -> OutputSharding:
    """``cat`` / ``stack`` along a dim after the prefix: every operand row-sharded alike; ``cat``
    along the prefix: replicated."""
    tensors = list(op_schema.args_schema[0])
    dim = op_schema.args_schema[1] if len(op_schema.args_schema) > 1 else 0
    lead = next((t for t in tensors if ragged_of(t) is not None), None)
    if lead is None:
        raise unsupported(op_schema)
    m, p = ragged_of(lead)
    ndim = len(meta.shape)
    d = norm_dim(dim, ndim)
    if op_schema.op is aten.cat.default and d < len(p.dims):
        # along the ragged rows (``parameters_to_vector``): no rank's rows of the result are one
        # run, so the operands are gathered and the result replicated, as torch's cat of Shard(0)
        targets = [replicated(t) for t in tensors]
        out = with_meta(lead, [Replicate()] * lead.mesh.ndim, meta)
        return rewrite(op_schema, out, [targets, *op_schema.args_schema[1:]])
    _check_after_prefix(op_schema, p, [d])
    if any(t.ndim != lead.ndim for t in tensors):
        raise unsupported(op_schema, "operands of different ranks")
    src = settle(lead, m)
    targets = [_same_rows(op_schema, lead, m, t) for t in tensors]
    return rewrite(op_schema, with_meta(lead, src.placements, meta), [targets, local_dim(p, d)])


def _split(op_schema: OpSchema, meta) -> OutputSharding:
    spec, m, p = _lead(op_schema)
    args = list(op_schema.args_schema)
    if len(args) < 3:
        args += [0] * (3 - len(args))
    return _simple(OpSchema(op_schema.op, tuple(args), op_schema.kwargs_schema, schema_info=op_schema.schema_info),
                   meta, {2: spec.ndim})


def _repeat(op_schema: OpSchema, meta) -> OutputSharding:
    spec, m, p = _lead(op_schema)
    repeats = list(op_schema.args_schema[1])
    k = len(p.dims)
    if len(repeats) != spec.ndim or any(r != 1 for r in repeats[:k]):
        raise unsupported(op_schema, f"repeats {repeats} repeat the rows that {p!r} shards")
    src = settle(spec, m)
    return rewrite(op_schema, with_meta(spec, src.placements, meta), [src, [1, *repeats[k:]]])


def _unbind(op_schema: OpSchema, meta) -> OutputSharding:
    spec = op_schema.args_schema[0]
    args = op_schema.args_schema if len(op_schema.args_schema) > 1 else (spec, 0)
    return _simple(OpSchema(op_schema.op, tuple(args), {}, schema_info=op_schema.schema_info), meta, {1: spec.ndim})


VIEW_RULES = {
    aten.view.default: _view,
    aten._unsafe_view.default: _view,
    aten.reshape.default: _view,
    aten.expand.default: _expand,
    aten.unsqueeze.default: _unsqueeze,
    aten.squeeze.default: _squeeze,
    aten.squeeze.dim: _squeeze,
    aten.squeeze.dims: _squeeze,
    aten.t.default: _transpose,
    aten.transpose.int: _transpose,
    aten.permute.default: _permute,
    aten.slice.Tensor: _slice_or_select,
    aten.select.int: _slice_or_select,
    aten.index_select.default: _index_select,
    aten.index_add.default: _index_add,
    aten.slice_backward.default: _slice_select_backward,
    aten.select_backward.default: _slice_select_backward,
    aten.cat.default: _join,
    aten.stack.default: _join,
    aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split,
    aten.unbind.int: _unbind,
    aten.repeat.default: _repeat,
}
