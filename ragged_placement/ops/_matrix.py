"""Rules for matrix products of RaggedShard tensors.

===============================================  ================================  ===================
operands                                         output                            communication
===============================================  ================================  ===================
``mm(A, B)``: A ``RaggedShard((0,))`` rows       rows of A                         B to Replicate
``addmm(bias, A, B)``: the same                  rows of A                         bias/B to Replicate
``bmm(A, B)``: A ``RaggedShard((0,))`` batches   batches of A                      B sliced like A
``mm(A.t(), B)``: contraction over the rows      ``Partial(sum)``                  B to A's runs
``mm(R, A.t())``: replicated times columns       columns (``A.t()``'s layout)      none
===============================================  ================================  ===================

``F.linear(x, W, b)`` is ``t(W)`` and ``addmm`` (or ``view`` + ``mm`` for batched inputs), and its
weight gradient is ``mm(x.t(), grad)``: the transpose of a row-sharded matrix, which holds uneven
runs of *columns*. :class:`TransposedRaggedShard` is that layout. It exists so that this
contraction (and ``t()`` back to rows) runs locally; any other use of it raises.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Placement
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding

from ragged_placement.ops._common import ragged_of, replicated, rewrite, unsupported, with_meta
from ragged_placement.placement import RaggedShard, RowRunPlacement

aten = torch.ops.aten

__all__ = ["TransposedRaggedShard", "MATRIX_RULES", "transposed_of"]


class TransposedRaggedShard(RowRunPlacement):
    """The layout of ``x.t()`` for a 2-D ``x`` with ``RaggedShard((0,), units)``: rank ``i`` holds
    the columns that are ``x``'s rows of rank ``i``.

    An intermediate of matrix products (autograd's weight gradient of ``linear``): ``mm`` contracts
    it with the matching row-sharded operand into ``Partial(sum)``, and ``t()`` turns it back into
    rows. It has no redistribution: materialize ``x.t()`` as ``x.full_tensor().t()``.
    """

    __slots__ = ("rows",)
    rows: RaggedShard

    def __init__(self, rows: RaggedShard) -> None:
        super().__init__()
        if not isinstance(rows, RaggedShard) or rows.dims != (0,):
            raise ValueError(f"rows must be a RaggedShard over dims (0,), got {rows!r}")
        object.__setattr__(self, "rows", rows)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"TransposedRaggedShard is immutable (tried to set {name!r})")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TransposedRaggedShard) and self.rows == other.rows

    def __hash__(self) -> int:
        return hash(("TransposedRaggedShard", self.rows))

    def __repr__(self) -> str:
        return f"TransposedRaggedShard({self.rows!r})"

    def __str__(self) -> str:
        return f"T{self.rows}"


def transposed_of(spec: DTensorSpec) -> tuple[int, TransposedRaggedShard] | None:
    for m, p in enumerate(spec.placements):
        if isinstance(p, TransposedRaggedShard):
            return m, p
    return None


def _row_sharded(spec) -> tuple[int, RaggedShard] | None:
    r = ragged_of(spec) if isinstance(spec, DTensorSpec) else None
    return r if r is not None and r[1].dims == (0,) else None


def _with(placements, m: int, p: Placement) -> list[Placement]:
    return [p if i == m else q for i, q in enumerate(placements)]


def _mm(op_schema: OpSchema, meta) -> OutputSharding:
    a, b = op_schema.args_schema[:2]
    rows = _row_sharded(a)
    if rows is not None:  # (rows x anything): rows of A, B replicated
        m, p = rows
        a2 = replicated(a, {m: p})
        return rewrite(op_schema, with_meta(a, a2.placements, meta), [a2, replicated(b)])
    cols = transposed_of(a)
    if cols is not None:  # contraction over A's ragged columns: Partial
        m, t = cols
        a2 = replicated(a, {m: t})
        b2 = replicated(b, {m: t.rows})
        return rewrite(op_schema, with_meta(a, _with(a2.placements, m, Partial("sum")), meta), [a2, b2])
    bcols = transposed_of(b)
    if bcols is not None:  # replicated rows times ragged columns: columns
        m, t = bcols
        b2 = replicated(b, {m: t})
        return rewrite(op_schema, with_meta(b, b2.placements, meta), [replicated(a), b2])
    raise unsupported(op_schema, "the left operand must be row-sharded (RaggedShard((0,))) or the "
                                 "transpose of one; a replicated left operand times row-sharded rows "
                                 "has no layout for its columns")


def _addmm(op_schema: OpSchema, meta) -> OutputSharding:
    bias, a, b = op_schema.args_schema[:3]
    rows = _row_sharded(a)
    if rows is None:
        raise unsupported(op_schema, "addmm needs its first matrix row-sharded (RaggedShard((0,)))")
    m, p = rows
    a2 = replicated(a, {m: p})
    per_row = bias.ndim == 2 and bias.shape[0] == a.shape[0] and a.shape[0] != 1
    bias2 = replicated(bias, {m: p}) if per_row else replicated(bias)
    return rewrite(op_schema, with_meta(a, a2.placements, meta), [bias2, a2, replicated(b), *op_schema.args_schema[3:]])


def _bmm(op_schema: OpSchema, meta) -> OutputSharding:
    a, b = op_schema.args_schema[:2]
    lead = a if _row_sharded(a) is not None else b
    rows = _row_sharded(lead)
    if rows is None:
        raise unsupported(op_schema, "bmm needs an operand with RaggedShard((0,)) on the batch dim")
    m, p = rows
    a2, b2 = replicated(a, {m: p}), replicated(b, {m: p})
    return rewrite(op_schema, with_meta(lead, a2.placements, meta), [a2, b2])


MATRIX_RULES = {
    aten.mm.default: _mm,
    aten.addmm.default: _addmm,
    aten.bmm.default: _bmm,
}
