"""Profiling a device mesh's collectives for ``plan_state_sharding(bandwidth="profile")``: per
group of mesh dims, a bandwidth and a latency fitted to measured all-gathers and
reduce-scatters."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence
from itertools import product
from typing import TYPE_CHECKING

import numpy as np
import torch

from ragged_placement.planner.sharding import mesh_dims

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["PROFILE_NUMELS", "profile_mesh"]

# fp32 elements per rank per collective: 4 MB-64 MB chunks on GPUs (NCCL reaches its bus
# bandwidth there), 16 KB-1 MB on CPU (gloo, tests)
PROFILE_NUMELS = {"cuda": (1 << 20, 1 << 22, 1 << 24), "cpu": (1 << 12, 1 << 15, 1 << 18)}


#: Measurements of one group before :func:`profile_mesh` gives up: on a busy host a burst of
#: load can make a small message slower than a large one (seen on 2 loaded cores).
PROFILE_ATTEMPTS = 3


def _timed(fn, device: torch.device, reps: int) -> float:
    import torch.distributed as dist

    fn()  # warm-up
    times = []
    for _ in range(reps):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times)


def _subgroup(mesh: DeviceMesh, dims: tuple[str, ...]):
    """This rank's process group over ``dims`` of ``mesh`` (every rank creates every group)."""
    import torch.distributed as dist

    if len(dims) == 1:
        return mesh.get_group(dims[0])
    names = list(mesh.mesh_dim_names)
    axes = [i for i, d in enumerate(names) if d not in dims] + [names.index(d) for d in dims]
    size = math.prod(mesh.size(names.index(d)) for d in dims)
    ranks = mesh.mesh.permute(axes).reshape(-1, size).tolist()
    return dist.new_subgroups_by_enumeration(ranks)[0]


def profile_mesh(mesh: DeviceMesh, numels: Sequence[int] | None = None,
                 reps: int = 5) -> dict[tuple[str, ...], tuple[float, float]]:
    """Measure ``(bandwidth, latency)`` of the collectives over each group of mesh dims
    (collective: every rank calls it).

    Groups: each dim, and each set of several dims (in mesh order) when ``mesh`` spans the
    whole world (their process groups are made with ``new_subgroups_by_enumeration``, which
    every rank of the world must call); groups of one rank are skipped. For each group, an
    all-gather and a reduce-scatter of fp32 chunks of each of ``numels`` elements per rank
    (default :data:`PROFILE_NUMELS` of the mesh's device type), the fastest of ``reps`` after a
    warm-up (the least disturbed); each rank's times are maxed over the world (every rank fits the same numbers) and
    ``t = latency * (n - 1) + bytes / bandwidth`` (``bytes = (n - 1) * chunk bytes``) is fitted
    by least squares (latency clamped at 0, then the slope refitted through the origin).

    A group whose times fit no positive bandwidth is measured again, up to
    :data:`PROFILE_ATTEMPTS` times in all.

    Raises:
        RuntimeError: in every attempt the measured times did not grow with message size (no
            positive bandwidth fits): pass ``bandwidth`` explicitly.
    """
    import torch.distributed as dist

    from ragged_placement._compat import all_gather_single, reduce_scatter_single

    sizes = mesh_dims(mesh)
    device = torch.device(mesh.device_type, torch.cuda.current_device()) \
        if mesh.device_type == "cuda" else torch.device(mesh.device_type)
    numels = numels or PROFILE_NUMELS.get(mesh.device_type, PROFILE_NUMELS["cuda"])
    names = list(sizes)
    subsets = [tuple(d for d, keep in zip(names, mask) if keep)
               for mask in product((False, True), repeat=len(names)) if any(mask)]
    if mesh.size() != dist.get_world_size():
        subsets = [d for d in subsets if len(d) == 1]
    fits = {}
    for dims in sorted(subsets, key=len):
        n = math.prod(sizes[d] for d in dims)
        if n == 1:
            continue
        group = _subgroup(mesh, dims)
        for attempt in range(PROFILE_ATTEMPTS):
            xs, ts = [], []
            for numel in numels:
                small = torch.ones(numel, device=device)
                big = torch.ones(numel * n, device=device)
                for fn, args in ((all_gather_single, (big, small)), (reduce_scatter_single, (small, big))):
                    xs.append((n - 1) * numel * 4)
                    ts.append(_timed(functools.partial(fn, *args, group=group), device, reps))
            t = torch.tensor(ts, dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            # every rank holds the same times, so every rank takes the same branch here
            try:
                fits[dims] = _fit(np.array(xs, dtype=np.float64), t.cpu().numpy(), n - 1, dims)
                break
            except RuntimeError:
                if attempt == PROFILE_ATTEMPTS - 1:
                    raise
    return fits


def _fit(x: np.ndarray, t: np.ndarray, steps: int, dims: tuple[str, ...]) -> tuple[float, float]:
    """``(bandwidth, latency)`` of ``t = latency * steps + x / bandwidth``, least squares."""
    slope, intercept = np.polyfit(x, t, 1)
    if intercept < 0:
        slope, intercept = float(x @ t / (x @ x)), 0.0
    if not slope > 0:
        raise RuntimeError(
            f"profile of mesh dims {dims}: collective times {t.tolist()} do not grow with the "
            f"bytes {x.tolist()}; pass bandwidth explicitly"
        )
    return float(1.0 / slope), float(intercept / steps)
