"""Differences between the torch versions we support (2.11 through 2.14), in one place.

torch 2.13 renames ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to
``all_gather_single`` / ``reduce_scatter_single`` and deprecates the old names; 2.11 has only
the old ones. Everything in this package calls the wrappers below; :func:`reduce_scatter_single`
also runs a gloo sum as an all-to-all (:mod:`ragged_placement._gloo`, the gloo backend's
patches).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import threading
from collections.abc import Iterator

import torch
import torch.distributed as dist

from ragged_placement._gloo import coalescing, one_worker_gloo, reduce_scatter_by_all_to_all, sums_by_all_to_all

__all__ = [
    "all_gather_single", "reduce_scatter_single", "all_gather_coalesced", "reduce_scatter_coalesced",
    "NormPartial", "TORCH_VERSION", "SUPPORTED_TORCH", "clear_sharding_caches", "rng_offset_helpers",
    "global_tensor_info_name", "dispatcher_runs_rewritten_ops",
    "functional_all_gather", "outside_selective_checkpoint", "DataParallelMeshDims",
    "new_group_in_order", "ShardPlacementResult", "torchtitan_unsupported",
    "install_threaded_pg", "uninstall_threaded_pg", "keep_fake_cuda_guard_alive",
]

TORCH_VERSION: tuple[int, int] = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])  # type: ignore[assignment]
SUPPORTED_TORCH = ((2, 11), (2, 12), (2, 13), (2, 14))

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """Gather equal-sized ``input`` from every rank of ``group`` into ``output`` (rank order)."""
    return _all_gather(output, input, group=group, async_op=async_op)


def reduce_scatter_single(
    output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False
):
    """Reduce ``input`` over ``group`` and keep this rank's equal chunk in ``output``.

    On gloo a sum runs as :func:`~ragged_placement._gloo.reduce_scatter_by_all_to_all`, except
    inside a coalescing manager (which holds only c10d's reduce-scatters); other backends and ops
    run c10d's."""
    if sums_by_all_to_all(op, group) and not coalescing(group):
        return reduce_scatter_by_all_to_all(output, input, group=group, async_op=async_op)
    return _reduce_scatter(output, input, op=op, group=group, async_op=async_op)


# ProcessGroup's coalesced collectives: torch 2.13 renames ``allgather_into_tensor_coalesced`` /
# ``reduce_scatter_tensor_coalesced`` to ``all_gather_single_coalesced`` /
# ``reduce_scatter_single_coalesced`` (2.11 has only the old names).
_PG = dist.ProcessGroup
_pg_all_gather_coalesced = (getattr(_PG, "all_gather_single_coalesced", None)
                            or _PG.allgather_into_tensor_coalesced)
_pg_reduce_scatter_coalesced = (getattr(_PG, "reduce_scatter_single_coalesced", None)
                                or _PG.reduce_scatter_tensor_coalesced)


def _wait_unless_async(work, async_op: bool):
    """``work`` for an asynchronous call; otherwise wait for it and return ``None``, as
    ``torch.distributed``'s collectives do."""
    if async_op:
        return work
    work.wait()
    return None


def all_gather_coalesced(outputs: list[torch.Tensor], inputs: list[torch.Tensor], group,
                         async_op: bool = False):
    """Gather each ``inputs[i]`` (equal-sized on every rank) into ``outputs[i]`` as one
    coalesced collective over ``group`` (a process group, not ``None``): the call torch's
    coalescing manager makes for several ``all_gather_single`` calls (one NCCL group, one gloo
    ``allgather_into_tensor_coalesced``), without the manager's per-call Python."""
    from torch.distributed.distributed_c10d import AllgatherOptions

    opts = AllgatherOptions()
    opts.asyncOp = async_op
    return _wait_unless_async(_pg_all_gather_coalesced(group, outputs, inputs, opts), async_op)


def reduce_scatter_coalesced(outputs: list[torch.Tensor], inputs: list[torch.Tensor], op, group,
                             async_op: bool = False):
    """Reduce each ``inputs[i]`` over ``group`` (a process group, not ``None``) and keep this
    rank's equal chunk in ``outputs[i]``, as one coalesced collective: the call torch's
    coalescing manager makes for several ``reduce_scatter_single`` calls (not gloo's sums,
    which :func:`reduce_scatter_single` runs as all-to-alls)."""
    from torch.distributed.distributed_c10d import ReduceScatterOptions

    opts = ReduceScatterOptions()
    opts.reduceOp = op
    opts.asyncOp = async_op
    return _wait_unless_async(_pg_reduce_scatter_coalesced(group, outputs, inputs, opts),
                              async_op)


def new_group_in_order(ranks: list[int]) -> dist.ProcessGroup:
    """A process group whose group rank ``i`` is ``ranks[i]``, created by its members only
    (``use_local_synchronization``). ``new_group`` sorts the ranks; torch 2.13 keeps the given
    order with ``sort_ranks=False`` (pytorch/pytorch#176580). Before that, ``new_group``'s one
    ``sorted(ranks)`` is shadowed for the call (what ``sort_ranks=False`` skips), and the result
    is checked: ``RuntimeError`` if the group does not list ``ranks`` in their order. A gloo
    group runs one worker thread (:func:`ragged_placement._gloo.one_worker_gloo`)."""
    with one_worker_gloo():
        return _new_group_in_order(list(ranks))


# Whether ``new_group`` keeps the given rank order on request (torch 2.13+). Read from c10d's own
# function: ``dist.new_group`` may be wrapped (a test's recorder) and hide its parameters.
_NEW_GROUP_SORT_RANKS = "sort_ranks" in inspect.signature(dist.distributed_c10d.new_group).parameters
# Before 2.13: ``new_group``'s ``sorted`` is shadowed while any thread is inside one of our calls
# (threaded ranks create their groups at once); the last one out removes the shadow.
_unsorted_lock = threading.Lock()
_unsorted_calls = 0


@contextlib.contextmanager
def _new_group_keeps_order() -> Iterator[None]:
    global _unsorted_calls
    c10d = dist.distributed_c10d
    with _unsorted_lock:
        if _unsorted_calls == 0:
            c10d.sorted = list  # type: ignore[attr-defined]
        _unsorted_calls += 1
    try:
        yield
    finally:
        with _unsorted_lock:
            _unsorted_calls -= 1
            if _unsorted_calls == 0:
                del c10d.sorted


def _new_group_in_order(ranks: list[int]) -> dist.ProcessGroup:
    if ranks == sorted(ranks):
        return dist.new_group(ranks, use_local_synchronization=True)
    if _NEW_GROUP_SORT_RANKS:
        group = dist.new_group(ranks, use_local_synchronization=True, sort_ranks=False)
    else:
        with _new_group_keeps_order():
            group = dist.new_group(ranks, use_local_synchronization=True)
    if dist.get_process_group_ranks(group) != ranks:
        raise RuntimeError(
            f"torch {torch.__version__} created a process group over {ranks} in the order "
            f"{dist.get_process_group_ranks(group)}: this state_sharding needs the given order"
        )
    return group


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

# FSDP2's per-parameter mesh result of shard_placement_fn, ``ShardPlacementResult(placement,
# mesh_info)`` (torch 2.13, in its private ``_fsdp_common``; torchtitan's MoE recipe returns it for
# expert parameters under expert parallelism). Absent in 2.11: None.
try:
    ShardPlacementResult: type | None = getattr(
        importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_common"),
        "ShardPlacementResult", None,
    )
except ImportError:  # pragma: no cover - a torch without FSDP2's private module
    ShardPlacementResult = None


def torchtitan_unsupported() -> str | None:
    """Why torchtitan 0.3.0's trainer cannot run on this torch, or ``None`` when it can.

    torchtitan 0.3.0 is written for torch 2.14: its trainer calls ``torch.distributed.set_timeout``
    (``set_pg_timeouts``) and, under pipeline parallelism, ``pp_schedule.step(arg_mbs=...,
    kwarg_mbs=...)``, both new in 2.14. The torchtitan harness (``tests/train/titan``) skips with
    this reason rather than standing in for them."""
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    missing = []
    if not hasattr(dist, "set_timeout"):
        missing.append("torch.distributed.set_timeout")
    step = inspect.signature(_PipelineSchedule.step).parameters
    if not {"arg_mbs", "kwarg_mbs"} <= step.keys():
        missing.append("PipelineSchedule.step's arg_mbs/kwarg_mbs arguments")
    if not missing:
        return None
    return (f"torchtitan 0.3.0 is written for torch 2.14: torch {torch.__version__} lacks "
            + " and ".join(missing))


# -- FakeTensorMode's CUDA device guard ------------------------------------------------------------
# ``FakeTensorMode.__enter__`` (which DTensor's sharding propagation enters for every op it has not
# cached), on a CUDA build that sees no CUDA device, calls ``torch._C._ensureCUDADeviceGuardSet()``:
# it makes a no-op CUDA guard and stores it in the process-wide device-guard registry. torch 2.11
# keeps that guard in a ``thread_local`` of the calling thread, so when the thread exits the
# registry points at freed memory, and the next FakeTensorMode entry on any thread calls a method
# on it: a segfault (torch 2.12 fixes it, pytorch/pytorch#178950). The guard is installed once per
# process, by the first thread that enters a fake mode.
_FAKE_CUDA_GUARD_DIES_WITH_ITS_THREAD = TORCH_VERSION < (2, 12)
_guard_lock = threading.Lock()
_guard_owner: threading.Thread | None = None


def keep_fake_cuda_guard_alive() -> None:
    """Install FakeTensorMode's no-op CUDA device guard from a thread that never exits (idempotent).

    On torch 2.11 with no CUDA device, the guard FakeTensorMode installs is freed when the thread
    that installed it exits, and the next fake mode on any thread segfaults (see above); this
    runs torch's own installer, ``torch._C._ensureCUDADeviceGuardSet()``, on a daemon thread that
    waits forever, so the guard lives as long as the process. It is what torch does at the first
    fake-mode entry anyway, done earlier and on a thread that stays. Called when RaggedShard
    support installs (:func:`ragged_placement._install.install`) and before threaded ranks start
    (:func:`install_threaded_pg`): it must run before any short-lived thread enters a fake mode.
    A no-op where the guard is not thread-owned (torch 2.12+) or a CUDA device is visible (torch
    then keeps the real CUDA guard)."""
    global _guard_owner
    if _guard_owner is not None or not _FAKE_CUDA_GUARD_DIES_WITH_ITS_THREAD:
        return
    if torch.cuda.is_available():
        return
    with _guard_lock:
        if _guard_owner is not None:
            return
        installed = threading.Event()

        def own_the_guard() -> None:
            torch._C._ensureCUDADeviceGuardSet()
            installed.set()
            threading.Event().wait()  # the guard is this thread's: the thread must not exit

        owner = threading.Thread(target=own_the_guard, name="ragged_placement:fake-cuda-guard", daemon=True)
        owner.start()
        installed.wait()
        _guard_owner = owner


# -- torch's threaded process-group world (tests' run_threaded) ------------------------------------
def install_threaded_pg():
    """Install the per-thread c10d world of torch's ``threaded`` test backend
    (``torch.testing._internal.distributed.multi_threaded_pg._install_threaded_pg``) and return it.

    torch 2.11's world has no ``comms`` list, which its own ``destroy_process_group`` reads
    (``_world.comms``, the torchcomms objects; 2.12 adds it to the threaded world): there each
    rank's ``destroy_process_group`` raised ``AttributeError`` and its peers waited forever. On
    such a torch the installed world is replaced by one of the same class with a per-thread
    ``comms`` list, as 2.12's. Rank threads enter fake modes and exit: FakeTensorMode's CUDA guard
    is first made to outlive them (:func:`keep_fake_cuda_guard_alive`)."""
    from torch.testing._internal.distributed import multi_threaded_pg

    keep_fake_cuda_guard_alive()

    world = multi_threaded_pg._install_threaded_pg()
    if not hasattr(type(world), "comms"):
        world = _threaded_world_with_comms(type(world))()
        dist.distributed_c10d._world = world
    return world


def uninstall_threaded_pg() -> None:
    """Put back the c10d world :func:`install_threaded_pg` replaced, with autograd's
    multithreading on again: the install turned it off, and torch 2.11's uninstall leaves it off
    for the rest of the process (2.12 restores it)."""
    from torch.testing._internal.distributed import multi_threaded_pg

    multi_threaded_pg._uninstall_threaded_pg()
    if (ctx := getattr(multi_threaded_pg, "_ctx_manager", None)) is not None:
        ctx.__exit__(None, None, None)
        multi_threaded_pg._ctx_manager = None


@functools.cache
def _threaded_world_with_comms(world_type: type) -> type:
    """``world_type`` (torch's ``ThreadLocalWorld``) with a per-thread ``comms`` list."""
    import threading

    comms = threading.local()

    def get(self) -> list:
        if not hasattr(comms, "list"):
            comms.list = []
        return comms.list

    return type(world_type.__name__, (world_type,), {"comms": property(get)})
