"""The gloo backend's patches: what torch's ``ProcessGroupGloo`` (2.11-2.14) does that this
package works around, in one place.

* Its reduce-scatter is a whole all-reduce (twice the bytes of a ring reduce-scatter): a sum
  runs as one all-to-all and a local sum instead (:func:`reduce_scatter_by_all_to_all`, which
  :func:`ragged_placement._compat.reduce_scatter_single` calls on gloo).
* Its coalesced all-gather has no CUDA path (its plain one stages CUDA tensors through host
  memory): all-gathers of CUDA tensors are never coalesced on gloo (:func:`coalesces_all_gathers`).
* Its two worker threads per group race on a string and corrupt the heap: the groups this
  runtime creates run one, and so does every gloo group created inside
  :func:`one_worker_gloo` (the explicit opt-in for the groups a program creates itself).
  torch's class is never replaced outside that ``with`` block.
* Its worker threads, still holding work objects at interpreter finalization, now and then
  abort a finished process: a rank that is done ends with :func:`exit_without_finalization`.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import threading
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist

__all__ = [
    "coalesces_all_gathers", "coalescing", "exit_without_finalization", "gloo_supports_one_worker",
    "gloo_worker_threads", "one_worker_gloo", "reduce_scatter_by_all_to_all", "sums_by_all_to_all",
]


def sums_by_all_to_all(op, group) -> bool:
    """Whether :func:`ragged_placement._compat.reduce_scatter_single` runs ``op`` over ``group``
    as an all-to-all (a gloo sum), which no coalescing manager can hold."""
    return op == dist.ReduceOp.SUM and dist.get_backend(group) == "gloo"


def coalesces_all_gathers(group, device: torch.device) -> bool:
    """Whether several all-gathers of tensors on ``device`` over ``group`` may run as one
    coalesced collective: not on gloo with CUDA tensors, where c10d's coalesced all-gather
    (``ProcessGroupGloo::allgather_coalesced``) has no CUDA work staging them through host
    memory, as its ``allgather`` has (CONTRIBUTING.md, "Several ranks on one GPU")."""
    return not (device.type == "cuda" and dist.get_backend(group) == "gloo")


def coalescing(group) -> bool:
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


def reduce_scatter_by_all_to_all(output: torch.Tensor, input: torch.Tensor, group=None,
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


# -- gloo: one worker thread per process group ----------------------------------------------------
# torch's ProcessGroupGloo (2.11-2.14) runs a group's collectives on two worker threads. After a
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
#
# torch builds every gloo backend in ``distributed_c10d`` as ``ProcessGroupGloo(store, rank,
# size, timeout=..., [enable_reconfigure=...])`` (init_process_group, new_group and the dim groups
# of init_device_mesh alike) and takes no options for gloo from its callers. Inside
# :func:`one_worker_gloo` that name is a factory building torch's class with options of one
# worker thread; the ``with`` block's exit puts torch's class back.
_GLOO = getattr(dist.distributed_c10d, "ProcessGroupGloo", None)
_SCOPE_LOCK = threading.Lock()
_scope_depth = 0


def _one_worker_options(timeout: datetime.timedelta, enable_reconfigure: bool):
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
    if enable_reconfigure:  # torch 2.14's keyword; its options carry the same flag
        options.enable_reconfigure = True
    return options


class _OneWorkerGlooType(type):
    """The metaclass of the factory :func:`one_worker_gloo` puts in ``distributed_c10d``:
    calling it builds torch's ``ProcessGroupGloo`` with one worker thread; ``isinstance``,
    ``issubclass`` and class attributes are torch's class's."""

    def __call__(cls, store, rank: int, size: int, *args, **kwargs):
        if args and not isinstance(args[0], datetime.timedelta) or "options" in kwargs:
            return _GLOO(store, rank, size, *args, **kwargs)  # the options overload, as given
        known = dict(kwargs)
        timeout = args[0] if args else known.pop("timeout", datetime.timedelta(minutes=30))
        enable_reconfigure = known.pop("enable_reconfigure", False)
        if args[1:] or known:  # a torch newer than this code: build torch's group, say so
            warnings.warn(
                f"ragged_placement.one_worker_gloo: torch {torch.__version__} builds gloo groups "
                f"with arguments it does not know ({sorted(known)}, {len(args[1:])} more "
                f"positional); this group runs torch's default worker threads",
                stacklevel=2,
            )
            return _GLOO(store, rank, size, *args, **kwargs)
        return _GLOO(store, rank, size, _one_worker_options(timeout, enable_reconfigure))

    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, _GLOO)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, _GLOO)

    def __getattr__(cls, name: str):
        return getattr(_GLOO, name)


_ONE_WORKER = (
    _OneWorkerGlooType("ProcessGroupGloo", (), {"__doc__": "torch's ProcessGroupGloo, one worker thread"})
    if _GLOO is not None else None
)


@contextlib.contextmanager
def one_worker_gloo() -> Iterator[None]:
    """Every gloo process group created inside the ``with`` block runs one worker thread.

    torch's ``ProcessGroupGloo`` runs two worker threads per group, which free one string twice
    when two collectives of the group complete together (see above): the heap is corrupted and
    the process dies later, anywhere. ``fully_shard`` and the optimizers overlap collectives on
    their groups, so wrap the creation of the process groups they will use in this::

        with ragged_placement.one_worker_gloo():
            dist.init_process_group("gloo")
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    The groups this package creates itself (per-state sharding's, ``reshard_after_forward=N``'s)
    are always created this way. Other backends are untouched; outside the block torch's class
    is back in ``torch.distributed.distributed_c10d``. Re-entrant; a no-op on a torch without
    gloo or without the worker-thread option."""
    global _scope_depth
    if not gloo_supports_one_worker():
        yield
        return
    c10d = dist.distributed_c10d
    with _SCOPE_LOCK:
        if _scope_depth == 0:
            if c10d.ProcessGroupGloo is not _GLOO:
                raise RuntimeError(
                    f"torch.distributed.distributed_c10d.ProcessGroupGloo is "
                    f"{c10d.ProcessGroupGloo!r}, not torch's class: another library replaced it; "
                    f"ragged_placement.one_worker_gloo leaves it alone"
                )
            c10d.ProcessGroupGloo = _ONE_WORKER
        _scope_depth += 1
    try:
        yield
    finally:
        with _SCOPE_LOCK:
            _scope_depth -= 1
            if _scope_depth == 0:
                c10d.ProcessGroupGloo = _GLOO


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


def exit_without_finalization() -> None:
    """End a rank that finished its work (results written, process group destroyed) without
    the interpreter's finalization, where gloo's worker threads, still holding work objects,
    now and then abort the process ("terminate called without an active exception"; seen
    about once in 400 spawns on torch 2.13; pytorch/pytorch#179291 describes the race)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)
