"""Differences between the torch versions we support (2.11 and 2.13), in one place.

torch 2.13 renames ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to
``all_gather_single`` / ``reduce_scatter_single`` and deprecates the old names; 2.11 has only
the old ones. Everything in this package calls the wrappers below.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_single", "reduce_scatter_single", "all_gather_segments", "reduce_scatter_segments",
    "NormPartial", "TORCH_VERSION", "SUPPORTED_TORCH", "clear_sharding_caches", "rng_offset_helpers",
    "global_tensor_info_name", "local_shape_helper_bindings",
]

TORCH_VERSION: tuple[int, int] = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])  # type: ignore[assignment]
SUPPORTED_TORCH = ((2, 11), (2, 13))

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """Gather equal-sized ``input`` from every rank of ``group`` into ``output`` (rank order)."""
    return _all_gather(output, input, group=group, async_op=async_op)


def reduce_scatter_single(
    output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False
):
    """Reduce ``input`` over ``group`` and keep this rank's equal chunk in ``output``."""
    return _reduce_scatter(output, input, op=op, group=group, async_op=async_op)


# The Partial placement torch uses for pending p-norms (module moved between releases).
try:
    from torch.distributed.tensor._ops._math_ops import _NormPartial as NormPartial
except ImportError:  # pragma: no cover - layout of other releases
    from torch.distributed.tensor._ops.math_ops import _NormPartial as NormPartial  # type: ignore[no-redef]


def global_tensor_info_name() -> str:
    """What ``torch.distributed.tensor._api.compute_global_tensor_info`` is (``from_local``'s
    shape inference): a C++ function in torch 2.13, the Python one of ``_utils`` before."""
    if hasattr(torch._C, "_DTensor_compute_global_tensor_info"):
        return "torch._C._DTensor_compute_global_tensor_info"
    return "torch.distributed.tensor._utils.compute_global_tensor_info"  # pragma: no cover


def local_shape_helper_bindings() -> tuple[str, ...]:
    """Modules other than ``torch.distributed.tensor._utils`` that bind
    ``_compute_local_shape_and_global_offset`` by name (the others call it through ``_utils``)."""
    import importlib

    candidates = ("torch.distributed.tensor.debug._visualize_sharding",)
    return tuple(m for m in candidates
                 if hasattr(importlib.import_module(m), "_compute_local_shape_and_global_offset"))


def rng_offset_helpers() -> tuple[str, ...]:
    """The module-level helpers of ``torch.distributed.tensor._random`` that map a spec to RNG
    offsets (``_calc_first_shard_size``, ``_calc_shard_info`` in torch 2.13; releases that keep
    them as tracker methods have none)."""
    from torch.distributed.tensor import _random

    return tuple(name for name in ("_calc_first_shard_size", "_calc_shard_info") if hasattr(_random, name))


def clear_sharding_caches() -> None:
    """Clear DTensor's sharding-propagation caches (the Python LRU and the C++ fast path's)."""
    from torch.distributed.tensor import debug

    clear = getattr(debug, "_clear_sharding_prop_cache", None)
    if clear is not None:
        clear()
    else:  # pragma: no cover - releases without the fast-path cache
        debug._clear_python_sharding_prop_cache()


def concatenate_meshes(meshes: list):
    """The mesh whose dims are the dims of ``meshes`` (disjoint sub-meshes of one root), in order.

    ``RuntimeError`` when they do not share a root mesh or overlap."""
    from torch.distributed.device_mesh import DeviceMesh

    concat = getattr(DeviceMesh, "_concatenate", None)
    if concat is not None:
        return concat(meshes)
    # Older releases: index the root mesh by the concatenated dim names.
    from torch.distributed.device_mesh import _mesh_resources

    root = _mesh_resources.get_root_mesh(meshes[0])
    if any(_mesh_resources.get_root_mesh(m) is not root for m in meshes):
        raise RuntimeError(f"meshes {meshes} do not share a root mesh")
    names = tuple(n for m in meshes for n in (m.mesh_dim_names or ()))
    if len(names) != sum(m.ndim for m in meshes) or len(set(names)) != len(names):
        raise RuntimeError(f"meshes {meshes} need distinct dim names to be concatenated")
    return root[names]


def _coalesced(calls, group, async_op: bool):
    """Run ``calls`` (thunks issuing collectives) as one coalesced collective (one NCCL group /
    one gloo ``*_coalesced`` op); a single call runs as itself."""
    if len(calls) == 1:
        return calls[0](async_op)
    with dist._coalescing_manager(group=group, async_ops=True) as cm:
        for call in calls:
            call(True)
    if async_op:
        return cm
    cm.wait()
    return None


def all_gather_segments(output: torch.Tensor, input: torch.Tensor, segments, world_size: int,
                        group=None, async_op: bool = False):
    """All-gather each segment of ``input`` (a rank's chunk: segment ``k`` at
    ``[chunk_offset, chunk_offset + chunk_numel)``) into its place in ``output`` (segment ``k`` at
    ``[buffer_offset, buffer_offset + world_size * chunk_numel)``), as one coalesced collective."""
    calls = [
        (lambda a, s=s: all_gather_single(
            output[s.buffer_offset:s.buffer_offset + world_size * s.chunk_numel],
            input[s.chunk_offset:s.chunk_offset + s.chunk_numel], group=group, async_op=a))
        for s in segments
    ]
    return _coalesced(calls, group, async_op)


def reduce_scatter_segments(output: torch.Tensor, inputs, segments, world_size: int,
                            op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    """The inverse of :func:`all_gather_segments`: reduce each segment's unsharded buffer
    (``inputs[k]``, ``world_size * chunk_numel`` elements) and keep this rank's chunk of it in
    ``output`` (segment ``k`` at ``chunk_offset``), as one coalesced collective."""
    inputs = list(inputs)
    sizes = [x.numel() for x in inputs]
    if sizes != [world_size * s.chunk_numel for s in segments]:
        raise ValueError(
            f"inputs must hold world_size * chunk_numel elements per segment "
            f"({[world_size * s.chunk_numel for s in segments]}), got {sizes}"
        )
    calls = [
        (lambda a, s=s, x=x: reduce_scatter_single(
            output[s.chunk_offset:s.chunk_offset + s.chunk_numel], x, op=op, group=group,
            async_op=a))
        for s, x in zip(segments, inputs)
    ]
    return _coalesced(calls, group, async_op)
