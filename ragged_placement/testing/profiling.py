"""Measurement helpers used by the demo, the benchmark and the tests: collectives, copies, memory.

They observe torch FSDP2 and this runtime through the same instruments, so the numbers compare:

* :class:`CollectiveMeter` wraps the c10d entry points both runtimes call
  (``torch.distributed.all_gather_single`` / ``reduce_scatter_single`` or their 2.11 names, and
  the bound references in :mod:`ragged_placement._compat`) and ``all_reduce``, and counts calls
  and bytes, in total and per process group (named by mesh dims with
  :meth:`CollectiveMeter.by_dims`).
* :class:`LayoutCopyMeter` is a dispatch mode that counts bytes written by the ops FSDP runtimes
  use to move parameters and gradients between per-parameter tensors and flat collective buffers
  (FSDP2's ``all_gather_copy_in``, ``split_with_sizes_copy``, ``_chunk_cat``). It does not count
  the model's own copies.
* :class:`HeapPeakMeter` samples the process heap after every op of the marked steps and reports
  the peak above the heap in use before the model was built: parameters, gradients, optimizer
  state, activations, communication buffers and whatever a runtime holds across steps, all
  counted the same way.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import gc
import inspect
import itertools
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from typing_extensions import Self  # a dependency of torch

import ragged_placement._compat as compat
from ragged_placement.fsdp import collectives

__all__ = ["AllocationMeter", "CollectiveMeter", "HeapPeakMeter", "LayoutCopyMeter", "heap_in_use",
           "net_bytes", "state_bytes"]

_LAYOUT_COPY_OPS = ("all_gather_copy_in", "split_with_sizes_copy", "_chunk_cat", "chunk_cat")


class CollectiveMeter:
    """Counts all-gathers, reduce-scatters and all-reduces (calls and bytes) issued inside the
    ``with`` block, in total and per process group.

    ``all_gather_bytes`` sums the gathered outputs, ``reduce_scatter_bytes`` the reduced inputs,
    ``counts["all_reduce_bytes"]`` the all-reduced tensors: the size of the collective, the same
    on every rank. A coalesced group of calls (one unit's segments) is one collective.

    ``by_group[(kind, ranks)]`` is ``[calls, bytes, moved]`` per kind and group (``ranks``: the
    group's global ranks in group order), where ``moved`` is what the collective moves per rank
    on a ring: an all-gather's output less this rank's input (what it receives), a
    reduce-scatter's input less its output (what it sends), ``2 (n - 1) / n`` of an all-reduced
    tensor over ``n`` ranks. :meth:`by_dims` names the groups by the mesh dims they span.

    ``all_to_all=True`` also counts ``dist.all_to_all_single`` calls (kind ``"all_to_all"``:
    bytes the input, ``moved`` the input less the rows this rank keeps, approximated as
    ``(n - 1) / n`` of it) that are not issued inside another counted collective (gloo's
    reduce-scatters run as all-to-alls and stay reduce-scatters): expert parallelism's token
    dispatch, an optimizer's exchange.
    """

    def __init__(self, all_to_all: bool = False) -> None:
        self.all_to_all = all_to_all
        self._depth = 0  # counted collectives in progress (an all-to-all inside one is theirs)
        self.counts: collections.Counter[str] = collections.Counter()
        self.by_group: dict[tuple[str, tuple[int, ...]], list[int]] = {}
        self._saved: list[tuple[object, str, object]] = []
        # set while a coalesced group is issued: the (kind, ranks) it ran, counted once at its end
        self._coalesced_keys: set[tuple[str, tuple[int, ...]]] | None = None

    @property
    def all_gather_bytes(self) -> int:
        return self.counts["all_gather_bytes"]

    @property
    def reduce_scatter_bytes(self) -> int:
        return self.counts["reduce_scatter_bytes"]

    def by_dims(self, mesh: DeviceMesh) -> dict[tuple[str, tuple[str, ...]], list[int]]:
        """:attr:`by_group` keyed by ``(kind, the mesh dims the group spans)`` (dims in mesh
        order; the group spans every rank of ``mesh`` that shares this rank's coordinates on the
        other dims), summed over groups spanning the same dims.

        Raises:
            ValueError: a group spans no set of ``mesh``'s dims through this rank.
        """
        spans = _dim_spans(mesh)
        out: dict[tuple[str, tuple[str, ...]], list[int]] = {}
        for (kind, ranks), counts in self.by_group.items():
            dims = spans.get(frozenset(ranks))
            if dims is None:
                raise ValueError(
                    f"a {kind} over ranks {list(ranks)} spans no set of dims of mesh {mesh}"
                )
            entry = out.setdefault((kind, dims), [0, 0, 0])
            for i, n in enumerate(counts):
                entry[i] += n
        return out

    def _count(self, kind: str, group, nbytes: int, moved: int) -> None:
        ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
        entry = self.by_group.setdefault((kind, ranks), [0, 0, 0])
        entry[1] += nbytes
        entry[2] += moved
        self.counts[f"{kind}_bytes"] += nbytes
        if self._coalesced_keys is None:
            self.counts[kind] += 1
            entry[0] += 1
        else:  # part of one coalesced collective, counted once when the group is issued
            self._coalesced_keys.add((kind, ranks))

    def _wrap(self, kind: str, fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)  # keeps the signature for a wrapper around this one
        def counted(*args, **kwargs):
            arguments = signature.bind(*args, **kwargs).arguments
            tensors = _positional(signature, arguments)
            if kind == "all_to_all":
                if self._depth:
                    return fn(*args, **kwargs)
                nbytes = _nbytes(tensors[1])
                n = dist.get_world_size(arguments.get("group"))
                moved = (n - 1) * nbytes // n
            elif kind == "all_reduce":
                nbytes = _nbytes(tensors[0])
                n = dist.get_world_size(arguments.get("group"))
                moved = 2 * (n - 1) * nbytes // n
            else:
                output, input = (_nbytes(t) for t in tensors[:2])
                nbytes = output if kind == "all_gather" else input
                moved = abs(output - input)
            self._count(kind, arguments.get("group"), nbytes, moved)
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def _wrap_coalesced(self, fn):
        """A coalesced group (a segmented unit's collectives) is one collective: one NCCL group,
        one gloo ``*_coalesced`` op."""

        def counted(calls, *args, **kwargs):
            if len(calls) == 1:
                return fn(calls, *args, **kwargs)
            self._coalesced_keys = set()
            try:
                return fn(calls, *args, **kwargs)
            finally:
                for kind in {kind for kind, _ in self._coalesced_keys}:
                    self.counts[kind] += 1
                for key in self._coalesced_keys:
                    self.by_group[key][0] += 1
                self._coalesced_keys = None

        return counted

    def __enter__(self) -> Self:
        targets = [
            (dist, "all_gather_single", "all_gather"),
            (dist, "all_gather_into_tensor", "all_gather"),
            (dist, "reduce_scatter_single", "reduce_scatter"),
            (dist, "reduce_scatter_tensor", "reduce_scatter"),
            (compat, "_all_gather", "all_gather"),
            (collectives, "_all_gather_uneven", "all_gather"),  # W broadcasts: one collective
            (dist, "reduce_scatter", "reduce_scatter"),  # uneven segments' list reduce-scatter
            (compat, "_reduce_scatter", "reduce_scatter"),
            (compat, "reduce_scatter_by_all_to_all", "reduce_scatter"),  # gloo's sums
            # one unit's equal segments as one coalesced c10d call: one collective
            (compat, "all_gather_coalesced", "all_gather"),
            (compat, "reduce_scatter_coalesced", "reduce_scatter"),
            (dist, "all_reduce", "all_reduce"),
        ] + ([(dist, "all_to_all_single", "all_to_all")] if self.all_to_all else [])
        for obj, name, kind in targets:
            fn = getattr(obj, name, None)
            if fn is not None:
                self._saved.append((obj, name, fn))
                setattr(obj, name, self._wrap(kind, fn))
        self._saved.append((collectives, "_coalesced", collectives._coalesced))
        collectives._coalesced = self._wrap_coalesced(collectives._coalesced)
        return self

    def __exit__(self, *exc) -> None:
        for obj, name, fn in reversed(self._saved):
            setattr(obj, name, fn)
        self._saved.clear()


def _positional(signature: inspect.Signature, arguments: dict) -> list:
    """The bound arguments in order, a ``*args`` parameter's values spread in place (a wrapper
    of a collective, such as a benchmark's no-op, that takes ``*args``)."""
    out = []
    for name, value in arguments.items():
        if signature.parameters[name].kind is inspect.Parameter.VAR_POSITIONAL:
            out.extend(value)
        else:
            out.append(value)
    return out


def _nbytes(x: torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...]) -> int:
    """Bytes of a tensor or of a list or tuple of them (an uneven reduce-scatter's inputs, an
    uneven all-gather's outputs)."""
    return sum(t.numel() * t.element_size() for t in ([x] if torch.is_tensor(x) else x))


def _dim_spans(mesh: DeviceMesh) -> dict[frozenset[int], tuple[str, ...]]:
    """The ranks each non-empty set of ``mesh``'s dims spans through this rank (the first set
    wins where several span the same ranks: dims of size 1)."""
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(f"mesh must have mesh_dim_names to name collectives by dims, got {mesh}")
    coords = [int(i) for i in (mesh.mesh == dist.get_rank()).nonzero()[0]]
    spans: dict[frozenset[int], tuple[str, ...]] = {}
    for k in range(1, len(names) + 1):
        for dims in itertools.combinations(range(len(names)), k):
            index = tuple(slice(None) if d in dims else c for d, c in enumerate(coords))
            ranks = frozenset(int(r) for r in mesh.mesh[index].reshape(-1).tolist())
            spans.setdefault(ranks, tuple(names[d] for d in dims))
    return spans


class LayoutCopyMeter(TorchDispatchMode):
    """Bytes written by per-parameter <-> flat-buffer copy ops (FSDP2's copy-in / copy-out)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__
        if name in _LAYOUT_COPY_OPS:
            written = kwargs.get("out") if kwargs and "out" in kwargs else out
            self.bytes[name] += sum(t.numel() * t.element_size() for t in _tensors(written))
        return out

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


def _storage_ptr(x: object) -> int | None:
    """The data pointer of ``x``'s storage (a DTensor's local tensor's); ``None`` for a meta
    tensor, an empty storage or a non-tensor."""
    if isinstance(x, DTensor):
        x = x._local_tensor
    if isinstance(x, torch.Tensor) and not x.is_meta:
        x = x.untyped_storage()
    return x.data_ptr() if isinstance(x, torch.UntypedStorage) and x.nbytes() else None


class AllocationMeter(TorchDispatchMode):
    """Bytes of every storage an op returns that none of its inputs holds, one entry per op
    result, in ``nbytes`` (a DTensor counts its local tensor; meta tensors count nothing): what a
    rank allocates inside the ``with`` block, e.g. for ``fully_shard`` and ``to_empty``."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {_storage_ptr(x) for x in tree_leaves((args, kwargs))}
        for t in tree_leaves(out):
            ptr = _storage_ptr(t)
            if ptr is not None and ptr not in inputs:
                t = t._local_tensor if isinstance(t, DTensor) else t
                self.nbytes.append(t.untyped_storage().nbytes())
        return out


def _tensors(x) -> Iterable[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost",
        )
    ]


def heap_in_use() -> int:
    """Bytes the process has allocated from the C heap and not freed, over all threads:
    glibc's ``mallinfo2()`` in-use arena bytes plus ``mmap``-ed chunks. CPU tensors are
    ``posix_memalign``-ed by c10's allocator, so their storages are in it."""
    info = _mallinfo2()()
    return info.uordblks + info.hblkhd


@functools.cache
def _mallinfo2():
    fn = getattr(ctypes.CDLL(None), "mallinfo2", None)
    if fn is None:
        raise RuntimeError("heap_in_use() needs glibc >= 2.33 (mallinfo2)")
    fn.restype = _Mallinfo2
    return fn


class _SampleAfterEachOp(TorchDispatchMode):
    def __init__(self, meter: HeapPeakMeter) -> None:
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.meter._sample()
        return out


class HeapPeakMeter:
    """Peak CPU memory of the windows marked with :meth:`measure`, above the heap in use when
    the meter was entered.

    The heap is sampled (:func:`heap_in_use`) after every ATen and c10d op dispatched in a
    window, so the peak is taken where tensors are created. Unlike the profiler's allocator
    events, this sees memory freed on other threads (a gloo work object dropping the last
    reference to a buffer) and buffers the backend allocates itself, and it needs no record of
    blocks allocated before it started: whatever a runtime keeps across steps is counted. Build
    the model inside the meter and drop earlier models first (entering runs the garbage
    collector), so that the baseline holds neither.

    Example::

        with HeapPeakMeter() as mem:
            model, opt = build()
            train(2)  # warm-up, not measured
            for _ in range(3):
                with mem.measure():
                    train(1)
        print(mem.peak)
    """

    def __init__(self) -> None:
        self.peak = 0
        self._base = 0

    def __enter__(self) -> Self:
        gc.collect()
        self._base = heap_in_use()
        return self

    def __exit__(self, *exc) -> None:
        pass

    def _sample(self) -> None:
        self.peak = max(self.peak, heap_in_use() - self._base)

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        """Marks a window whose memory counts towards :attr:`peak`."""
        self._sample()
        with _SampleAfterEachOp(self):
            yield
        self._sample()


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def _param_chunk_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameter chunks a ``state_sharding`` keeps beside the optimizer shard
    (the local tensors of ``model.parameters()``): the chunk over ``params`` when ``optim``
    spans more ranks, the unsharded buffer when ``params=()``; 0 otherwise."""
    units = getattr(model, "fsdp_units", None)
    total = 0
    for _, unit in units() if units is not None else ():
        for b in unit.buffers:
            held = b.comm.param_chunk
            total += 0 if held is None else held.numel() * held.element_size()
    return total


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's bytes of parameters (the sharded parameters and any parameter chunk of a
    ``state_sharding``), gradients and optimizer state."""
    params = list(model.parameters())
    states = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"params": _local_bytes(params) + _param_chunk_bytes(model),
            "grads": _local_bytes(p.grad for p in params if p.grad is not None),
            "optimizer": _local_bytes(states)}


def net_bytes() -> dict[str, int]:
    """Bytes sent by each network interface of this machine (or network namespace)."""
    root = Path("/sys/class/net")
    if not root.is_dir():
        return {}
    return {p.name: int((p / "statistics" / "tx_bytes").read_text()) for p in root.iterdir()}
