"""Differences between the torch versions we support (2.11 and 2.13), in one place.

torch 2.13 renames ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to
``all_gather_single`` / ``reduce_scatter_single`` and deprecates the old names; 2.11 has only
the old ones. Everything in this package calls the wrappers below.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_single", "reduce_scatter_single", "all_gather_segments", "reduce_scatter_segments",
    "all_gather_parts", "reduce_scatter_parts",
    "NormPartial", "TORCH_VERSION", "SUPPORTED_TORCH", "clear_sharding_caches", "rng_offset_helpers",
    "global_tensor_info_name", "dispatcher_runs_rewritten_ops",
    "functional_all_gather", "outside_selective_checkpoint",
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


class _Works:
    """Several in-flight collectives waited on as one (``wait`` waits for all, in order)."""

    def __init__(self, works) -> None:
        self.works = [w for w in works if w is not None]

    def wait(self, timeout=None) -> bool:
        for w in self.works:
            w.wait() if timeout is None else w.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def _rank_views(buffer: torch.Tensor, starts) -> list[torch.Tensor]:
    return [buffer[starts[r]:starts[r + 1]] for r in range(len(starts) - 1)]


def _all_gather_uneven(output: torch.Tensor, input: torch.Tensor, starts, group, async_op: bool):
    """Gather rank ``r``'s ``input`` (``starts[r+1] - starts[r]`` elements) into
    ``output[starts[r]:starts[r+1]]``, zero-copy on the receiving side.

    NCCL runs torch's ``all_gather`` into a list of uneven views as one group of broadcasts. Gloo
    rejects uneven ``all_gather`` and torch's coalescing manager drops gloo broadcasts without an
    error (torch 2.13), so gloo gets one async broadcast per rank that holds elements."""
    views = _rank_views(output, starts)
    if dist.get_backend(group) != "gloo":
        return dist.all_gather(views, input, group=group, async_op=async_op)
    rank = dist.get_rank(group)
    views[rank].copy_(input)
    works = [
        dist.broadcast(v, src=dist.get_global_rank(group, r) if group is not None else r,
                       group=group, async_op=True)
        for r, v in enumerate(views) if v.numel()
    ]
    out = _Works(works)
    if async_op:
        return out
    out.wait()
    return None


def _segment_calls(segments, world_size, group, gather_call, uneven_call):
    """One thunk per segment; uneven segments (``rank_starts``) are issued apart, since the
    coalescing manager takes only equal collectives on every backend."""
    equal = [gather_call(s) for s in segments if s.rank_starts is None]
    uneven = [uneven_call(s) for s in segments if s.rank_starts is not None]
    return equal, uneven


def _run(equal, uneven, group, async_op: bool):
    if not uneven:
        return _coalesced(equal, group, async_op)
    works = [_coalesced(equal, group, True)] if equal else []
    works += [call(True) for call in uneven]
    out = _Works(works)
    if async_op:
        return out
    out.wait()
    return None


def _run_parts(calls, group, async_op: bool):
    """Run every part's ``(equal, uneven)`` calls as one collective (:func:`_run`)."""
    equal = [call for part_equal, _ in calls for call in part_equal]
    uneven = [call for _, part_uneven in calls for call in part_uneven]
    return _run(equal, uneven, group, async_op)


def _packed_sizes(segments, group) -> list[int] | None:
    """Per-segment chunk sizes when a reduce-scatter of ``segments`` runs packed, else ``None``.

    gloo runs a coalesced reduce-scatter through staging of its own, at 2.2-2.3x the time of one
    reduce-scatter of the same bytes for a GPT block's three segments (packed: 1.08-1.17x);
    separate async calls are no faster, while packing an all-gather only adds its copy-out
    (``benchmarks/collectives.py``, table in ``docs/fsdp.md``). There several equal segments
    that tile the chunk in order are reduce-scattered as one collective from a rank-major
    staging buffer that FSDP2's copy-in op fills (``torch._chunk_cat``, counted by
    :class:`~ragged_placement.fsdp.profiling.LayoutCopyMeter`). NCCL groups coalesced calls
    without copies: segments stay zero-copy there, and all-gathers everywhere."""
    if len(segments) < 2 or any(s.rank_starts is not None for s in segments):
        return None
    if dist.get_backend(group) != "gloo":
        return None
    offset = 0
    for s in segments:
        if s.chunk_offset != offset:
            return None
        offset += s.chunk_numel
    return [s.chunk_numel for s in segments]


def _reduce_scatter_packed(output, inputs, sizes, world_size, op, group):
    """A thunk reduce-scattering ``inputs`` (segments tiling ``output`` in order, chunk
    ``sizes``) as one collective from a rank-major staging buffer, filled here."""
    staging = inputs[0].new_empty(world_size, sum(sizes))
    torch._chunk_cat(list(inputs), dim=0, num_chunks=world_size, out=staging)
    # gloo's work holds ``staging`` until the collective completes
    return lambda a: reduce_scatter_single(output[:sum(sizes)], staging.view(-1), op=op,
                                           group=group, async_op=a)


def _gather_calls(output, input, segments, world_size, rank, group, as_bytes: bool):
    """The calls gathering one part: equal segments' (coalescable; of byte views of the
    segments where ``as_bytes``) and uneven ones'."""

    def equal(s):
        out = output[s.buffer_offset:s.buffer_offset + world_size * s.chunk_numel]
        inp = input[s.chunk_offset:s.chunk_offset + s.chunk_numel]
        if as_bytes:
            out, inp = out.view(torch.uint8), inp.view(torch.uint8)
        return lambda a: all_gather_single(out, inp, group=group, async_op=a)

    def uneven(s):
        lo, hi = s.rank_starts[rank], s.rank_starts[rank + 1]
        return lambda a: _all_gather_uneven(
            output[s.buffer_offset:s.buffer_offset + s.rank_starts[-1]],
            input[s.chunk_offset:s.chunk_offset + hi - lo], s.rank_starts, group, a)

    return _segment_calls(segments, world_size, group, equal, uneven)


def all_gather_parts(parts, world_size: int, group=None, async_op: bool = False):
    """All-gather several parts, each an ``(output, input, segments)`` triple as the arguments
    of :func:`all_gather_segments` (the parts may differ in dtype), as one coalesced collective
    over ``group``: every part's equal segments in one coalescing manager (one NCCL group, one
    gloo ``allgather_into_tensor_coalesced_``), uneven segments as separate calls.

    Parts of several dtypes are gathered as byte views (exact, zero-copy: an all-gather only
    moves bytes): gloo's coalesced all-gather corrupts tensors of mixed element sizes unless
    the largest comes first (torch 2.13: an fp32 part before a float64 or after a bf16 one)."""
    rank = dist.get_rank(group)
    as_bytes = len({input.dtype for _, input, _ in parts}) > 1
    calls = [_gather_calls(output, input, segments, world_size, rank, group, as_bytes)
             for output, input, segments in parts]
    return _run_parts(calls, group, async_op)


def all_gather_segments(output: torch.Tensor, input: torch.Tensor, segments, world_size: int,
                        group=None, async_op: bool = False):
    """All-gather each segment of ``input`` (a rank's chunk: segment ``k`` at
    ``[chunk_offset, chunk_offset + chunk_numel)``) into its place in ``output`` (segment ``k`` at
    ``[buffer_offset, buffer_offset + world_size * chunk_numel)``), as one coalesced collective.

    An uneven segment (``rank_starts`` set) takes rank ``r``'s first
    ``rank_starts[r+1] - rank_starts[r]`` chunk elements into ``output[buffer_offset +
    rank_starts[r]:...]`` with an uneven all-gather (see :func:`_all_gather_uneven`)."""
    return all_gather_parts([(output, input, segments)], world_size, group, async_op)


def _check_reduce_inputs(inputs, segments, world_size: int) -> None:
    """``ValueError`` unless ``inputs`` hold each segment's unsharded buffer (before any
    collective is issued)."""
    sizes = [x.numel() for x in inputs]
    want = [s.rank_starts[-1] if s.rank_starts is not None else world_size * s.chunk_numel
            for s in segments]
    if sizes != want:
        raise ValueError(
            f"inputs must hold world_size * chunk_numel elements per segment (rank_starts[-1] "
            f"for an uneven one): {want}, got {sizes}"
        )


def _reduce_calls(output, inputs, segments, world_size, op, rank, group):
    """The calls reduce-scattering one part: one packed call where :func:`_packed_sizes` says
    so, else equal segments' (coalescable) and uneven ones'."""
    packed = _packed_sizes(segments, group)
    if packed is not None:
        return [_reduce_scatter_packed(output, inputs, packed, world_size, op, group)], []
    by_segment = dict(zip(map(id, segments), inputs))

    def equal(s):
        return lambda a: reduce_scatter_single(
            output[s.chunk_offset:s.chunk_offset + s.chunk_numel], by_segment[id(s)], op=op,
            group=group, async_op=a)

    def uneven(s):
        lo, hi = s.rank_starts[rank], s.rank_starts[rank + 1]
        return lambda a: dist.reduce_scatter(
            output[s.chunk_offset:s.chunk_offset + hi - lo],
            _rank_views(by_segment[id(s)], s.rank_starts), op=op, group=group, async_op=a)

    return _segment_calls(segments, world_size, group, equal, uneven)


def reduce_scatter_parts(parts, world_size: int, op=dist.ReduceOp.SUM, group=None,
                         async_op: bool = False):
    """Reduce-scatter several parts, each an ``(output, inputs, segments)`` triple as the
    arguments of :func:`reduce_scatter_segments` (the parts may differ in dtype), as one
    coalesced collective over ``group``: every part's equal calls (a part packed on gloo is one
    of them) in one coalescing manager, uneven segments as separate calls."""
    parts = [(output, list(inputs), segments) for output, inputs, segments in parts]
    for _, inputs, segments in parts:
        _check_reduce_inputs(inputs, segments, world_size)
    rank = dist.get_rank(group)
    calls = [_reduce_calls(output, inputs, segments, world_size, op, rank, group)
             for output, inputs, segments in parts]
    return _run_parts(calls, group, async_op)


def reduce_scatter_segments(output: torch.Tensor, inputs, segments, world_size: int,
                            op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    """The inverse of :func:`all_gather_segments`: reduce each segment's unsharded buffer
    (``inputs[k]``, ``world_size * chunk_numel`` elements, or ``rank_starts[-1]`` for an uneven
    segment) and keep this rank's chunk of it in ``output`` (segment ``k`` at ``chunk_offset``),
    as one coalesced collective (uneven segments: torch's list ``reduce_scatter``, which NCCL runs
    as one group of reduces; on gloo several equal segments run packed, :func:`_packed_sizes`)."""
    return reduce_scatter_parts([(output, inputs, segments)], world_size, op, group, async_op)


@functools.cache
def dispatcher_runs_rewritten_ops() -> bool:
    """Whether DTensor's dispatcher runs ``redistribute_schema.op`` when a sharding rule names
    another op than the one called, with the rule's extra trailing arguments (torch 2.13 does; the
    op rules with a local kernel of their own need it). Read once from torch's source: False when
    the source is unreadable or lacks either step, so those rules raise instead of letting the
    original op run on the local tensor."""
    import inspect

    from torch.distributed.tensor import _dispatch

    try:
        source = inspect.getsource(_dispatch)
    except (OSError, TypeError):  # pragma: no cover - sources stripped
        return False
    return "redistribute_schema.op(" in source and "len(flatten_args_schema_to_reshard)" in source


def functional_all_gather(tensor: torch.Tensor, gather_dim: int, group) -> torch.Tensor:
    """Functional all-gather along ``gather_dim`` (torch 2.13 renames ``all_gather_tensor`` to
    ``all_gather_single`` and deprecates the old name; 2.11 has only the old one)."""
    import torch.distributed._functional_collectives as funcol

    fn = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    return fn(tensor, gather_dim, group)


@contextlib.contextmanager
def outside_selective_checkpoint() -> Iterator[None]:
    """Run the FSDP hooks' own tensor ops (all-gathers, casts, views of the flat buffers) outside
    the dispatch modes of selective activation checkpointing, when a checkpointed region holds a
    unit's hooks (``checkpoint(fsdp_block, x, context_fn=...)``): those modes cache and replay ops
    by call index per op, and collectives the forward issues but the recomputation does not (or
    the other way round) would shift the index of the model's own ops. The mode classes are
    private to ``torch.utils.checkpoint`` (same names in torch 2.11 and 2.13)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode_temporarily
    from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode

    modes = (_CachingTorchDispatchMode, _CachedTorchDispatchMode)
    with contextlib.ExitStack() as stack:
        while (stack_now := _get_current_dispatch_mode_stack()) and isinstance(stack_now[-1], modes):
            stack.enter_context(_pop_mode_temporarily())
        yield
