"""A tour of the RaggedShard placement on 4 CPU gloo ranks.

Shows who holds what for a few placements of an [8, 4] tensor, then takes the tensor on a round
trip through every placement (Shard, Replicate, Partial, other units, a flattened prefix),
checking ``full_tensor()`` against the original after each hop.

    python examples/placement_tour.py
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

from ragged_placement import RaggedShard
from ragged_placement.testing.launch import run_gloo

warnings.filterwarnings("ignore", category=FutureWarning)


def _rows_held(local: torch.Tensor, full: torch.Tensor) -> str:
    """Which rows of ``full`` (an arange) a local tensor holds, as text."""
    if local.numel() == 0:
        return "-"
    first, last = int(local.reshape(-1)[0]), int(local.reshape(-1)[-1])
    cols = full.shape[1]
    return f"elements {first}..{last} (rows {first // cols}..{last // cols})"


def _tour(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(32.0).reshape(8, 4)
    placements = {
        "RaggedShard((0,), (1, 2, 1, 0))": [RaggedShard((0,), (1, 2, 1, 0))],
        "RaggedShard((0, 1), (3, 1, 2, 2))": [RaggedShard((0, 1), (3, 1, 2, 2))],
        "RaggedShard((0,), (0, 0, 8, 0))": [RaggedShard((0,), (0, 0, 8, 0))],
        "Shard(0)": [Shard(0)],
    }
    table = {}
    for name, pl in placements.items():
        local = distribute_tensor(full, mesh, pl).to_local()
        held = [None] * world
        dist.all_gather_object(held, (tuple(local.shape), _rows_held(local, full)))
        table[name] = held
    if rank == 0:
        print("Who holds what: an [8, 4] arange on 4 ranks\n")
        for name, held in table.items():
            print(f"  {name}")
            for r, (shape, what) in enumerate(held):
                print(f"    rank {r}: local shape {str(shape):<8} {what}")
        print("\nRound trip through every placement (full_tensor() checked after each hop):")
    hops = [
        [RaggedShard((0,), (1, 2, 1, 0))], [Shard(0)], [RaggedShard((0,), (0, 3, 0, 1))], [Shard(1)],
        [RaggedShard((0, 1), (5, 1, 0, 2))], [Replicate()], [RaggedShard((0,), (1, 2, 1, 0))],
    ]
    d = distribute_tensor(full, mesh, [Partial()])
    route = ["Partial(sum)"]
    for target in hops:
        d = d.redistribute(mesh, target)
        assert torch.equal(d.full_tensor(), full), target
        route.append(str(target[0]))
    if rank == 0:
        print("  " + " -> ".join(route) + ": ok")
        print("\nElement-wise ops and reductions on RaggedShard((0,), (1, 2, 1, 0)):")
    y = d * 2 + 1
    stats = (y.sum().full_tensor().item(), y.mean().full_tensor().item(),
             torch.linalg.vector_norm(y).full_tensor().item())
    ref = ((full * 2 + 1).sum().item(), (full * 2 + 1).mean().item(),
           torch.linalg.vector_norm(full * 2 + 1).item())
    if rank == 0:
        print(f"  sum {stats[0]:.1f} (torch {ref[0]:.1f}), mean {stats[1]:.3f} (torch {ref[1]:.3f}), "
              f"norm {stats[2]:.3f} (torch {ref[2]:.3f})")


def main() -> None:
    run_gloo(_tour, 4)


if __name__ == "__main__":
    main()
