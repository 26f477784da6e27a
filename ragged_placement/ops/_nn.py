"""Rules for the neural-network ops of row-sharded activations and vocabulary-sharded tables.

* ``_softmax`` / ``_log_softmax`` and their backward ops over a dim after the prefix: local.
* ``native_layer_norm`` / ``_fused_rms_norm`` over trailing dims after the prefix: local, with
  replicated weight and bias; their backward ops give the input gradient on the same rows and
  ``Partial(sum)`` weight and bias gradients (each rank sums over its rows). ``F.rms_norm`` on CPU
  decomposes into element-wise ops and ``mean``, covered by the pointwise and reduction rules.
* ``embedding``:

  - a vocabulary-sharded table (``RaggedShard((0,))`` on the weight, as torch's row-wise embedding
    sharding): the ids are replicated, each rank looks up the ids in its run of rows and zeroes
    the others, and the output is ``Partial(sum)``. The weight gradient then runs through torch's
    own rules (its inputs are replicated) and is redistributed to the table's rows by the
    optimizer's element-wise update;
  - row-sharded ids with a replicated table: the output keeps the ids' rows, and
    ``embedding_dense_backward`` of row-sharded gradients and ids is ``Partial(sum)``.

* ``nll_loss_forward`` (``cross_entropy`` is ``log_softmax`` + ``nll_loss``) on row-sharded
  ``[N, C]`` log-probabilities and targets: ``reduction="none"`` keeps the rows, ``"sum"`` is
  ``Partial(sum)``, ``"mean"`` divides each rank's sum by the global total weight (one scalar
  all-reduce) into ``Partial(sum)``: exact for uneven and empty shards and class weights.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding

from ragged_placement.ops import _local_ops  # noqa: F401 - registers torch.ops.ragged_placement
from ragged_placement.ops._common import (
    local_dim,
    norm_dim,
    output_specs,
    ragged_of,
    replicated,
    rewrite,
    unsupported,
)
from ragged_placement.ops._views import settle
from ragged_placement.placement import RaggedShard

aten = torch.ops.aten
ours = torch.ops.ragged_placement

__all__ = ["NN_RULES"]


def _lead(op_schema: OpSchema, index: int = 0) -> tuple[DTensorSpec, int, RaggedShard]:
    spec = op_schema.args_schema[index]
    ragged = ragged_of(spec) if isinstance(spec, DTensorSpec) else None
    if ragged is None:
        raise unsupported(op_schema, f"argument {index} must carry the RaggedShard")
    return spec, *ragged


def _like(op_schema: OpSchema, spec: DTensorSpec, lead: DTensorSpec, m: int) -> DTensorSpec:
    """``spec`` on ``lead``'s rows: the operands a row-wise op combines."""
    p = lead.placements[m]
    k = len(p.dims)
    if tuple(spec.shape[:k]) != tuple(lead.shape[:k]):
        raise unsupported(op_schema, f"an operand of shape {tuple(spec.shape)} does not have the rows of "
                                     f"{tuple(lead.shape)}")
    return replicated(spec, {m: p})


def _placements(spec: DTensorSpec, m: int, p) -> list:
    return [p if i == m else Replicate() for i in range(spec.mesh.ndim)]


# -- softmax ------------------------------------------------------------------------------------------
def _softmax(op_schema: OpSchema, meta) -> OutputSharding:
    spec, m, p = _lead(op_schema)
    dim = norm_dim(op_schema.args_schema[1], spec.ndim)
    if dim < len(p.dims):
        raise unsupported(op_schema, f"a softmax over dim {dim}, which {p!r} shards")
    src = settle(spec, m, linear=False)
    return rewrite(op_schema, output_specs(meta, lambda i: (spec, src.placements)),
                   [src, local_dim(p, dim), *op_schema.args_schema[2:]])


def _softmax_backward(op_schema: OpSchema, meta) -> OutputSharding:
    grad, out, dim, dtype = op_schema.args_schema[:4]
    spec, m, p = _lead(op_schema, 1)
    dim = norm_dim(dim, spec.ndim)
    if dim < len(p.dims):
        raise unsupported(op_schema, f"a softmax over dim {dim}, which {p!r} shards")
    src = replicated(spec, {m: p})
    return rewrite(op_schema, output_specs(meta, lambda i: (spec, src.placements)),
                   [_like(op_schema, grad, spec, m), src, local_dim(p, dim), dtype])


# -- layer_norm / rms_norm ----------------------------------------------------------------------------
def _check_normalized(op_schema, spec: DTensorSpec, p: RaggedShard, normalized_shape) -> None:
    if spec.ndim - len(normalized_shape) < len(p.dims):
        raise unsupported(op_schema, f"normalizing over {tuple(normalized_shape)}, which includes dims {p!r} shards")


def _norm_forward(op_schema: OpSchema, meta) -> OutputSharding:
    """``native_layer_norm(x, shape, w, b, eps)`` / ``_fused_rms_norm(x, shape, w, eps)``."""
    spec, m, p = _lead(op_schema)
    args = list(op_schema.args_schema)
    _check_normalized(op_schema, spec, p, args[1])
    args[0] = replicated(spec, {m: p})
    for i, a in enumerate(args[2:], start=2):
        if isinstance(a, DTensorSpec):
            args[i] = replicated(a)
    return rewrite(op_schema, output_specs(meta, lambda i: (spec, args[0].placements)), args)


def _norm_backward(op_schema: OpSchema, meta) -> OutputSharding:
    """``native_layer_norm_backward(grad, x, shape, mean, rstd, w, b, mask)`` and
    ``_fused_rms_norm_backward(grad, x, shape, rstd, w, mask)``: the input gradient on the rows,
    weight and bias gradients ``Partial(sum)``."""
    spec, m, p = _lead(op_schema, 1)
    args = list(op_schema.args_schema)
    _check_normalized(op_schema, spec, p, args[2])
    stats = (3, 4) if op_schema.op is aten.native_layer_norm_backward.default else (3,)
    for i, a in enumerate(args):
        if not isinstance(a, DTensorSpec):
            continue
        args[i] = _like(op_schema, a, spec, m) if i in (0, 1, *stats) else replicated(a)
    rows = _placements(spec, m, p)
    partial = _placements(spec, m, Partial("sum"))
    return rewrite(op_schema, output_specs(meta, lambda i: (spec, rows if i == 0 else partial)), args)


# -- embedding ------------------------------------------------------------------------------------------
def _embedding(op_schema: OpSchema, meta) -> OutputSharding:
    weight, indices = op_schema.args_schema[:2]
    rest = list(op_schema.args_schema[2:]) + [-1, False, False][len(op_schema.args_schema) - 2:]
    table = ragged_of(weight)
    if table is not None:  # vocabulary rows: mask, look up locally, sum
        m, p = table
        if p.dims != (0,) or p.split_factor != 1:
            raise unsupported(op_schema, f"a table sharded as {p!r}; use RaggedShard((0,), units)")
        w = replicated(weight, {m: p})
        start = p.local_row_range(weight.shape, weight.mesh.get_local_rank(m))[0]
        out = output_specs(meta, lambda i: (weight, _placements(weight, m, Partial("sum"))))
        return rewrite(op_schema, out, [w, replicated(indices), *rest, start, weight.shape[0]],
                       op=ours.embedding_rows.default)
    m, p = ragged_of(indices)
    ids = replicated(indices, {m: p})
    return rewrite(op_schema, output_specs(meta, lambda i: (indices, ids.placements)),
                   [replicated(weight), ids, *rest])


def _embedding_backward(op_schema: OpSchema, meta) -> OutputSharding:
    grad, indices, num_weights, padding_idx, scale_grad_by_freq = op_schema.args_schema[:5]
    ragged = ragged_of(indices)
    if ragged is None:
        raise unsupported(op_schema, "row-sharded gradients need row-sharded ids")
    if scale_grad_by_freq:
        raise unsupported(op_schema, "scale_grad_by_freq counts ids over the whole batch; replicate the ids")
    m, p = ragged
    ids = replicated(indices, {m: p})
    out = output_specs(meta, lambda i: (indices, _placements(indices, m, Partial("sum"))))
    args = [_like(op_schema, grad, indices, m), ids, num_weights, padding_idx, scale_grad_by_freq]
    return rewrite(op_schema, out, args)


# -- nll_loss -------------------------------------------------------------------------------------------
def _rows_of_logits(op_schema: OpSchema, index: int) -> tuple[DTensorSpec, int, RaggedShard]:
    spec, m, p = _lead(op_schema, index)
    if spec.ndim != 2 or p.dims != (0,):
        raise unsupported(op_schema, "nll_loss needs [N, C] log-probabilities with RaggedShard((0,)) on N")
    return spec, m, p


def _nll_loss_forward(op_schema: OpSchema, meta) -> OutputSharding:
    x, target, weight, reduction, ignore_index = op_schema.args_schema[:5]
    spec, m, p = _rows_of_logits(op_schema, 0)
    args = [replicated(spec, {m: p}), replicated(target, {m: p}),
            replicated(weight) if isinstance(weight, DTensorSpec) else weight, reduction, ignore_index]
    rows, partial, rep = (_placements(spec, m, q) for q in (p, Partial("sum"), Replicate()))
    if reduction == 1:  # mean: local sum over the global total weight
        group = spec.mesh.get_group(m).group_name
        out = output_specs(meta, lambda i: (spec, partial if i == 0 else rep))
        return rewrite(op_schema, out, [*args, group], op=ours.nll_loss_mean.default)
    out = output_specs(meta, lambda i: (spec, rows if (i == 0 and reduction == 0) else partial))
    return rewrite(op_schema, out, args)


def _nll_loss_backward(op_schema: OpSchema, meta) -> OutputSharding:
    grad, x, target, weight, reduction, ignore_index, total_weight = op_schema.args_schema[:7]
    spec, m, p = _rows_of_logits(op_schema, 1)
    src = replicated(spec, {m: p})
    grad2 = replicated(grad, {m: p}) if reduction == 0 else replicated(grad)
    args = [grad2, src, replicated(target, {m: p}), replicated(weight) if isinstance(weight, DTensorSpec) else weight,
            reduction, ignore_index, replicated(total_weight)]
    return rewrite(op_schema, output_specs(meta, lambda i: (spec, src.placements)), args)


NN_RULES = {
    aten._softmax.default: _softmax,
    aten._log_softmax.default: _softmax,
    aten._softmax_backward_data.default: _softmax_backward,
    aten._log_softmax_backward_data.default: _softmax_backward,
    aten.native_layer_norm.default: _norm_forward,
    aten._fused_rms_norm.default: _norm_forward,
    aten.native_layer_norm_backward.default: _norm_backward,
    aten._fused_rms_norm_backward.default: _norm_backward,
    aten.embedding.default: _embedding,
    aten.embedding_dense_backward.default: _embedding_backward,
    aten.nll_loss_forward.default: _nll_loss_forward,
    aten.nll_loss_backward.default: _nll_loss_backward,
}
