"""What every op-rule family shares: the error, output specs, and the ragged prefix's local dims.

A RaggedShard DTensor's local tensor is ``(run_rows, *shape[k:])`` for ``k = len(dims)``: the
flattened prefix is one local dim. :func:`local_dim` maps a tensor dim after the prefix to its local
index; rules that pass a dim (or a size) to the local op rewrite it through :func:`rewrite`, which
returns an ``OutputSharding`` whose ``redistribute_schema`` carries both the input placements the
op needs and the local values of its non-tensor arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.distributed.tensor import Placement, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
from torch.utils._pytree import tree_flatten

from ragged_placement._compat import dispatcher_runs_rewritten_ops
from ragged_placement.placement import RaggedShard

__all__ = [
    "unsupported", "with_meta", "output_specs", "ragged_of", "local_dim", "norm_dim", "respec",
    "replicated", "rewrite",
]


def unsupported(op_schema: OpSchema, why: str = "") -> NotImplementedError:
    """The error for an op (or a use of it) without a RaggedShard rule: names the op and the
    input placements, and says how to get a result."""
    placements = sorted({str(s.placements) for s in tree_flatten(op_schema.args_schema)[0]
                         if isinstance(s, DTensorSpec)})
    return NotImplementedError(
        f"{op_schema.op} has no RaggedShard rule{': ' + why if why else ''} "
        f"(input placements: {', '.join(placements)}). Redistribute the inputs first, e.g. "
        f"dt.redistribute(mesh, [Replicate()]) or to Shard."
    )


def with_meta(spec: DTensorSpec, placements: Sequence[Placement], meta: TensorMeta | None) -> DTensorSpec:
    return DTensorSpec(spec.mesh, tuple(placements), tensor_meta=meta)


def output_specs(meta, lead_for: Callable[[int], tuple[DTensorSpec, Sequence[Placement]]]):
    """Map the output TensorMeta structure to specs; ``lead_for(i)`` gives (spec, placements)."""
    if meta is None:
        return None
    if isinstance(meta, TensorMeta):
        spec, placements = lead_for(0)
        return with_meta(spec, placements, meta)
    out = []
    for i, m in enumerate(meta):
        spec, placements = lead_for(i)
        out.append(None if m is None else with_meta(spec, placements, m))
    return type(meta)(out) if isinstance(meta, tuple) else out


def ragged_of(spec: DTensorSpec) -> tuple[int, RaggedShard] | None:
    """``(mesh_dim, placement)`` of the first RaggedShard of ``spec``, or None."""
    for m, p in enumerate(spec.placements):
        if isinstance(p, RaggedShard):
            return m, p
    return None


def norm_dim(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


def local_dim(p: RaggedShard, dim: int) -> int:
    """Local index of tensor dim ``dim`` (non-negative, after the flattened prefix)."""
    return dim - len(p.dims) + 1


def respec(spec: DTensorSpec, placements: Sequence[Placement]) -> DTensorSpec:
    """``spec`` with other placements (same mesh and tensor meta): an input to redistribute to."""
    return DTensorSpec(spec.mesh, tuple(placements), tensor_meta=spec.tensor_meta)


def replicated(spec: DTensorSpec, keep: dict[int, Placement] | None = None) -> DTensorSpec:
    """``spec`` replicated on every mesh dim except those in ``keep`` (mesh dim -> placement)."""
    keep = keep or {}
    return respec(spec, [keep.get(m, Replicate()) for m in range(spec.mesh.ndim)])


def rewrite(op_schema: OpSchema, out, args: Sequence[object], op=None) -> OutputSharding:
    """An ``OutputSharding`` that redistributes the tensor inputs to the specs in ``args`` and runs
    ``op`` (default: the same op) on the local tensors with the non-tensor values in ``args``
    (local dims and sizes). Extra trailing ``args`` are appended to the local call.

    Another ``op`` needs a dispatcher that runs it (:func:`ragged_placement._compat.
    dispatcher_runs_rewritten_ops`); without one this raises ``NotImplementedError`` rather than let
    the original op run on the local tensor."""
    if op is not None and op != op_schema.op and not dispatcher_runs_rewritten_ops():
        raise unsupported(op_schema, f"this rule runs {op} locally, which torch {torch.__version__}'s "
                                     f"DTensor dispatcher does not support (torch 2.13 does)")
    schema = OpSchema(op or op_schema.op, tuple(args), op_schema.kwargs_schema, schema_info=op_schema.schema_info)
    return OutputSharding(out, schema, needs_redistribute=True, use_val_from_redistribute_schema=True)

