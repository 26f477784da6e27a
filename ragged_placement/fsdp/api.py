"""``fully_shard``: torch FSDP2's call shape on a zero-copy, RaggedShard-placed runtime."""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import UnshardHandle as TorchUnshardHandle
from torch.distributed.tensor import DTensor, Shard

from ragged_placement.fsdp._validation import (
    check_granularity,
    check_not_managed,
    record_managed,
    unmatched_patterns,
)
from ragged_placement.fsdp.common import UnitOptions
from ragged_placement.fsdp.fp8 import check_quant, convert_unit_linears
from ragged_placement.fsdp.hooks import FSDPState, drop_unused_grads
from ragged_placement.fsdp.mesh import DataParallelMesh, PostForwardMesh
from ragged_placement.fsdp.param import ParamLayout, ParamSlot, mesh_device
from ragged_placement.fsdp.unit import FSDPUnit
from ragged_placement.planner.granularity import resolve_policy
from ragged_placement.quant import BlockFP8Config

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]


# MixedPrecisionPolicy, OffloadPolicy and CPUOffloadPolicy are torch FSDP2's own classes,
# re-exported: ``from torch.distributed.fsdp import MixedPrecisionPolicy`` and
# ``from ragged_placement.fsdp import MixedPrecisionPolicy`` give the same class (its fields,
# ``param_dtype``, ``reduce_dtype``, ``output_dtype`` and ``cast_forward_inputs``, are the same in
# torch 2.11 and 2.13).


class FSDPModule:
    """Mixin added to the class of every module passed to :func:`fully_shard`.

    It carries torch FSDP2's ``FSDPModule`` methods: those this runtime honours exactly work,
    the others raise ``NotImplementedError`` naming themselves (never an ``AttributeError``
    or a silent no-op).

    It does not derive from ``torch.distributed.fsdp.FSDPModule``, so
    ``isinstance(m, torch.distributed.fsdp.FSDPModule)`` is ``False`` (import ``FSDPModule``
    from here instead). torch's code that branches on that ``isinstance`` goes on to FSDP2's
    private state, which this runtime does not have: ``torch.distributed.pipelining``'s stages
    then call ``fully_shard.state(m)._state_ctx.all_states`` and each state's
    ``_fsdp_param_groups`` (an ``AttributeError`` here, where today pipelining drives these
    modules as plain modules, see :meth:`reduce_gradients`), torch's ``FSDPModule._apply`` and
    ``__new__`` assume FSDP2's parameter groups and class layout, and dynamo's
    ``torch.compile`` package pickler looks the class up in FSDP2's class table.
    ``clip_grad_norm_`` and ``torch.distributed.checkpoint`` do not branch on it and work on
    these modules' DTensor parameters as they are.
    """

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

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this unit's parameters and register the unsharded ones; with
        ``async_op=True`` only issue the all-gather and return a handle whose ``wait()``
        finishes it (the next forward waits for it too), as FSDP2."""
        _check_bool("async_op", async_op)
        unit = self._fsdp_state.unit
        unit.unshard(async_op=async_op)
        if async_op:
            return UnshardHandle(unit)
        unit.register(sharded=False)
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
        with unit.unregistered():
            module = super()._apply(fn, recurse)
        unit.apply_(fn)
        return module

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

        Use it where no backward with sync on follows, e.g. after a pipeline schedule whose
        micro-batches ran with sync off: ``torch.distributed.pipelining`` only drives torch's own
        FSDP (see the class docstring), and its schedules divide the gradients they can see by
        the number of micro-batches before these exist, so pass ``scale=1 / n_microbatches``
        for a mean-reduced loss. Collective: every rank of the units' meshes must call it after running backward through
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
        """Only ``True`` (HSDP's all-reduce always follows the reduce-scatter)."""
        _check_bool("requires_all_reduce", requires_all_reduce)
        _check_bool("recurse", recurse)
        if not requires_all_reduce:
            raise NotImplementedError(
                "set_requires_all_reduce(False) is not implemented: use "
                "set_requires_gradient_sync(False), which skips reduce-scatter and all-reduce"
            )

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
        self, hook: Callable[[torch.Tensor], None], *, stream: object = None
    ) -> None:
        """As FSDP2's: ``hook(reduce_output)`` runs on the unit's reduce-scatter output (after
        HSDP's all-reduce), the summed flat gradient shard of each of its buffers (one per
        dtype), in place, before the division and the landing in ``.grad``. It runs on the
        current stream, where that output is ready: ``stream`` must be ``None``."""
        if not callable(hook):
            raise ValueError(f"hook must be callable, got {hook!r}")
        if stream is not None:
            raise ValueError(
                "stream must be None: the hook runs on the current stream, after the "
                "reduce-scatter it reads"
            )
        self._fsdp_state.unit.all_reduce_hook = hook

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


def _not_implemented(name: str):
    def method(self, *args, **kwargs):
        raise NotImplementedError(
            f"FSDPModule.{name} (torch FSDP2) is not implemented by ragged_placement's fully_shard"
        )

    method.__name__ = name
    method.__doc__ = f"torch FSDP2's ``{name}``: raises ``NotImplementedError`` here."
    return method


# torch FSDP2's FSDPModule methods (2.11 - 2.13) without a counterpart here: they say so.
for _name in (
    "set_custom_all_gather",
    "set_custom_reduce_scatter",
    "set_reduce_scatter_max_input_buffers",
    "set_separate_reduce_scatter_group",
    "set_allocate_memory_from_process_group_for_comm",
    "set_symm_mem_for_comm",
):
    setattr(FSDPModule, _name, _not_implemented(_name))
del _name


class UnshardHandle(TorchUnshardHandle):
    """What :meth:`FSDPModule.unshard` returns with ``async_op=True``: an instance of FSDP2's
    ``UnshardHandle``."""

    def __init__(self, unit: FSDPUnit) -> None:
        self._unit: FSDPUnit | None = unit

    def wait(self) -> None:
        """Finish the all-gather and register the unsharded parameters."""
        if self._unit is not None:
            self._unit.wait_unshard()
            self._unit.register(sharded=False)
            self._unit = None


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
            raise ValueError(f"Expects list of FSDPModules but got {m!r}")


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run ``module``'s ``method_name`` (e.g. ``generate``) between the unit's pre- and
    post-forward hooks, as its ``forward`` (torch FSDP2's function; torch's own, imported from
    ``torch.distributed.fsdp``, reaches this one for these modules). A module sharded by
    neither runtime is left as it is (FSDP2's no-op); one sharded by torch's goes to torch's.

    Raises:
        ValueError: ``method_name`` is not a method name of ``module``.
    """
    if isinstance(module, TorchFSDPModule) or not isinstance(module, FSDPModule):
        from torch.distributed.fsdp import register_fsdp_forward_method as torchs

        torchs(module, method_name)
        return
    if not isinstance(method_name, str):
        raise TypeError(f"method_name must be a str, got {method_name!r}")
    if not callable(getattr(module, method_name, None)):
        raise ValueError(f"{type(module).__name__} does not have a method {method_name!r}")
    method = getattr(module, method_name)
    state = module._fsdp_state

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        args, kwargs = state._pre_forward(self, args, kwargs)
        return state._post_forward(self, args, method(*args, **kwargs))

    setattr(module, method_name, wrapped.__get__(module, type(module)))


def _prefetch_states(modules: object) -> list[FSDPState]:
    if not isinstance(modules, (list, tuple)):
        raise ValueError(f"modules must be a list of FSDPModules, got {type(modules).__name__}")
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(f"modules must be FSDPModules (fully_shard's), got {m!r}")
    return [m._fsdp_state for m in modules]


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


# Every module whose parameters a fully_shard unit owns -> that fully_shard module's class name
# (torch's fully_shard reaching one of them raises naming it: ragged_placement._install).
_SHARDED_BY: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


def sharded_by(module: nn.Module) -> str | None:
    """The class name of the ``fully_shard`` module whose unit owns ``module``'s parameters."""
    return _SHARDED_BY.get(module)


_CLASS_LOCK = threading.Lock()
_FSDP_CLASSES: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    with _CLASS_LOCK:
        if cls not in _FSDP_CLASSES:
            _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        return _FSDP_CLASSES[cls]


def _default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise ValueError(
            "mesh=None needs an initialized default process group (dist.init_process_group)"
        )
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _root_modules(modules: Sequence[nn.Module]) -> list[nn.Module]:
    """``modules`` without those nested in another of them (FSDP2 groups the roots), once each."""
    roots: list[nn.Module] = []
    for m in modules:
        if any(m is r for r in roots):
            continue
        if not any(m is not o and any(m is d for d in o.modules()) for o in modules):
            roots.append(m)
    return roots


def _check_modules(module: object) -> list[nn.Module]:
    """The modules of one unit (``module`` or the roots of a list of modules), validated."""
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise ValueError("module must be an nn.Module or a non-empty list of nn.Modules, got []")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise ValueError(
                f"module must be an nn.Module or a list of nn.Modules, got {type(m).__name__}"
            )
        if isinstance(m, FSDPModule):
            raise ValueError(f"fully_shard was already applied to this {type(m).__name__}")
        if isinstance(m, TorchFSDPModule):
            raise ValueError(
                f"torch.distributed.fsdp.fully_shard was already applied to this "
                f"{type(m).__name__}: ragged_placement's fully_shard and torch's cannot share a "
                f"module; shard the whole model with one of them"
            )
    return _root_modules(modules)


def _resolve_reshard_after_forward(value: object, shard_size: int) -> bool | int:
    """FSDP2's ``reshard_after_forward`` as a bool, or the int ``1 < N < shard_size`` of the
    groups to reshard to (see :func:`fully_shard`)."""
    if value is None or isinstance(value, bool):
        return value is not False
    if not isinstance(value, int):
        raise ValueError(
            f"reshard_after_forward must be a bool, None or an int, got {value!r}"
        )
    if value < 1 or value > shard_size or shard_size % value:
        raise ValueError(
            f"reshard_after_forward={value} must be a factor of the shard world size "
            f"{shard_size} (the world size to reshard to after forward)"
        )
    if value == shard_size:
        return True
    if value == 1:
        return False
    return int(value)


def _reshard_setting(value: object, unit) -> bool | PostForwardMesh:
    """What a unit's hooks take for ``reshard_after_forward`` ``value``: a bool, or the
    :class:`PostForwardMesh` of an int ``1 < N < W`` (its groups created on first use)."""
    resolved = _resolve_reshard_after_forward(value, unit.dp.shard_size)
    if isinstance(resolved, bool):
        return resolved
    return PostForwardMesh.of(unit.dp, resolved)


def _check_offload_policy(offload_policy: object) -> CPUOffloadPolicy | None:
    """The ``CPUOffloadPolicy`` to honour, or ``None`` for ``OffloadPolicy()`` (no offload).

    ``pin_memory=True`` needs an accelerator (pinned host memory is allocated through its
    driver): without one torch's allocator raises ``RuntimeError``, as does FSDP2's
    ``fully_shard`` with this policy; here it is a ``ValueError`` naming the argument."""
    if not isinstance(offload_policy, OffloadPolicy):
        raise ValueError(
            f"offload_policy must be a torch.distributed.fsdp.OffloadPolicy, got {offload_policy!r}"
        )
    if not isinstance(offload_policy, CPUOffloadPolicy):
        return None
    _check_bool("offload_policy.pin_memory", offload_policy.pin_memory)
    if offload_policy.pin_memory and not torch.accelerator.is_available():
        raise ValueError(
            f"offload_policy={offload_policy!r}: pin_memory=True needs an accelerator (pinned "
            f"host memory is allocated through its driver) and none is available; pass "
            f"CPUOffloadPolicy(pin_memory=False)"
        )
    return offload_policy


def _torch_fsdp_error(root: nn.Module, path: str, child: nn.Module) -> ValueError:
    return ValueError(
        f"fully_shard({type(root).__name__}): its submodule {path!r} ({type(child).__name__}) was "
        f"sharded by torch.distributed.fsdp.fully_shard; ragged_placement's fully_shard and "
        f"torch's cannot be mixed in one model: shard every module with one of them"
    )


def _collect_params(
    modules: Sequence[nn.Module], ignored: set[int]
) -> tuple[list[ParamSlot], list[nn.Parameter], list[nn.Module]]:
    """Parameters of ``modules`` not owned by a ``fully_shard`` module below them and not in
    ``ignored`` (ids), deduplicated. With several modules, names start with the module's index
    in the list (``"1.weight"``)."""
    slots: dict[int, ParamSlot] = {}
    params: dict[int, nn.Parameter] = {}
    owned_modules: list[nn.Module] = []
    seen: set[int] = set()
    for i, module in enumerate(modules):
        base = f"{i}." if len(modules) > 1 else ""
        stack = [(base, module)]
        while stack:
            prefix, m = stack.pop()
            if id(m) in seen:
                continue
            seen.add(id(m))
            owned_modules.append(m)
            for attr, p in m._parameters.items():
                if p is None or id(p) in ignored:
                    continue
                if id(p) in slots:
                    slots[id(p)].owners.append((m, attr))
                else:
                    # A tensor-parallel DTensor is planned on its TP-local shape.
                    shape = p._local_tensor.shape if isinstance(p, DTensor) else p.shape
                    slots[id(p)] = ParamSlot(f"{prefix}{attr}", [(m, attr)], shape, p.requires_grad)
                    params[id(p)] = p
            for name, child in reversed(list(m._modules.items())):
                if child is None or isinstance(child, FSDPModule):
                    continue
                if isinstance(child, TorchFSDPModule):
                    raise _torch_fsdp_error(module, f"{prefix[len(base):]}{name}", child)
                stack.append((f"{prefix}{name}.", child))
    order = list(slots)
    return [slots[i] for i in order], [params[i] for i in order], owned_modules


def _check_ignored_params(ignored_params: object) -> set[int]:
    if ignored_params is None:
        return set()
    if not isinstance(ignored_params, (set, frozenset, list, tuple)) or not all(
        isinstance(p, nn.Parameter) for p in ignored_params
    ):
        raise ValueError(
            f"ignored_params must be a set of nn.Parameters, got {type(ignored_params).__name__}"
        )
    return {id(p) for p in ignored_params}


def _check_shard_placements(
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None,
    slots: list[ParamSlot],
    params: list[nn.Parameter],
    granularity,
) -> None:
    """Check FSDP2's ``shard_placement_fn`` against the planner's granularities (see
    :func:`fully_shard`): ``None`` and ``Shard(0)`` are what the runtime does, others raise."""
    if shard_placement_fn is None:
        return
    if not callable(shard_placement_fn):
        raise ValueError(f"shard_placement_fn must be callable, got {shard_placement_fn!r}")
    for slot, p in zip(slots, params):
        result = shard_placement_fn(p)
        if result is None:
            continue
        if type(result) is not Shard:
            raise ValueError(
                f"shard_placement_fn returned {result!r} for parameter {slot.fqn!r}: fully_shard "
                f"takes None or Shard(dim) (a per-parameter mesh is not supported)"
            )
        ndim = max(len(slot.shape), 1)
        dim = result.dim + ndim if result.dim < 0 else result.dim
        if not 0 <= dim < ndim:
            raise ValueError(
                f"shard_placement_fn returned {result!r} for parameter {slot.fqn!r} of shape "
                f"{tuple(slot.shape)}: dim out of range"
            )
        if dim != 0:
            raise ValueError(
                f"shard_placement_fn returned {result!r} for parameter {slot.fqn!r} of shape "
                f"{tuple(slot.shape)}: a RaggedShard local tensor is a run of whole dim-0 rows, so "
                f"a slice along dim {dim} cannot be expressed. Return None or Shard(0): uneven "
                f"dim-0 sizes (FSDP2's reason for Shard(dim > 0), e.g. fewer experts than ranks) "
                f"are planned without padding"
            )
        gran = resolve_policy(granularity, slot.fqn, tuple(slot.shape))
        if gran.kind == "element" and len(slot.shape) >= 2:
            raise ValueError(
                f"shard_placement_fn returned Shard(0) for parameter {slot.fqn!r}, but "
                f"granularity gives it {gran}, which cuts inside dim-0 rows: drop one of them"
            )


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = True,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    granularity=None,
    quant: BlockFP8Config | None = None,
) -> nn.Module | list[nn.Module]:
    """Shard ``module``'s parameters over ``mesh`` as one FSDP unit (call on inner modules first).

    The parameters of ``module`` that no inner ``fully_shard`` module owns are packed by
    :func:`ragged_placement.planner.plan` into one flat buffer; each becomes an
    ``nn.Parameter(DTensor)`` with a :class:`RaggedShard` placement whose local tensor is a view
    of this rank's chunk. Forward and backward all-gather the unit with one collective into a
    buffer the unsharded parameters are views of; gradients are reduce-scattered (averaged over
    the mesh) with one collective into a flat buffer the sharded ``.grad`` DTensors are views of.
    When ``module`` wraps other ``fully_shard`` modules (a root holding the embedding and the
    output projection), its layout follows its submodules where that pads no more, so that a
    submodule's gradient buffer is only allocated when backward reaches it.

    The arguments shared with ``torch.distributed.fsdp.fully_shard`` take FSDP2's values, so
    changing the import is enough; where FSDP2 allows a value this runtime cannot honour exactly,
    it raises (never a silent difference). Mixing this ``fully_shard`` and torch's in one model
    is refused with a ``ValueError`` naming the module, in both orders: torch's on ``module`` or
    a module below it before this call, and torch's over a module this one sharded (a guard on
    FSDP2's parameter initialization, :data:`ragged_placement._install.FSDP2_PATCHES`).

    Args:
        module: the module to shard; its class is swapped to a subclass that also derives from
            :class:`FSDPModule` (as torch FSDP2 does). Returned for convenience. A list of
            modules forms one unit (one all-gather before the first of them runs forward, one
            reduce-scatter after all of their backwards; modules nested in another of the
            list belong to it); their parameter names, as seen by ``granularity``, start with
            the module's index in the list (``"0.weight"``). The list is returned.
        mesh: a 1-D device mesh; ``None`` builds one over the default process group (``cuda``
            for NCCL, else ``cpu``). A 2-D ``(replicate, shard)`` mesh gives HSDP: the unit is
            sharded over dim 1 and its gradients are also all-reduced over dim 0. Parameters
            that are DTensors on a tensor-parallel mesh (``parallelize_module`` on a sibling
            sub-mesh of the same root) are planned on their TP-local shape and become DTensors
            on the ``(mesh..., tp)`` mesh (see :mod:`ragged_placement.fsdp.param`).
        reshard_after_forward: ``True`` (or ``None``, FSDP2's default): free the unsharded
            parameters after forward and all-gather them again in backward; ``False``: keep
            them until backward. The outermost (root) unit always keeps them (FSDP2 does so
            for ``None``; with an explicit ``True`` it re-gathers the root, to the same values),
            which changes no result. As FSDP2, an ``int`` ``N`` is the world size to reshard to
            after forward and must divide the shard world size ``W``; ``W`` means ``True`` and
            ``1`` means ``False``. For ``1 < N < W`` each rank keeps, between forward and
            backward, ``1/N`` of the unit's gathered parameters (one copy out of the all-gather
            buffer, which is then freed), and backward all-gathers within its group of ``N``
            consecutive ranks (rows of ``mesh.mesh.reshape(-1, N)``; for HSDP the 2-D mesh
            flattened, as FSDP2 does), e.g. inside a node. The groups are created once per mesh
            and ``N`` by their members (collective over each group at that call). FP8 units
            (``quant``) and tensor-parallel parameters take it too. Values that are not a bool,
            ``None`` or a divisor of ``W`` raise ``ValueError``.
        shard_placement_fn: FSDP2's per-parameter placement, ``Callable[[nn.Parameter],
            Shard | None]``, called once per managed parameter. ``None`` and ``Shard(0)`` are
            this runtime's layout: RaggedShard cuts a parameter between whole dim-0 rows (the
            planner's ``row`` or a coarser granularity). ``Shard(d)`` for ``d > 0`` (a slice of
            dim ``d`` on every rank) cannot be expressed by a run of rows and raises
            ``ValueError``, as does a ``Shard(0)`` for a parameter that ``granularity`` cuts
            inside rows; layout choices beyond FSDP2's go through ``granularity``.
        mp_policy: parameter / reduction dtypes: torch's
            :class:`torch.distributed.fsdp.MixedPrecisionPolicy` (``MixedPrecisionPolicy`` of
            this package is the same class). ``param_dtype`` is the dtype of the all-gather and
            of the unsharded parameters (the sharded ones, which the optimizer sees, keep their
            dtype), ``reduce_dtype`` that of the gradient reduce-scatter (default
            ``param_dtype``), ``output_dtype`` casts floating outputs, ``cast_forward_inputs``
            casts floating inputs to ``param_dtype``.
        offload_policy: torch's :class:`~torch.distributed.fsdp.OffloadPolicy` (no offload)
            or :class:`~torch.distributed.fsdp.CPUOffloadPolicy`, as FSDP2: the unit's sharded
            chunk and sharded gradient live on CPU (pinned with ``pin_memory=True``, which
            needs an accelerator, else ``ValueError``), so each sharded parameter is a DTensor
            on ``mesh`` whose local tensor is on CPU and the optimizer steps on CPU. Before
            each all-gather the chunk is copied host-to-device into the send buffer (with the
            ``param_dtype`` cast); the all-gather output and the unsharded parameters stay on
            the mesh's device; the averaged reduce-scatter (and HSDP all-reduce) output is
            copied device-to-host into the sharded gradient. Moving the module to another
            device than CPU afterwards (``to("cuda")``, ``to_empty(device="cuda")``) raises
            ``ValueError`` (FSDP2 raises at the first forward); materialize a meta-device model
            with ``to_empty(device="cpu")``. See ``docs/fsdp.md``.
        ignored_params: parameters left unsharded and unmanaged, as FSDP2: not planned, not
            moved to the mesh's device, their gradients not reduced (each rank keeps its own).
        granularity: the planner's policy: ``None``, a callable ``(name, shape) -> Granularity``
            or a ``{fnmatch pattern: Granularity}`` dict over parameter names in ``module``.
        quant: block-wise FP8 training (:class:`~ragged_placement.quant.BlockFP8Config`): the
            unit's ``nn.Linear`` modules become :class:`~ragged_placement.quant.FP8Linear`, their
            weights (unless tied to a non-Linear) are planned at ``block`` granularity, each
            rank quantizes its own blocks, and the unit's one all-gather moves FP8 bytes and
            block scales; master weights stay in the sharded buffer. See
            :mod:`ragged_placement.fsdp.fp8`.

    Raises:
        ValueError: ``module`` is not a module (or list of them), was sharded already by this
            ``fully_shard`` or torch's, or holds a module torch's sharded; an argument has a
            wrong type or a value this runtime cannot honour exactly (named in the message).
    """
    modules = _check_modules(module)
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise ValueError(
            f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got {mp_policy!r}"
        )
    ignored = _check_ignored_params(ignored_params)
    mesh = mesh if mesh is not None else _default_mesh()
    dp = DataParallelMesh.of(mesh)
    _resolve_reshard_after_forward(reshard_after_forward, dp.shard_size)  # checked before building
    offload = _check_offload_policy(offload_policy)
    device = mesh_device(mesh)
    check_granularity(granularity)
    slots, params, owned_modules = _collect_params(modules, ignored)
    where = type(modules[0]).__name__
    check_not_managed([s.fqn for s in slots], params, where)
    _check_shard_placements(shard_placement_fn, slots, params, granularity)
    if check_quant(quant) is not None:
        for m in modules:
            convert_unit_linears(m, slots, params, quant)
        slots, params, owned_modules = _collect_params(modules, ignored)  # owners: FP8Linears
    originals = list(params)  # the parameter objects this unit takes over (before any move)
    # Tensors on the meta device stay there until ``to_empty`` (FSDP2's meta-device init).
    for m in owned_modules:
        for k, b in m._buffers.items():
            if b is not None and b.device != device and not b.is_meta:
                m._buffers[k] = b.to(device)
    # Under CPU offload the unit copies each rank's run straight into its CPU chunk.
    if offload is None and params and any(p.device != device and not p.is_meta for p in params):
        params = [p if p.is_meta else p.to(device) for p in params]
    wraps_units = any(
        isinstance(sub, FSDPModule) for m in modules for sub in m.modules() if sub is not m
    )
    options = UnitOptions(
        mp_policy.param_dtype, mp_policy.reduce_dtype, granularity, quant,
        split_by_submodule=wraps_units, offload_policy=offload,
    )
    unit = FSDPUnit(slots, params, mesh, options)
    state = FSDPState(modules, unit, _reshard_setting(reshard_after_forward, unit), mp_policy)
    state.unmatched_granularity = unmatched_patterns(granularity, modules)
    record_managed([s.fqn for s in slots], originals, where)
    for m in modules:
        m._fsdp_state = state
        m.__class__ = _fsdp_class(type(m))
    for m in owned_modules:
        _SHARDED_BY[m] = type(modules[0]).__name__
    return module
