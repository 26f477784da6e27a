"""Local kernels that some rules run in place of the aten op (``torch.ops.ragged_placement.*``).

A rule can only redistribute inputs and run one op on the local tensors. Where the local answer
needs more than the aten op gives, the rule names one of these instead:

* ``global_var``: ``var`` / ``std`` over the ragged rows; every rank gathers the per-rank
  ``(count, sum, M2)`` and combines them with Chan et al.'s parallel formula, so the result is exact
  (not a mean of variances) for uneven and empty shards;
* ``extreme``: ``amax`` / ``amin`` whose empty local shard gives the reduction's identity (an
  empty ``amax`` is an error in torch), for a ``Partial("max" / "min")`` output;
* ``vector_norm`` / ``foreach_norm``: ``linalg_vector_norm`` / ``_foreach_norm`` whose empty local
  shard gives, where torch's kernel raises (``ord=inf`` and ``ord < 0``), the identity of the
  pending reduction: ``0`` (a norm's lower bound) for ``Partial("max")``, ``inf`` for
  ``Partial("min")`` and for a negative ``_NormPartial`` (``inf ** p == 0``);
* ``embedding_rows``: a lookup in the rank's run of vocabulary rows, zero where the id is outside
  it, for a ``Partial(sum)`` output;
* ``global_any_all``: ``any()`` / ``all()`` of the local tensor, all-reduced (max / min) over
  the given groups, for a ``Replicate`` output;
* ``nll_loss_mean``: ``nll_loss`` with ``reduction="mean"`` over row-sharded logits: the local sum
  divided by the global total weight, for a ``Partial(sum)`` output.

Collectives take the group name of the mesh dim, resolved by torch's functional collectives.
"""

from __future__ import annotations

import math

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from ragged_placement._compat import functional_all_gather

__all__ = ["LIB"]

LIB = torch.library.Library("ragged_placement", "DEF")  # noqa: TOR901 - kernels for every backend below
LIB.define(
    "global_var(Tensor self, int[]? dim, int[] local_dims, int[] out_shape, bool take_sqrt, str group, *, "
    "Scalar? correction=None, bool keepdim=False) -> Tensor"
)
LIB.define("extreme(Tensor self, int[] dim, bool keepdim, bool is_max) -> Tensor")
LIB.define(
    "vector_norm(Tensor self, Scalar ord=2, int[1]? dim=None, bool keepdim=False, *, ScalarType? dtype=None) "
    "-> Tensor"
)
LIB.define("foreach_norm(Tensor[] self, Scalar ord=2, ScalarType? dtype=None) -> Tensor[]")
LIB.define(
    "embedding_rows(Tensor weight, Tensor indices, SymInt padding_idx, bool scale_grad_by_freq, bool sparse, "
    "int start, int num_embeddings) -> Tensor"
)
LIB.define("global_any_all(Tensor self, bool is_any, str[] groups) -> Tensor")
LIB.define(
    "nll_loss_mean(Tensor self, Tensor target, Tensor? weight, int reduction, SymInt ignore_index, str group) "
    "-> (Tensor, Tensor)"
)


def _wait(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _global_var(x, dim, local_dims, out_shape, take_sqrt, group, *, correction=None, keepdim=False):
    stats_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    xs = x.to(stats_dtype)
    dims = list(local_dims)
    n = math.prod(x.shape[d] for d in dims)
    total = xs.sum(dims, keepdim=True)
    mean = total / n if n else torch.zeros_like(total)
    m2 = ((xs - mean) ** 2).sum(dims, keepdim=True)
    local = torch.stack([torch.full_like(total, n), total, m2])
    world = _wait(functional_all_gather(local.unsqueeze(0), 0, group))  # [W, 3, ...]
    counts, sums, m2s = world.unbind(1)
    count = counts.sum(0)
    grand_mean = sums.sum(0) / count
    rank_means = torch.where(counts > 0, sums / counts.clamp_min(1), grand_mean)
    m2_total = m2s.sum(0) + (counts * (rank_means - grand_mean) ** 2).sum(0)
    c = 1.0 if correction is None else float(correction)
    out = m2_total / (count - c).clamp_min(0)
    if take_sqrt:
        out = out.sqrt()
    return out.to(x.dtype).reshape(out_shape)


def _extreme(x, dim, keepdim, is_max):
    if x.numel():
        return (torch.amax if is_max else torch.amin)(x, dim, keepdim)
    dims = {d % max(x.ndim, 1) for d in dim} if dim else set(range(x.ndim))
    shape = [1 if d in dims else s for d, s in enumerate(x.shape) if keepdim or d not in dims]
    if x.dtype.is_floating_point:
        identity = -math.inf if is_max else math.inf
    else:
        info = torch.iinfo(x.dtype)
        identity = info.min if is_max else info.max
    return x.new_full(shape, identity)


def _vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None):
    if x.numel() or not (ord < 0 or ord == math.inf):
        return torch.linalg.vector_norm(x, ord, dim, keepdim, dtype=dtype)
    out = torch.linalg.vector_norm(x, 2, dim, keepdim, dtype=dtype)  # zeros of the output's shape
    return out if ord > 0 else out.fill_(math.inf)  # inf: what a negative p-norm of none is


def _foreach_norm(xs, ord=2, dtype=None):
    return [_vector_norm(x, ord, dtype=dtype) for x in xs]


def _embedding_rows(weight, indices, padding_idx, scale_grad_by_freq, sparse, start, num_embeddings):
    # torch's embedding raises on an id out of range (a device-side assert on GPU): so do we
    torch._assert_async(((indices >= 0) & (indices < num_embeddings)).all(),
                        f"embedding: an index is out of range for a table of {num_embeddings} rows")
    rows = weight.shape[0]
    outside = (indices < start) | (indices >= start + rows)
    if rows == 0:
        return weight.new_zeros(*indices.shape, weight.shape[1])
    out = F.embedding(indices.masked_fill(outside, start) - start, weight)
    return out.masked_fill(outside.unsqueeze(-1), 0)


def _global_any_all(x, is_any, groups):
    flag = (x.any() if is_any else x.all()).to(torch.uint8)
    for group in groups:
        flag = _wait(funcol.all_reduce(flag, "max" if is_any else "min", group))
    return flag.to(torch.bool)


def _nll_loss_mean(x, target, weight, reduction, ignore_index, group):
    loss_sum, local_weight = torch.ops.aten.nll_loss_forward(x, target, weight, 2, ignore_index)
    total_weight = _wait(funcol.all_reduce(local_weight, "sum", group))
    return loss_sum / total_weight, total_weight


for _name, _fn in [("global_var", _global_var), ("extreme", _extreme), ("vector_norm", _vector_norm),
                   ("foreach_norm", _foreach_norm), ("embedding_rows", _embedding_rows),
                   ("global_any_all", _global_any_all), ("nll_loss_mean", _nll_loss_mean)]:
    LIB.impl(_name, _fn, "CompositeExplicitAutograd")
