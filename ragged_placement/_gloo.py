"""The gloo backend's patches: what torch's ``ProcessGroupGloo`` (2.11, 2.13) does that this
package works around, in one place.

* Its reduce-scatter is a whole all-reduce (twice the bytes of a ring reduce-scatter): a sum
  runs as one all-to-all and a local sum instead (:func:`reduce_scatter_by_all_to_all`, which
  :func:`ragged_placement._compat.reduce_scatter_single` calls on gloo).
* Its coalesced all-gather has no CUDA path (its plain one stages CUDA tensors through host
  memory): all-gathers of CUDA tensors are never coalesced on gloo (:func:`coalesces_all_gathers`).
* Its two worker threads per group race on a string and corrupt the heap: every gloo group
  created after ``import ragged_placement`` runs one (:func:`one_worker_gloo`, patched in by
  :mod:`ragged_placement._install`).
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

__all__ = [
    "coalesces_all_gathers", "coalescing", "gloo_supports_one_worker", "gloo_worker_threads",
    "one_worker_gloo", "reduce_scatter_by_all_to_all", "sums_by_all_to_all",
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
