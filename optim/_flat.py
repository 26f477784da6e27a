"""The optimizer step on flat shards: an optimizer's per-parameter lists as a few tensors over
contiguous memory.

A ``fully_shard`` unit's sharded parameters are views of one flat chunk per dtype
(:mod:`ragged_placement.fsdp.buffer`), and their gradients views of one flat sharded gradient.
An element-wise update of such parameters is the same update of the range of the chunk they
cover: the kernel sees the same values at the same addresses, once instead of once per
parameter. :class:`FlatStep` finds those ranges in one optimizer call's parallel lists and
makes the optimizer state tile the same ranges.

The lists hold local tensors: the parameters first, then lists whose memory is given (the
gradients), then the optimizer state. Elements are ordered by their parameter's address (a
unit's plan orders its chunk by segment, not in module order; an element-wise update does not
depend on the order). A *run* is a maximal sequence of elements whose tensors, in every given
list, are contiguous, of one dtype, in one storage and back to back in that order, and whose step
counts are equal. A state list that does not tile a run (state the optimizer allocated per
parameter, loaded from a state dict, or laid out for other runs) is *adopted*: its values are
copied into one new buffer per run and each state tensor is pointed at its view of it, so from
then on it tiles. Elements whose parameter has no local elements (this rank holds none of its
rows) join a run of their step class: only their step count changes. Any other element is a run
of its own, its tensors as they are: the per-parameter update.

Step counts are per parameter and must agree inside a run (the bias correction reads the step).
Which step tensors hold equal values is known without reading them (on an accelerator a read
waits for the device): tensors one flat step wrote together, whose version counters show no
write since, still do; any other write (a per-parameter step, a load, a user's ``+=``) moves a
version counter, and the next step reads the values once. A call's runs are kept for the next
call over the same tensors (:class:`_Plan`), which checks them instead of deriving them.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import operator
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

from ragged_placement.placement import RaggedShard

__all__ = [
    "LOCAL", "FlatStep", "FlatStepStats", "NotFlat", "Run", "count_flat_steps", "flat_view",
    "flat_step_enabled", "per_parameter_step", "run_candidates",
]


# -- switches and counters ------------------------------------------------------------------------
@dataclass
class FlatStepStats:
    """What the flat steps did while :func:`count_flat_steps` was open (machine-independent).

    ``calls``: optimizer calls that took the flat path; ``runs``: tensors per list they passed
    to the kernels (one per run); ``elements``: parameters they stepped in runs;
    ``per_parameter``: parameters left to the per-parameter path (not RaggedShard DTensors, or
    laid out unlike their parameter); ``adopted``: state tensors moved into run buffers;
    ``step_reads``: calls that read the step values (new step tensors, or written since).
    """

    calls: int = 0
    runs: int = 0
    elements: int = 0
    per_parameter: int = 0
    adopted: int = 0
    step_reads: int = 0


class _Switch(threading.local):
    enabled = True
    stats: list[FlatStepStats]

    def __init__(self) -> None:
        self.stats = []


_SWITCH = _Switch()


def flat_step_enabled() -> bool:
    """Whether optimizer steps take the flat path in this thread (see :func:`per_parameter_step`)."""
    return _SWITCH.enabled


@contextlib.contextmanager
def per_parameter_step() -> Iterator[None]:
    """Inside, torch's Adam / AdamW and :class:`~ragged_placement.optim.Muon` step every
    parameter as its own tensor (the DTensor path), not runs of flat shards: the reference the
    flat step computes the same numbers as."""
    before = _SWITCH.enabled
    _SWITCH.enabled = False
    try:
        yield
    finally:
        _SWITCH.enabled = before


@contextlib.contextmanager
def count_flat_steps() -> Iterator[FlatStepStats]:
    """Count what the flat steps do inside (a :class:`FlatStepStats`, filled in place)."""
    stats = FlatStepStats()
    _SWITCH.stats.append(stats)
    try:
        yield stats
    finally:
        _SWITCH.stats.remove(stats)


def _count(**counts: int) -> None:
    for stats in _SWITCH.stats:
        for name, n in counts.items():
            setattr(stats, name, getattr(stats, name) + n)


_VERSION = operator.attrgetter("_version")


# -- run candidates ------------------------------------------------------------------------------
_SPEC = operator.attrgetter("_spec")
LOCAL = operator.attrgetter("_local_tensor")
# the ids of lists of specs that all have a RaggedShard -> the specs (held: their ids stay theirs)
_RAGGED_LISTS: OrderedDict[tuple[int, ...], list] = OrderedDict()
_RAGGED_LISTS_CAPACITY = 64


def _ragged(spec) -> bool:
    return any(type(p) is RaggedShard for p in spec.placements)


def _spec_ids(lst: list[torch.Tensor | None]) -> list[int] | None:
    """The ids of the DTensor specs of ``lst`` (``None`` if it holds anything else)."""
    try:
        return list(map(id, map(_SPEC, lst)))
    except AttributeError:
        return None


def _all_ragged(params: list[torch.Tensor], ids: list[int]) -> bool:
    """Whether every spec of ``params`` (DTensors; ``ids`` their specs' ids) has a RaggedShard."""
    key = tuple(ids)
    with _PLANS_LOCK:
        if key in _RAGGED_LISTS:
            return True
    specs = list(map(_SPEC, params))
    if not all(map(_ragged, specs)):
        return False
    with _PLANS_LOCK:
        _RAGGED_LISTS[key] = specs
        while len(_RAGGED_LISTS) > _RAGGED_LISTS_CAPACITY:
            _RAGGED_LISTS.popitem(last=False)
    return True


def run_candidates(
    params: list[torch.Tensor], others: list[list[torch.Tensor | None]]
) -> tuple[list[int], list[int]]:
    """The indices of the elements whose parameter is a RaggedShard DTensor and whose tensors
    in ``others`` are DTensors of its spec (or ``None``: state not allocated yet), and of the
    others. A tensor laid out as its parameter takes the parameter's spec object, so that the
    next step's check is an identity (for the whole list at once)."""
    ids = _spec_ids(params)
    if ids is not None and all(_spec_ids(lst) == ids for lst in others) and _all_ragged(params, ids):
        return list(range(len(params))), []
    cand, rest = [], []
    for i, p in enumerate(params):
        if isinstance(p, DTensor) and _ragged(spec := p._spec):
            for lst in others:
                t = lst[i]
                if t is None:
                    continue
                if not isinstance(t, DTensor):
                    break
                if t._spec is not spec:
                    if t._spec != spec:
                        break
                    t._spec = spec
            else:
                cand.append(i)
                continue
        rest.append(i)
    return cand, rest


# -- flat views -----------------------------------------------------------------------------------
def flat_view(first: torch.Tensor, numel: int) -> torch.Tensor:
    """The 1-D tensor over ``numel`` elements of ``first``'s storage from where ``first``
    starts: a run whose first member is ``first``. It holds the storage, not ``first``."""
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(
        first.untyped_storage(), first.storage_offset(), (numel,)
    )


# -- runs -----------------------------------------------------------------------------------------
@dataclass
class Run:
    """One run: ``members`` (element indices: the ``dense`` ones with local elements, in
    memory order, then those without), the dense members' total ``numel`` and their step
    class ``cls``."""

    members: list[int]
    cls: object
    dense: int = 1
    numel: int = 0


def _key(t: torch.Tensor, numel: int) -> tuple[int, int, int, torch.dtype] | None:
    """``(storage base address, address, element size, dtype)`` of ``t`` if it is contiguous
    with ``numel`` elements, else ``None``."""
    if t.numel() != numel or not t.is_contiguous():
        return None
    ptr, size = t.data_ptr(), t.element_size()
    return ptr - t.storage_offset() * size, ptr, size, t.dtype


def find_runs(
    lists: Sequence[Sequence[torch.Tensor]], n_given: int, classes: Sequence[object]
) -> list[Run]:
    """The runs of ``lists`` (see the module docstring), following the memory of the first
    ``n_given``; ``classes``: each element's step class."""
    numels = list(map(torch.Tensor.numel, lists[0]))
    dense = [i for i, n in enumerate(numels) if n]
    keys = [[_key(lst[i], numels[i]) for i in dense] for lst in lists[:n_given]]
    runs: list[Run] = []
    order = []
    for j, i in enumerate(dense):
        if all(k[j] is not None for k in keys):
            order.append(j)
        else:
            runs.append(Run([i], classes[i], numel=numels[i]))
    order.sort(key=lambda j: keys[0][j][:2])
    last: Run | None = None
    prev = 0
    for j in order:
        i = dense[j]
        if last is not None and classes[i] == last.cls and all(
            k[j][0] == k[prev][0] and k[j][3] == k[prev][3]
            and k[j][1] == k[prev][1] + numels[dense[prev]] * k[j][2]
            for k in keys
        ):
            last.members.append(i)
            last.numel += numels[i]
        else:
            last = Run([i], classes[i], numel=numels[i])
            runs.append(last)
        prev = j
    for run in runs:
        run.dense = len(run.members)
    by_class = {run.cls: run for run in reversed(runs)}
    for i, n in enumerate(numels):
        if n:
            continue
        run = by_class.get(classes[i])
        if run is None:
            run = by_class[classes[i]] = Run([i], classes[i])
            runs.append(run)
        else:
            run.members.append(i)
    return runs


def _tiles(lst: Sequence[torch.Tensor | None], members: list[int]) -> bool:
    """Whether ``lst``'s tensors of ``members`` are contiguous, of one dtype, in one storage
    and back to back in this order."""
    first = lst[members[0]]
    if first is None:
        return False
    dtype, size = first.dtype, first.element_size()
    base = first.data_ptr() - first.storage_offset() * size
    end = first.data_ptr()
    for i in members:
        t = lst[i]
        if t is None:
            return False
        ptr = t.data_ptr()
        if (ptr != end or ptr - t.storage_offset() * size != base or t.dtype != dtype
                or not t.is_contiguous()):
            return False
        end += t.numel() * size
    return True


class NotFlat(Exception):
    """Raised by :class:`FlatStep` before it changes anything when the lists cannot be stepped
    as runs with the per-parameter step's numbers: one tensor appears twice (a step tensor
    shared by two parameters is stepped twice by the per-parameter step), or the step counts
    are DTensors. The caller steps the call per parameter."""


class FlatStep:
    """One optimizer call's run candidates as runs (see the module docstring).

    Args:
        lists: per list, one local tensor per element: the parameters, the other given lists
            (gradients), then the state lists, where ``None`` is a state not allocated yet
            (allocated zeroed in its run's buffer). The caller has checked that each
            element's tensors are laid out alike (equal DTensor specs).
        n_given: how many leading lists are given (the parameters included).
        steps: the step tensors, one per element, or ``None`` (an update without steps).
        repoint: ``repoint(list_index, element, tensor)`` points the optimizer's state of an
            element at ``tensor`` (its view of its run's buffer).

    :attr:`tensors` holds, per list, one tensor per run (a run's flat range, or a run of one's
    own tensor), :attr:`steps` one step tensor per run (its first member's); after the update
    of those, :meth:`finish` gives every member its run's step. The runs of a call are kept
    (:class:`_Plan`) for the next call over the same tensors, which checks them, not derives.
    """

    runs: list[Run]
    tensors: list[list[torch.Tensor]]
    steps: list[torch.Tensor] | None
    _plan: _Plan
    _all_steps: Sequence[torch.Tensor] | None

    def __init__(
        self,
        lists: list[list[torch.Tensor | None]],
        n_given: int,
        steps: Sequence[torch.Tensor] | None,
        repoint: Callable[[int, int, torch.Tensor], None],
    ) -> None:
        key = tuple(map(id, lists[0]))
        plan = _PLANS.get(key)
        tensors = plan.tensors(lists, n_given, steps) if plan is not None else None
        if tensors is None:
            plan = _Plan(key, lists, n_given, steps, repoint, plan)
            tensors = plan.tensors(lists, n_given, steps, check=False)
        self._plan, self.runs, self.tensors = plan, plan.runs, tensors
        self._all_steps = steps
        self.steps = None if steps is None else [steps[r.members[0]] for r in plan.runs]
        _count(calls=1, runs=len(plan.runs), elements=len(lists[0]))

    def finish(self) -> None:
        """After the update: copy each run's step into its other members' step tensors, and
        note their version counters (no other write since means still equal)."""
        steps, plan = self._all_steps, self._plan
        if steps is None:
            return
        plan.write_steps(steps)
        plan.versions = list(map(_VERSION, steps))

def _adopt(
    runs: list[Run],
    params: Sequence[torch.Tensor],
    lst: list[torch.Tensor | None],
    repoint: Callable[[int, torch.Tensor], None],
) -> int:
    """Make state list ``lst`` tile every run: where its tensors of a run's dense members do
    not, copy them (zeros for ``None``) into a new buffer, point ``lst[i]`` and, through
    ``repoint(i, view)``, the optimizer's state at each member's view of it. Returns the number
    of tensors moved."""
    moved = 0
    for run in runs:
        dense = run.members[: run.dense]
        move = dense if run.dense > 1 and not _tiles(lst, dense) else [i for i in dense if lst[i] is None]
        move += [i for i in run.members[run.dense :] if lst[i] is None]
        if not move:
            continue
        proto = next((lst[i] for i in move if lst[i] is not None), params[move[0]])
        buf = torch.empty(sum(params[i].numel() for i in move), dtype=proto.dtype, device=proto.device)
        offset = 0
        for i in move:
            shape, numel = params[i].shape, params[i].numel()
            view = buf[offset : offset + numel].view(shape)
            if lst[i] is None:
                view.zero_()
            else:
                view.copy_(lst[i])
            lst[i] = view
            repoint(i, view)
            offset += numel
            moved += 1
    return moved


class _Plan:
    """The runs of one optimizer call's lists, kept for the next call over the same tensors
    (in :data:`_PLANS`, by the ids of the parameters' local tensors).

    It holds no tensor of the lists: a weak reference to each parameter, state and step tensor
    drops the plan when one dies (a move re-points the parameters, a load replaces the state),
    so an id in it always names the tensor it was taken from, and the flat views of its runs
    hold only their storage. The next call reuses it when it passes the same parameter, state
    and step tensors, their dense members still at the same addresses, the step counters
    unmoved since :meth:`FlatStep.finish`, and gradients that tile its runs (checked each
    call: they are new after every backward).

    Steps: the classes (see the module docstring) are those the values had when the plan was
    made, or the replaced plan's when its step tensors are the same and unmoved. The step
    tensors are then pointed (``set_``) at the elements of one buffer in run order, so that
    :meth:`FlatStep.finish` gives every member its run's step in two ops (an index and a
    copy), whatever the number of runs; where a step tensor cannot be re-pointed (one made by
    ``.detach()``), each member's step is copied from its run's first.
    """

    token: int
    runs: list[Run]
    state_ids: tuple[tuple[int, ...], ...]
    step_ids: tuple[int, ...] | None
    classes: list[object]
    versions: list[int]
    dense: list[int]  # the dense members of runs of several, in run order
    ptrs: list[list[int]]  # per kept list (parameters, state): the dense members' addresses
    firsts: list[int]  # per dense member: the position in ``dense`` of its run's first
    offsets: list[int]  # per dense member: its byte offset from its run's first
    views: list[list[torch.Tensor | None]]  # per kept list, per run: its flat view (runs of several)
    step_buffer: torch.Tensor | None  # the step tensors' storage, in run order
    step_heads: torch.Tensor | None  # per element of the buffer: its run's first
    copy_to: list[int]  # without a step buffer: the members that take their run's step ...
    copy_from: list[int]  # ... from its first member
    retry: bool  # gradients split runs the parameters do not: rebuild at the next call
    refs: list[weakref.ref]

    def __init__(
        self,
        key: tuple[int, ...],
        lists: list[list[torch.Tensor | None]],
        n_given: int,
        steps: Sequence[torch.Tensor] | None,
        repoint: Callable[[int, int, torch.Tensor], None],
        old: _Plan | None,
    ) -> None:
        self.token = next(_TOKENS)
        n = len(lists[0])
        held = [id(t) for lst in lists for t in lst if t is not None]
        if steps is not None:
            if any(isinstance(s, DTensor) for s in steps):
                raise NotFlat
            held += map(id, steps)
        if len(set(held)) != len(held):
            raise NotFlat
        self.step_ids = None if steps is None else tuple(map(id, steps))
        if steps is None:
            self.classes = [None] * n
        elif old is not None and old.step_ids == self.step_ids and old.versions == list(map(_VERSION, steps)):
            self.classes = old.classes
        else:
            _count(step_reads=1)
            values = torch.stack([s.detach().reshape(()) for s in steps]).tolist()
            self.classes = [("value", v) for v in values]
        self.runs = runs = find_runs(lists, n_given, self.classes)
        self.retry = n_given > 1 and len(find_runs(lists, 1, self.classes)) != len(runs)
        adopted = 0
        for k in range(n_given, len(lists)):
            adopted += _adopt(runs, lists[0], lists[k], lambda i, view, k=k: repoint(k, i, view))
        _count(adopted=adopted)
        kept = [lists[0], *lists[n_given:]]
        self.state_ids = tuple(tuple(map(id, lst)) for lst in lists[n_given:])
        self.dense, self.firsts, self.offsets = [], [], []
        for r in runs:
            if r.dense > 1:
                first, offset = len(self.dense), 0
                for i in r.members[: r.dense]:
                    self.dense.append(i)
                    self.firsts.append(first)
                    self.offsets.append(offset)
                    offset += lists[0][i].nbytes
        self.ptrs = [[lst[i].data_ptr() for i in self.dense] for lst in kept]
        self.views = [
            [flat_view(lst[r.members[0]], r.numel) if r.dense > 1 else None for r in runs]
            for lst in kept
        ]
        self.step_buffer = self.step_heads = None
        self.copy_to, self.copy_from = [], []
        if steps is not None:
            self._steps_in_one_buffer(steps)
            self.versions = list(map(_VERSION, steps))
        else:
            self.versions = []
        drop = functools.partial(_drop_plan, key, self.token)
        self.refs = [weakref.ref(t, drop) for lst in kept for t in lst]
        if steps is not None:
            self.refs += [weakref.ref(s, drop) for s in steps]
        with _PLANS_LOCK:
            _PLANS[key] = self
            _PLANS.move_to_end(key)
            while len(_PLANS) > _PLANS_CAPACITY:
                _PLANS.popitem(last=False)

    def _steps_in_one_buffer(self, steps: Sequence[torch.Tensor]) -> None:
        """Point the step tensors at one buffer in run order (see the class docstring), or
        plan the copies from each run's first member where that cannot be done."""
        order = [i for r in self.runs for i in r.members]
        starts = itertools.accumulate([len(r.members) for r in self.runs], initial=0)
        heads = [start for r, start in zip(self.runs, starts) for _ in r.members]
        first = steps[0]
        if len(order) > len(self.runs) and all(
            s.dtype == first.dtype and s.device == first.device and s.numel() == 1 for s in steps
        ):
            buf = torch.stack([steps[i].detach().reshape(()) for i in order])
            storage = buf.untyped_storage()
            moved = []
            try:
                for pos, i in enumerate(order):
                    steps[i].set_(storage, pos, steps[i].shape, steps[i].stride())
                    moved.append(i)
            except RuntimeError:  # a tensor made by .detach() or .data keeps its storage
                for i in moved:  # the ones moved get storages of their own back
                    steps[i].set_(steps[i].detach().clone())
            else:
                self.step_buffer = buf
                self.step_heads = torch.tensor(heads, device=buf.device)
                return
        self.copy_to = [i for r in self.runs for i in r.members[1:]]
        self.copy_from = [r.members[0] for r in self.runs for _ in r.members[1:]]

    def write_steps(self, steps: Sequence[torch.Tensor]) -> None:
        """Give every member its run's step (after the update stepped each run's first)."""
        if self.step_buffer is not None:
            self.step_buffer.copy_(self.step_buffer.index_select(0, self.step_heads))
        elif self.copy_to:
            torch._foreach_copy_([steps[i] for i in self.copy_to], [steps[i] for i in self.copy_from])

    def tensors(
        self,
        lists: list[list[torch.Tensor | None]],
        n_given: int,
        steps: Sequence[torch.Tensor] | None,
        *,
        check: bool = True,
    ) -> list[list[torch.Tensor]] | None:
        """The lists' tensors per run if this plan holds for them, else ``None`` (``check``:
        whether to check; a plan made from these lists holds for them)."""
        kept = [lists[0], *lists[n_given:]]
        if check and (
            self.retry
            or tuple(tuple(map(id, lst)) for lst in lists[n_given:]) != self.state_ids
            or (None if steps is None else tuple(map(id, steps))) != self.step_ids
            or (steps is not None and list(map(_VERSION, steps)) != self.versions)
            or any(list(map(_DATA_PTR, [lst[i] for i in self.dense])) != ptrs
                   for lst, ptrs in zip(kept, self.ptrs))
        ):
            return None
        runs = self.runs
        given = []
        for lst in lists[1:n_given]:
            if check and not self._tiled(lst):
                return None
            given.append([lst[r.members[0]] if r.dense == 1
                          else lst[r.members[0]].as_strided((r.numel,), (1,)) for r in runs])
        out = []
        for lst, views in zip(kept, self.views):
            out.append([lst[r.members[0]] if v is None else v for r, v in zip(runs, views)])
        return [out[0], *given, *out[1:]]

    def _tiled(self, lst: list[torch.Tensor]) -> bool:
        """Whether ``lst`` (a given list, e.g. new gradients) tiles the runs of several: its
        dense members contiguous, in their run's first member's storage, at the parameters'
        offsets. (Their dtypes and numels are the parameters': they have the parameters'
        specs.)"""
        tensors = [lst[i] for i in self.dense]
        if not all(map(_IS_CONTIGUOUS, tensors)):
            return False
        ptrs = list(map(_DATA_PTR, tensors))
        bases = [p - o * t.element_size() for p, o, t in zip(ptrs, map(_STORAGE_OFFSET, tensors), tensors)]
        return all(
            p - ptrs[f] == o and b == bases[f]
            for p, b, f, o in zip(ptrs, bases, self.firsts, self.offsets)
        )


_DATA_PTR = torch.Tensor.data_ptr
_STORAGE_OFFSET = torch.Tensor.storage_offset
_IS_CONTIGUOUS = torch.Tensor.is_contiguous


def _drop_plan(key: tuple[int, ...], token: int, _ref: weakref.ref) -> None:
    """Weak-reference callback: a tensor of plan ``token`` died; forget the plan."""
    with _PLANS_LOCK:
        plan = _PLANS.get(key)
        if plan is not None and plan.token == token:
            del _PLANS[key]


_PLANS: OrderedDict[tuple[int, ...], _Plan] = OrderedDict()
_PLANS_LOCK = threading.Lock()
_PLANS_CAPACITY = 256
_TOKENS = itertools.count()
