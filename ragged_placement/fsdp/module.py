"""``FSDPModule``: the methods a ``fully_shard`` module gains (torch FSDP2's surface), and the
other module-level entry points of FSDP2's API that act on sharded modules."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import UnshardHandle as TorchUnshardHandle
from torch.distributed.tensor import DTensor

from ragged_placement._gloo import one_worker_gloo
from ragged_placement.fsdp.common import Registration
from ragged_placement.fsdp.fsdp2_state import refuse_private_state
from ragged_placement.fsdp.state import FSDPState, drop_unused_grads
from ragged_placement.fsdp.param import ParamLayout, ParamSlot
from ragged_placement.fsdp.unit import FSDPUnit
from ragged_placement.fsdp.unsharded_guard import mark as mark_unsharded

__all__ = ["FSDPModule", "UnshardHandle", "register_fsdp_forward_method", "share_comm_ctx"]


class FSDPModule(TorchFSDPModule):
    """Mixin added to the class of every module passed to :func:`fully_shard`.

    It derives from ``torch.distributed.fsdp.FSDPModule``, so the code that branches on
    ``isinstance(m, torch.distributed.fsdp.FSDPModule)`` (torchtitan's
    ``disable_fsdp_gradient_division`` and ``ChunkedLossWrapper``, torch's pipelining
    schedules) takes these modules for FSDP2's and calls FSDP2's public methods, which this
    class overrides with this runtime's: those it honours exactly work (e.g.
    :meth:`set_gradient_divide_factor`, ``1.0``: gradients summed, not averaged, as FSDP2), the
    staging-allocator ones raise ``NotImplementedError`` saying why. Where torch's code goes on
    to FSDP2's private state, :mod:`ragged_placement.fsdp.fsdp2_state` answers what pipelining
    reaches (``fully_shard.state(m)``'s post-backward) and raises ``NotImplementedError``
    naming anything else (``_get_fsdp_state``, ``FSDPMemTracker``). torch's ``__new__`` (a
    container sliced into a new one builds the original class) applies, with this class one
    more step down the method resolution order. ``torch.compile``'s package pickler
    (``torch._dynamo.package``) does not know these classes (it looks FSDP2's class table up)
    and fails on them.
    """

    # Index in the MRO of the original class: [FSDP<Orig>, FSDPModule, torch's FSDPModule,
    # Orig, ...] (torch's ``__new__`` reads it)
    _orig_cls_mro_index: int = 3

    _fsdp_state: FSDPState

    @property
    def fsdp_unit(self) -> FSDPUnit:
        """This module's unit: its flat buffers (``.buffers``, each with its ``.plan``) and
        communication counters (``.stats``)."""
        return self._fsdp_state.unit

    def fsdp_units(self) -> Iterator[tuple[str, FSDPUnit]]:
        """``(module name, unit)`` for this module and every ``fully_shard`` module below it."""
        seen: set[int] = set()  # the modules of a fully_shard([a, b]) group share one unit
        for name, m in self.named_modules():
            if isinstance(m, FSDPModule) and id(m._fsdp_state) not in seen:
                seen.add(id(m._fsdp_state))
                yield name, m._fsdp_state.unit

    def __deepcopy__(self, memo: dict) -> NoReturn:
        """``copy.deepcopy`` of a sharded module (or of a module holding one) raises
        ``NotImplementedError``, as FSDP2's ``AssertionError`` does: its parameters are views of
        flat buffers that the unit frees and re-gathers over process groups, which a copy
        cannot share (copying them crashes the process)."""
        raise NotImplementedError(
            f"copy.deepcopy of {type(self).__name__} after fully_shard is not supported (nor "
            f"is it by torch FSDP2): its parameters are views of flat buffers gathered over "
            f"process groups. For a copy (an EMA or teacher model), build the model again, "
            f"apply the same fully_shard calls and load_state_dict(model.state_dict()) into "
            f"it; to save, use the state dict or torch.distributed.checkpoint"
        )

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this unit's parameters and register the unsharded ones, as FSDP2:
        ``model.parameters(recurse=False)`` gives them (in ``param_dtype``) until
        :meth:`reshard`, the unit's next forward or backward, a ``state_dict()`` or an optimizer
        step (an optimizer built from them raises at its first ``step()``:
        :mod:`~ragged_placement.fsdp.unsharded_guard`). With ``async_op=True`` only issue the
        all-gather and return a handle whose ``wait()`` finishes it and registers them (the
        next forward waits for it too)."""
        _check_bool("async_op", async_op)
        state = self._fsdp_state
        state.unit.unshard(async_op=async_op)
        if async_op:
            return UnshardHandle(state)
        _register_unsharded(state)
        return None

    def reshard(self) -> None:
        """Free this unit's unsharded parameters and register the sharded ones."""
        self._fsdp_state.unit.reshard()

    def _apply(self, fn, recurse: bool = True):
        """``nn.Module._apply`` (``to``, ``to_empty``, ``cuda``, ``float``, ``bfloat16``, ...)
        of a sharded module: buffers and inner modules as usual, and this unit's sharded
        parameters (and gradients) mapped by ``fn`` into the unit's re-allocated flat buffer,
        which the same parameter objects then view (see ``FSDPUnit.apply_``). A change ``fn``
        cannot make while keeping that (a shape or placement, several dtypes or devices in one
        unit, a device off the mesh's type) raises ``ValueError`` naming the parameter."""
        unit = self._fsdp_state.unit
        with unit.unregistered():  # not torch FSDPModule's _apply, which reaches FSDP2's state
            module = super(TorchFSDPModule, self)._apply(fn, recurse)
        unit.apply_(fn)
        return module

    def _get_fsdp_state(self) -> NoReturn:
        """torch ``FSDPModule``'s accessor of FSDP2's state, which these modules do not have:
        raises ``NotImplementedError`` (the code calling it would read FSDP2's internals)."""
        refuse_private_state("_get_fsdp_state()", type(self).__name__)

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """With ``False``, backward accumulates unsharded gradients without reduce-scatter (for
        gradient accumulation); the next backward with ``True`` reduces the accumulated sum."""
        if not isinstance(requires_gradient_sync, bool):
            raise ValueError(
                f"requires_gradient_sync must be a bool, got {requires_gradient_sync!r}"
            )
        _check_bool("recurse", recurse)
        for m in self.modules() if recurse else [self]:
            if isinstance(m, FSDPModule):
                m._fsdp_state.requires_gradient_sync = requires_gradient_sync

    def reduce_gradients(self, *, scale: float = 1.0) -> None:
        """Reduce-scatter the gradients accumulated under ``set_requires_gradient_sync(False)``:
        one collective per unit holding some, innermost units last, each finished before the
        next; the averaged gradients are multiplied by ``scale``.

        Use it where no backward with sync on follows and nothing else reduces: pipeline
        schedules of ``torch.distributed.pipelining`` reduce these units themselves (they are
        ``torch.distributed.fsdp.FSDPModule`` instances; see
        :mod:`ragged_placement.fsdp.fsdp2_state`), after which this finds nothing to reduce.
        Collective: every rank of the units' meshes must call it after running backward through
        the same units."""
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise ValueError(f"scale must be a number, got {scale!r}")
        reduced = []
        for m in reversed(list(self.modules())):
            if isinstance(m, FSDPModule):
                state = m._fsdp_state
                if state.unit.has_unsharded_grads:
                    state.note_reduce()
                    state.unit.reduce_grads()
                    state.unit.finish_reduce(scale=float(scale))
                    state.unit.wait_offload_copies()
                    reduced.append(state)
        drop_unused_grads(reduced)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether units free their unsharded parameters after forward (root units never do).
        As FSDP2's, a bool only (``recurse`` may be positional): an ``int`` ``N`` (the groups
        to reshard to) and ``None`` are :func:`fully_shard`'s, not this method's."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                f"reshard_after_forward should be a bool, got {type(reshard_after_forward)} "
                f"({reshard_after_forward!r}; an int N or None is fully_shard's argument)"
            )
        _check_bool("recurse", recurse)
        for m in self.modules() if recurse else [self]:
            if isinstance(m, FSDPModule):
                m._fsdp_state.reshard_after_forward = reshard_after_forward

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted as FSDP2 (pipeline schedules call it): every backward here finishes its
        reduce-scatters before it returns, so there is nothing to defer to a last one."""
        _check_bool("is_last_backward", is_last_backward)

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """As FSDP2's: with ``False``, units keep their gathered parameters after backward and
        the next forward uses them without an all-gather (gradient accumulation: set it back to
        ``True`` for the last micro-batch, before the optimizer steps, which the kept values
        would not see). The sharded parameters stay registered."""
        _check_bool("reshard_after_backward", reshard_after_backward)
        _check_bool("recurse", recurse)
        for m in self.modules() if recurse else [self]:
            if isinstance(m, FSDPModule):
                m._fsdp_state.reshard_after_backward = reshard_after_backward

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """As FSDP2's, for HSDP gradient accumulation: with ``False`` backward reduce-scatters
        but does not all-reduce over the replicas; the sums wait (not in ``.grad``) and join the
        next backward's with ``True``, whose all-reduce lands them all. No effect without HSDP."""
        _check_bool("requires_all_reduce", requires_all_reduce)
        _check_bool("recurse", recurse)
        for m in self.modules() if recurse else [self]:
            if isinstance(m, FSDPModule):
                if not requires_all_reduce:
                    _check_supported(m, "set_requires_all_reduce(False)")
                m._fsdp_state.unit.requires_all_reduce = requires_all_reduce

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        """As FSDP2's: with ``True`` the gradient reduce-scatters run on a process group of
        their own over the shard ranks (one per distinct set of ranks, created here with
        ``use_local_synchronization``: call it on every rank), so that they may progress
        concurrently with all-gathers; ``False`` goes back to the shard group. The values are
        the same either way."""
        _check_bool("enable", enable)
        _check_bool("recurse", recurse)
        groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for m in self.modules() if recurse else [self]:
            if isinstance(m, FSDPModule):
                unit = m._fsdp_state.unit
                group = None
                if enable:
                    _check_supported(m, "set_separate_reduce_scatter_group(True)")
                    ranks = tuple(dist.get_process_group_ranks(unit.dp.shard_group))
                    if ranks not in groups:
                        with one_worker_gloo():  # this runtime's own group (_gloo)
                            groups[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
                    group = groups[ranks]
                for b in unit.buffers:
                    b.grads.reduce_group = group

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """As FSDP2's, checked and accepted: this runtime has by construction what the setting
        buys in FSDP2. Gradients land directly in the reduce-scatter's input (the unit's own
        per-backward buffers, freed when their reduce-scatter is done), so no copy-in buffer is
        recycled and the compute stream never waits for an earlier reduce-scatter to reuse
        one. ``max_input_buffers`` must be an int ``>= 1``; it changes no value."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {max_input_buffers!r}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be >= 1, got {max_input_buffers}")
        _check_bool("recurse", recurse)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """FSDP2's: ``False`` (its default) is accepted; ``True`` raises
        ``NotImplementedError``. FSDP2 allocates the staging buffers of its collectives from the
        process group's allocator; this runtime has none to allocate: the all-gather writes
        straight into the storage the unsharded parameters alias (alive from forward until
        backward reshards), and gradients land directly in the reduce-scatter's input."""
        _check_bool("enable", enable)
        if enable:
            name = "set_allocate_memory_from_process_group_for_comm(True)"
            raise NotImplementedError(_NO_STAGING.format(name))

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """FSDP2's: raises ``NotImplementedError`` (``ValueError`` for a ``backend`` other than
        FSDP2's only one, ``"NCCL"``). FSDP2 allocates its all-gather staging buffers from
        symmetric memory; this runtime's all-gather output is the unsharded parameters'
        storage, which is not symmetric memory."""
        if backend != "NCCL":
            raise ValueError(f"backend must be 'NCCL' (as FSDP2), got {backend!r}")
        raise NotImplementedError(_NO_STAGING.format("set_symm_mem_for_comm"))

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """As FSDP2's: after this unit's forward all-gather, issue those of ``modules`` (in
        order) instead of the next unit of the recorded forward order."""
        self._fsdp_state.forward_prefetch = _prefetch_states(modules)

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """As FSDP2's: after this unit's backward all-gather, issue those of ``modules`` (in
        order) instead of the previous unit of the recorded forward order (also on CPU, where
        the implicit backward prefetch is off)."""
        self._fsdp_state.backward_prefetch = _prefetch_states(modules)

    def set_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None], *, stream: torch.Stream | None = None
    ) -> None:
        """As FSDP2's: ``hook(reduce_output)`` runs on the unit's reduce-scatter output (after
        HSDP's all-reduce), the summed flat gradient shard of each of its buffers (one per
        dtype), in place, before the division and the landing in ``.grad``. It runs on
        ``stream`` when given (which first waits for the current stream, and the current
        stream then for it), else on the current stream.

        Raises:
            ValueError: ``hook`` is not callable, ``stream`` is not a stream (an object with
                ``wait_stream``, e.g. ``torch.cuda.Stream``), or it is given on a 2-D (HSDP)
                mesh (FSDP2's message: there the hook runs after the all-reduce, on its stream).
        """
        if not callable(hook):
            raise ValueError(f"hook must be callable, got {hook!r}")
        if stream is not None and not callable(getattr(stream, "wait_stream", None)):
            raise ValueError(
                f"stream must be None or a stream of the mesh's device type (e.g. "
                f"torch.cuda.Stream()), got {stream!r}"
            )
        unit = self._fsdp_state.unit
        if stream is not None and unit.dp.hsdp:
            raise ValueError("stream cannot be set when using native HSDP")
        unit.all_reduce_hook = hook
        unit.all_reduce_hook_stream = stream

    def set_custom_all_gather(self, comm: Callable) -> None:
        """As FSDP2's: ``comm(output_tensor, input_tensor, group=, async_op=)`` (FSDP2's
        ``AllGather``; its ``allocate`` is not used: the unit's buffers exist) runs this unit's
        all-gathers, once per plan segment, on views of the unit's flat buffers (this rank's
        chunk into the segment's ``world_size * chunk`` elements), returning a work or None.

        Raises:
            ValueError: ``comm`` is not callable, or the unit's plan has uneven chunks (the
                planner's choice where equal ones would pad), which an all-gather of equal
                chunks cannot move.
        """
        self._fsdp_state.unit.custom_all_gather = _check_custom_comm(self, comm)

    def set_custom_reduce_scatter(self, comm: Callable) -> None:
        """As FSDP2's: ``comm(output_tensor, input_tensor, group=, op=, async_op=)`` (FSDP2's
        ``ReduceScatter``) runs this unit's reduce-scatters (a sum), once per plan segment, on
        views of its flat gradient buffers; the output lands in ``.grad`` as c10d's does.

        Raises:
            ValueError: as :meth:`set_custom_all_gather`.
        """
        self._fsdp_state.unit.custom_reduce_scatter = _check_custom_comm(self, comm)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """As FSDP2's (not recursive): with ``False`` this unit's backward does not all-gather
        its parameters, for units whose backward does not read them (an embedding). Autograd
        raises if one it saved is read after all (its storage is freed)."""
        _check_bool("unshard_in_backward", unshard_in_backward)
        self._fsdp_state.unshard_in_backward = unshard_in_backward

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """Every parameter is in the reduce-scatter here, whichever ranks used it (so ranks that
        use different parameters, a mixture of experts, never mismatch). ``False`` (default):
        a parameter no rank used gets ``.grad`` ``None`` (see ``hooks.drop_unused_grads``: one
        small all-reduce per backward); ``True``: it keeps its zero gradient, as FSDP2 gives it
        with ``True``, and no all-reduce runs for these units."""
        _check_bool("reduce_scatter_unused_params", reduce_scatter_unused_params)
        _check_bool("recurse", recurse)
        for m in self.modules() if recurse else [self]:
            if isinstance(m, FSDPModule):
                m._fsdp_state.keep_unused_grads = reduce_scatter_unused_params

    def set_post_optim_event(self, event: torch.Event) -> None:
        """As FSDP2's: the root's next all-gather waits for ``event`` (recorded after the
        optimizer step), then forgets it. This runtime's all-gathers run on the current stream,
        which waits for the event; call it on the root with a new event each iteration."""
        if not isinstance(event, torch.Event) and not hasattr(event, "wait"):
            raise ValueError(f"event must be a torch.Event, got {type(event).__name__}")
        state = self._fsdp_state
        if state.root is None:
            state._lazy_init()
        state.root.post_optim_event = event

    def reset_iter_state(self) -> None:
        """As FSDP2's, after an exception cut a forward or backward short, on the root: the
        reduce-scatter in flight finishes, gradients not reduced yet are dropped, every unit is
        resharded and the iteration's state cleared (restart a gradient accumulation; call
        ``zero_grad()`` before the next step).

        Raises:
            RuntimeError: called on a module that is not a root.
        """
        state = self._fsdp_state
        if state.root is not None and not state.is_root:
            raise RuntimeError(
                "reset_iter_state must be called on the root fully_shard module (the one "
                f"forwarded first), not on {type(self).__name__}"
            )
        if state.root is not None:
            state.root.reset()

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this unit's summed gradients by ``factor`` instead of the data-parallel world
        size (``1.0``: the plain sum). Not recursive, as FSDP2."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise ValueError(f"factor must be a positive number, got {factor!r}")
        self._fsdp_state.unit.gradient_divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """FSDP2's deprecated name of :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted as FSDP2: the collectives here always sum; the division (by the world size
        or :meth:`set_gradient_divide_factor`'s factor) follows them."""
        _check_bool("enable", enable)

    def load_state_dict(
        self, state_dict: Mapping[str, object], strict: bool = True, assign: bool = False
    ):
        """Load into the sharded parameters in place. Values may be DTensors with this module's
        placements, DTensors with other placements (redistributed), or full tensors (this rank's
        RaggedShard run is taken from them). Other entries go through ``nn.Module``'s loader."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
        _check_bool("strict", strict)
        if assign:
            raise ValueError(
                "assign=True is not supported by fully_shard modules (loading is in place)"
            )
        handled: set[str] = set()
        with torch.no_grad():
            for prefix, unit in self.fsdp_units():
                prefix = f"{prefix}." if prefix else ""
                for slot, param, layout in zip(unit.slots, unit.sharded_params, unit.layouts):
                    for key in _slot_keys(prefix, slot, self):
                        if key in state_dict:
                            _load_sharded(param, layout, unit.rank, state_dict[key], key)
                            handled.add(key)
        rest = {k: v for k, v in state_dict.items() if k not in handled}
        result = nn.Module.load_state_dict(self, rest, strict=False)
        expected = set(self.state_dict().keys())
        missing = [k for k in result.missing_keys if k not in handled]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(
                f"Error(s) in loading state_dict for {type(self).__name__}: missing keys {missing}, "
                f"unexpected keys {result.unexpected_keys}"
            )
        result.missing_keys[:] = [k for k in missing if k in expected]
        return result


class UnshardHandle(TorchUnshardHandle):
    """What :meth:`FSDPModule.unshard` returns with ``async_op=True``: an instance of FSDP2's
    ``UnshardHandle``."""

    def __init__(self, state: FSDPState) -> None:
        self._state: FSDPState | None = state

    def wait(self) -> None:
        """Finish the all-gather and register the unsharded parameters."""
        if self._state is not None:
            self._state.unit.wait_unshard()
            _register_unsharded(self._state)
            self._state = None


def _register_unsharded(state: FSDPState) -> None:
    """``FSDPModule.unshard``'s registration: the unsharded parameters in ``_parameters``, as
    FSDP2; an optimizer built from them refuses to step (they are not what trains)."""
    state.unit.register(Registration.UNSHARDED)
    mark_unsharded(state)


def share_comm_ctx(modules: list[nn.Module]) -> None:
    """FSDP2's ``share_comm_ctx`` (pipeline stages, each a root, sharing CUDA streams): these
    units have no streams of their own (collectives run on the process group's, copies on the
    current stream), so there is nothing to share; the modules are checked as FSDP2 does.

    Raises:
        ValueError: ``modules`` is not a list of modules sharded by :func:`fully_shard`.
    """
    if not isinstance(modules, (list, tuple)):
        raise ValueError(f"modules must be a list of FSDPModules, got {type(modules).__name__}")
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(f"modules must be a list of FSDPModules, got an item {m!r}")


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run ``module``'s ``method_name`` (e.g. ``generate``) between the unit's pre- and
    post-forward hooks, as its ``forward`` (torch FSDP2's function; torch's own, imported from
    ``torch.distributed.fsdp``, reaches this one for these modules). A module sharded by
    neither runtime is left as it is (FSDP2's no-op); one sharded by torch's goes to torch's.

    Raises:
        TypeError: ``module`` is not an ``nn.Module`` or ``method_name`` not a str.
        ValueError: ``method_name`` is not a method name of ``module``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {module!r}")
    if not isinstance(module, FSDPModule):
        from torch.distributed.fsdp import register_fsdp_forward_method as torchs

        torchs(module, method_name)
        return
    if not isinstance(method_name, str):
        raise TypeError(f"method_name must be a str, got {method_name!r}")
    if not callable(getattr(module, method_name, None)):
        raise ValueError(
            f"method_name={method_name!r}: {type(module).__name__} has no method of that name"
        )
    method = getattr(module, method_name)
    state = module._fsdp_state

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        args, kwargs = state._pre_forward(self, args, kwargs)
        return state._post_forward(self, args, method(*args, **kwargs))

    setattr(module, method_name, wrapped.__get__(module, type(module)))


def _check_supported(module: FSDPModule, what: str) -> None:
    """``ValueError`` naming ``what`` if ``module``'s unit mesh cannot run it (a
    ``state_sharding`` other than ``fully_shard``'s default: its collectives run over several
    groups of their own; :meth:`~ragged_placement.fsdp.mesh.UnitMesh.check_supported`)."""
    module._fsdp_state.unit.dp.check_supported(what, type(module).__name__)


def _check_custom_comm(module: FSDPModule, comm: object) -> Callable:
    if not callable(comm):
        raise ValueError(f"comm must be callable, got {comm!r}")
    _check_supported(module, "a custom all-gather / reduce-scatter")
    unit = module._fsdp_state.unit
    uneven = [s for b in unit.buffers for s in b.plan.segments if s.rank_starts is not None]
    if uneven:
        raise ValueError(
            f"{type(module).__name__}'s unit has {len(uneven)} plan segment(s) of uneven chunks "
            f"(the planner's choice where equal chunks would pad its parameters by more than "
            f"1%), which a custom all-gather / reduce-scatter of equal chunks cannot move"
        )
    return comm


def _prefetch_states(modules: object) -> list[FSDPState]:
    if not isinstance(modules, (list, tuple)):
        raise ValueError(f"modules must be a list of FSDPModules, got {type(modules).__name__}")
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(f"modules must be FSDPModules (fully_shard's), got {m!r}")
    return [m._fsdp_state for m in modules]


_NO_STAGING = (
    "FSDPModule.{} (torch FSDP2) is not supported by ragged_placement's fully_shard: its "
    "all-gather writes straight into the unsharded parameters' storage and gradients land in "
    "the reduce-scatter's input, so there is no staging buffer to allocate from the process "
    "group or symmetric memory; use torch's fully_shard for it"
)


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def _slot_keys(prefix: str, slot: ParamSlot, root: nn.Module) -> list[str]:
    """State-dict keys of a slot relative to ``root`` (a tied parameter has several)."""
    names = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
    keys = []
    for module, attr in slot.owners:
        name = names.get(id(module))
        if name is not None:
            keys.append(f"{name}.{attr}" if name else attr)
    return keys


def _load_sharded(
    param: nn.Parameter, layout: ParamLayout, shard_rank: int, value: object, key: str
) -> None:
    placements = tuple(param.placements)
    local = param._local_tensor
    if isinstance(value, DTensor):
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(
                f"state_dict[{key!r}] has shape {tuple(value.shape)}, expected {tuple(param.shape)}"
            )
        if value.device_mesh != param.device_mesh or tuple(value.placements) != placements:
            value = value.redistribute(param.device_mesh, placements)
        local.copy_(value.to_local())
    elif isinstance(value, torch.Tensor):
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(
                f"state_dict[{key!r}] has shape {tuple(value.shape)}, expected {tuple(param.shape)}"
            )
        local.copy_(layout.local_from_full(value.to(local.device), shard_rank))
    else:
        raise ValueError(f"state_dict[{key!r}] must be a tensor, got {type(value).__name__}")
