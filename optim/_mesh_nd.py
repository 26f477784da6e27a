"""Matrix-wise optimizer math for parameters sharded over several mesh dims (FSDP x TP).

Parameters sharded over one mesh dim (1-D meshes, HSDP, a plain parameter on an FSDP x TP mesh)
take the batched :class:`~ragged_placement.optim._sharding.Exchange`: one all-to-all each way
per process group and one all-gather per ``Replicate`` dim, one owner per matrix in the world.
With two sharded dims a rank may hold a 2-D block (row-wise tensor parallel: ``Shard(1)`` under a
RaggedShard), which is no contiguous run of the flattened matrix, so here each matrix travels
through DTensor redistribution instead:

* to its owner: every sharded mesh dim is redistributed to a RaggedShard with all units on the
  owner's coordinate (``Replicate`` dims stay replicated: every coordinate of such a dim
  computes its own copy);
* back: from that placement to the parameter's own placements.

Each direction costs one collective per sharded mesh dim per matrix (not batched). Stacks of
matrices split by whole matrices on every sharded dim but one (experts under FSDP x EP) do not
come here: the batched exchange takes each block (:func:`~._sharding.stack_layout`). Owners are
chosen greedily (largest Newton-Schulz cost first, least-loaded coordinate) over the coordinates
of the sharded mesh dims.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate

from ragged_placement.optim._sharding import stack_layout
from ragged_placement.placement import RaggedShard
from ragged_placement.regions import contiguous_stride

__all__ = [
    "assign_nd_owners",
    "gather_to_owner",
    "owner_placements",
    "scatter_from_owner",
    "sharded_on_several_dims",
]


def sharded_on_several_dims(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor sharded over more than one mesh dim (FSDP x TP) that
    takes this module's path: all but a stack of matrices split by whole matrices on every
    sharded dim but one (FSDP x EP experts), which the batched exchange takes per block
    (:func:`~ragged_placement.optim._sharding.stack_layout`)."""
    return (
        isinstance(tensor, DTensor)
        and len(_sharded_dims(tensor)) > 1
        and stack_layout(tensor) is None
    )


def _sharded_dims(p: DTensor) -> list[int]:
    dims = []
    for m, pl in enumerate(p.placements):
        if isinstance(pl, Partial):
            raise ValueError(  # noqa: TRY004 - a bad placement value, not a bad type
                f"parameter placements must not be Partial, got {p.placements}"
            )
        if type(pl).__name__ == "_StridedShard":
            raise ValueError(
                f"a parameter of shape {tuple(p.shape)} has placements {p.placements}: "
                f"_StridedShard (torch FSDP2's layout of a tensor dim cut over two mesh dims, e.g. "
                f"its expert-parallel stacks under fully_shard) is not supported by "
                f"ragged_placement.optim; shard the model with ragged_placement.fsdp.fully_shard"
            )
        if not isinstance(pl, Replicate):
            dims.append(m)
    return dims


def assign_nd_owners(params: Sequence[DTensor], costs: Sequence[float]) -> list[tuple[int, ...]]:
    """An owner mesh coordinate for every parameter (all on one mesh), balancing ``costs``.

    A replicated mesh dim computes on every coordinate, so a parameter's cost lands on all of
    them; the owner coordinate of such a dim is reported as 0 and ignored.
    """
    if not params:
        return []
    shape = tuple(params[0].device_mesh.shape)
    loads: dict[tuple[int, ...], float] = {c: 0.0 for c in itertools.product(*(range(s) for s in shape))}
    owners: list[tuple[int, ...] | None] = [None] * len(params)
    for i in sorted(range(len(params)), key=lambda i: (-costs[i], i)):
        sharded = _sharded_dims(params[i])
        best, best_load = None, math.inf
        for choice in itertools.product(*(range(shape[m]) for m in sharded)):
            fixed = dict(zip(sharded, choice))
            hit = [c for c in loads if all(c[m] == v for m, v in fixed.items())]
            load = max(loads[c] for c in hit)
            if load < best_load:
                best, best_load = (choice, hit), load
        choice, hit = best
        for c in hit:
            loads[c] += costs[i]
        owner = [0] * len(shape)
        for m, v in zip(sharded, choice):
            owner[m] = v
        owners[i] = tuple(owner)
    return owners  # type: ignore[return-value]


def owner_placements(p: DTensor, owner: tuple[int, ...]) -> list[Placement]:
    """Placements that put the whole of ``p`` on ``owner`` (on every replica of replicated dims)."""
    mesh = p.device_mesh
    sharded = set(_sharded_dims(p))
    return [
        RaggedShard((0,), tuple(int(r == owner[m]) for r in range(mesh.size(m)))) if m in sharded else Replicate()
        for m in range(mesh.ndim)
    ]


def gather_to_owner(local: torch.Tensor, p: DTensor, placements: Sequence[Placement]) -> torch.Tensor:
    """The full matrix on the owner (an empty tensor elsewhere) from this rank's ``local`` part,
    laid out like ``p``'s local tensor."""
    dt = DTensor.from_local(local.view(p._local_tensor.shape), p.device_mesh, p.placements,
                            shape=p.shape, stride=contiguous_stride(p.shape), run_check=False)
    return dt.redistribute(p.device_mesh, placements).to_local()


def scatter_from_owner(full: torch.Tensor, p: DTensor, placements: Sequence[Placement]) -> torch.Tensor:
    """The inverse of :func:`gather_to_owner`: this rank's part of the owner's result."""
    dt = DTensor.from_local(full, p.device_mesh, placements, shape=p.shape,
                            stride=contiguous_stride(p.shape), run_check=False)
    return dt.redistribute(p.device_mesh, p.placements).to_local()
