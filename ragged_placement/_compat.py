"""Differences between the torch versions we support (2.11 and 2.13), and between c10d
backends, in one place.

torch 2.13 renames ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to
``all_gather_single`` / ``reduce_scatter_single`` and deprecates the old names; 2.11 has only
the old ones. torch's gloo backend runs a reduce-scatter as a whole all-reduce (twice the bytes
of a ring reduce-scatter); :func:`reduce_scatter_single` runs a gloo sum as an all-to-all
instead. Everything in this package calls the wrappers below.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib
import inspect
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_single", "reduce_scatter_single",
    "NormPartial", "TORCH_VERSION", "SUPPORTED_TORCH", "clear_sharding_caches", "rng_offset_helpers",
    "global_tensor_info_name", "dispatcher_runs_rewritten_ops",
    "functional_all_gather", "outside_selective_checkpoint", "DataParallelMeshDims",
    "new_group_in_order", "sums_by_all_to_all", "one_worker_gloo", "gloo_worker_threads",
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
    """Reduce ``input`` over ``group`` and keep this rank's equal chunk in ``output``.

    On gloo a sum runs as :func:`_reduce_scatter_by_all_to_all`, except inside a coalescing
    manager (which holds only c10d's reduce-scatters); other backends and ops run c10d's."""
    if sums_by_all_to_all(op, group) and not _coalescing(group):
        return _reduce_scatter_by_all_to_all(output, input, group=group, async_op=async_op)
    return _reduce_scatter(output, input, op=op, group=group, async_op=async_op)


def sums_by_all_to_all(op, group) -> bool:
    """Whether :func:`reduce_scatter_single` runs ``op`` over ``group`` as an all-to-all (a
    gloo sum), which no coalescing manager can hold."""
    return op == dist.ReduceOp.SUM and dist.get_backend(group) == "gloo"


def coalesces_all_gathers(group, device: torch.device) -> bool:
    """Whether several all-gathers of tensors on ``device`` over ``group`` may run as one
    coalesced collective: not on gloo with CUDA tensors, where c10d's coalesced all-gather
    (``ProcessGroupGloo::allgather_coalesced``) has no CUDA work staging them through host
    memory, as its ``allgather`` has (CONTRIBUTING.md, "Several ranks on one GPU")."""
    return not (device.type == "cuda" and dist.get_backend(group) == "gloo")


def _coalescing(group) -> bool:
    """Whether ``group`` is inside ``dist._coalescing_manager`` (which records its collectives
    and issues them at its exit)."""
    c10d = dist.distributed_c10d
    return (group or c10d._get_default_group()) in c10d._world.pg_coalesce_state


class _SumOnWait:
    """An all-to-all in flight whose ``received`` chunks (one per rank, rank order) are summed
    into ``output`` by the first :meth:`wait` (c10d's ``Work`` surface)."""

    def __init__(self, work: dist.Work, received: torch.Tensor, output: torch.Tensor) -> None:
        self._work: dist.Work | None = work
        self._received: torch.Tensor | None = received
        self._output = output

    def wait(self, timeout=None) -> bool:
        if self._work is not None:
            self._work.wait() if timeout is None else self._work.wait(timeout)
            received, self._received, self._work = self._received, None, None
            _sum_chunks(received, self._output)
        return True

    def is_completed(self) -> bool:
        """``True`` once waited on (the sum runs in :meth:`wait`)."""
        return self._work is None


def _reduce_scatter_by_all_to_all(output: torch.Tensor, input: torch.Tensor, group=None,
                                  async_op: bool = False):
    """A sum reduce-scatter as one all-to-all of ``input``'s rank chunks and a local sum of the
    chunks received: every rank sends ``(n-1)/n`` of ``input``, a ring reduce-scatter's bytes.

    torch's gloo backend runs ``reduce_scatter_single`` as an all-reduce of the whole input
    (``2 (n-1)/n`` of it sent) followed by a copy. Measured with ``benchmarks/gloo_reduce_scatter.py``
    (fp32, 4 ranks as two emulated nodes, ``docs/fsdp.md``): faster across the 1 Gbit/s link
    and inside a node, 1.5-3x. The sum runs in rank order on this rank
    (``torch.sum``, which accumulates a bf16 input in fp32): in fp32 over two ranks it equals
    gloo's bitwise; otherwise to rounding."""
    received = torch.empty_like(input)
    work = dist.all_to_all_single(received, input, group=group, async_op=async_op)
    if async_op:
        return _SumOnWait(work, received, output)
    _sum_chunks(received, output)
    return None


def _sum_chunks(received: torch.Tensor, output: torch.Tensor) -> None:
    """``output`` = the sum of ``received``'s rank chunks (``output``-sized, rank order)."""
    torch.sum(received.view(-1, output.numel()), dim=0, out=output)


def new_group_in_order(ranks: list[int]) -> dist.ProcessGroup:
    """A process group whose group rank ``i`` is ``ranks[i]``, created by its members only
    (``use_local_synchronization``). ``new_group`` sorts the ranks; torch 2.13 keeps the given
    order with ``sort_ranks=False`` (pytorch/pytorch#176580). Before that, ``new_group``'s one
    ``sorted(ranks)`` is shadowed for the call (what ``sort_ranks=False`` skips), and the result
    is checked: ``RuntimeError`` if the group does not list ``ranks`` in their order."""
    ranks = list(ranks)
    if ranks == sorted(ranks):
        return dist.new_group(ranks, use_local_synchronization=True)
    if "sort_ranks" in inspect.signature(dist.new_group).parameters:
        group = dist.new_group(ranks, use_local_synchronization=True, sort_ranks=False)
    else:
        c10d = dist.distributed_c10d
        c10d.sorted = list  # type: ignore[attr-defined]
        try:
            group = dist.new_group(ranks, use_local_synchronization=True)
        finally:
            del c10d.sorted
    if dist.get_process_group_ranks(group) != ranks:
        raise RuntimeError(
            f"torch {torch.__version__} created a process group over {ranks} in the order "
            f"{dist.get_process_group_ranks(group)}: this state_sharding needs the given order"
        )
    return group


# -- gloo: one worker thread per process group ----------------------------------------------------
# torch's ProcessGroupGloo (2.11, 2.13) runs a group's collectives on two worker threads. After a
# collective completes, its thread records the op's name (ProcessGroupGloo::runLoop:
# ``pgStatus_->lastCompletedWorkName = opTypeToString(work->opType_)``) outside the work queue's
# lock: when two collectives of one group complete together, both threads assign the one
# std::string, and a name too long for the short-string buffer ("ALLGATHER_COALESCED",
# "_REDUCE_SCATTER_BASE") is freed twice. glibc then aborts ("malloc(): unaligned tcache chunk
# detected", a SIGSEGV or SIGABRT later in any thread); AddressSanitizer (libasan preloaded)
# names it: "attempting double-free ... in c10d::ProcessGroupGloo::runLoop", freed by the other
# worker thread. Overlapped collectives on one group (prefetched all-gathers, a reduce-scatter
# beside the next all-gather, the per-rank broadcasts of an uneven all-gather) make it likely.
# With one worker thread per group the name has one writer; collectives of a group run one
# after the other (gloo runs them over one set of connections either way), those of different
# groups still overlap.
_GLOO = getattr(dist.distributed_c10d, "ProcessGroupGloo", None)


def _one_worker_options(timeout: datetime.timedelta):
    """The options torch's ``ProcessGroupGloo(store, rank, size, timeout)`` builds (its devices
    from ``GLOO_SOCKET_IFNAME``, else the default device), with one worker thread."""
    options = _GLOO._Options()
    options._timeout = timeout
    interfaces = os.environ.get("GLOO_SOCKET_IFNAME", "")
    if len(interfaces) > 1:  # torch's test
        options._devices = [_GLOO.create_device(interface=i) for i in interfaces.split(",")]
    else:
        options._devices = [_GLOO.create_default_device()]
    options._threads = 1
    return options


class _OneWorkerGlooType(type):
    """The metaclass of :func:`one_worker_gloo`'s stand-in: calling the class builds a
    ``ProcessGroupGloo`` with one worker thread; ``isinstance``, ``issubclass`` and class
    attributes are ``ProcessGroupGloo``'s."""

    def __call__(cls, store, rank: int, size: int,
                 timeout: object = datetime.timedelta(minutes=30)):
        if not isinstance(timeout, datetime.timedelta):  # the options overload, as given
            return _GLOO(store, rank, size, timeout)
        return _GLOO(store, rank, size, _one_worker_options(timeout))

    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, _GLOO)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, _GLOO)

    def __getattr__(cls, name: str):
        return getattr(_GLOO, name)


def one_worker_gloo(original: type) -> type:
    """What ``torch.distributed.distributed_c10d`` constructs gloo backends with (the
    ``ProcessGroupGloo`` it names), so that every gloo process group created afterwards
    (``init_process_group``, ``new_group``, ``init_device_mesh``) runs one worker thread: the
    workaround for torch's race described above. ``original``: torch's class."""
    if original is not _GLOO:
        raise ImportError(f"expected torch's ProcessGroupGloo, found {original!r}")
    return _OneWorkerGlooType("ProcessGroupGloo", (), {"__doc__": one_worker_gloo.__doc__})


def gloo_supports_one_worker() -> bool:
    """Whether this torch has gloo and the options :func:`one_worker_gloo` sets."""
    return _GLOO is not None and hasattr(_GLOO._Options(), "_threads")


def gloo_worker_threads(group) -> int | None:
    """The worker threads of ``group``'s gloo backend (``None``: the group has none, or this
    torch does not say). More than one exposes the group to torch's race (see above)."""
    if _GLOO is None or group is None:
        return None
    try:
        backend = group._get_backend(torch.device("cpu"))
    except (RuntimeError, AttributeError):
        return None
    if not isinstance(backend, _GLOO):
        return None
    return getattr(backend.options, "_threads", None)


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


# torch FSDP2's full-SPMD-mesh argument of fully_shard (torch 2.13; absent in 2.11: None).
DataParallelMeshDims: type | None = getattr(
    importlib.import_module("torch.distributed.fsdp"), "DataParallelMeshDims", None
)
