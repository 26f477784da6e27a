"""Rules for reductions of RaggedShard tensors: ``sum``, ``mean``, ``linalg_vector_norm``,
``_foreach_norm``, ``any``, ``all``.

They reduce locally; every sharded mesh dim whose cut dims are all reduced becomes ``Partial``
(sum), a :class:`RaggedMeanPartial` (mean: each rank weighted by its share, exact for uneven and
empty shards) or, for a norm, ``Partial("max")`` / ``Partial("min")`` (``ord=inf`` / ``-inf``),
``Partial("sum")`` (``ord=0``, a count) or torch's ``_NormPartial`` (other orders); an empty
shard's norm is the reduction's identity. Dims that are not reduced keep their placement.

``any`` / ``all`` over every element are ``Replicate``: the op all-reduces the local answers
(``ragged_placement::global_any_all``), so ``bool(x.any())`` is the global answer on every rank.
torch's rule leaves them ``Partial``, whose ``bool()`` reads each rank's local answer: the
rejection loop of ``nn.init.trunc_normal_`` would then run a different number of draws per
rank. Over some dims they raise ``NotImplementedError``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding

from ragged_placement._compat import NormPartial
from ragged_placement.ops import _local_ops  # noqa: F401 - registers torch.ops.ragged_placement
from ragged_placement.ops._common import ragged_of, rewrite
from ragged_placement.ops._common import unsupported as _unsupported
from ragged_placement.ops._common import with_meta as _with_meta
from ragged_placement.placement import RaggedShard
from ragged_placement.regions import cut_shape as _apply_cut
from ragged_placement.regions import shard_size_and_offset

aten = torch.ops.aten
ours = torch.ops.ragged_placement

__all__ = ["ANY_ALL_RULES", "REDUCTION_OPS", "RaggedMeanPartial", "reduction"]

_SUM_OPS = {aten.sum.default, aten.sum.dim_IntList}
_MEAN_OPS = {aten.mean.default, aten.mean.dim}
_NORM_OPS = {aten.linalg_vector_norm.default}
# every op :func:`reduction` handles
REDUCTION_OPS = {*_SUM_OPS, *_MEAN_OPS, *_NORM_OPS, aten._foreach_norm.Scalar}


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


def reduction(op_schema: OpSchema, meta) -> OutputSharding:
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


def _any_all(op_schema: OpSchema, meta) -> OutputSharding:
    """``any()`` / ``all()`` of every element: the local answer all-reduced over the mesh dims
    that shard the input (an empty shard answers the identity, ``False`` / ``True``)."""
    spec = op_schema.args_schema[0]
    groups = []
    for m, p in enumerate(spec.placements):
        if p.is_partial():
            raise _unsupported(op_schema, f"{op_schema.op} of {p!r} data; redistribute it first")
        if not p.is_replicate():
            groups.append(spec.mesh.get_group(m).group_name)
    out = _with_meta(spec, [Replicate()] * spec.mesh.ndim, meta)
    is_any = op_schema.op is aten.any.default
    return rewrite(op_schema, out, [spec, is_any, groups], op=ours.global_any_all.default)


ANY_ALL_RULES = {aten.any.default: _any_all, aten.all.default: _any_all}
