"""``reference_local``: the local tensor a rank holds under any placements, computed from the
full tensor by slicing (the reference of the placement property tests and the random-op tests).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Shard

from ragged_placement import RaggedShard


def reference_local(t: torch.Tensor, mesh_shape, coord, placements) -> torch.Tensor:
    """The local tensor a rank at ``coord`` holds, by definition (placements in mesh-dim order)."""
    x = t
    for m, p in enumerate(placements):
        n, c = mesh_shape[m], coord[m]
        if isinstance(p, Shard):
            size = x.shape[p.dim]
            full = -(-size // n)
            start = min(full * c, size)
            x = x.narrow(p.dim, start, min(full, size - start))
        elif isinstance(p, RaggedShard):
            if len(p.local_units) != n:
                raise ValueError("units do not match the mesh dim")
            k, sf = len(p.dims), p.split_factor
            rows = math.prod(x.shape[:k])
            total = sum(p.local_units) * sf
            if rows % total:
                raise ValueError("not divisible")
            unit, block = rows // total, rows // sf
            start = unit * sum(p.local_units[:c])
            flat = x.reshape(rows, *x.shape[k:])
            x = torch.cat([flat[b * block + start: b * block + start + unit * p.local_units[c]] for b in range(sf)])
    return x
