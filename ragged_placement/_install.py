"""Teach torch's DTensor about RaggedShard: every hook into torch, in one table.

torch (2.11-2.14) has no public extension point for a new placement: ``distribute_tensor``,
``redistribute_local_tensor``, the sharding propagator, the local-shape helpers, the random-op
dispatch and the checkpoint helpers only know ``Shard``, ``_StridedShard``, ``Replicate`` and
``Partial``. Each hook is a thin wrapper that handles specs containing a RaggedShard and passes
every other call to torch's own function unchanged, so DTensors without a RaggedShard behave
exactly as before.

:data:`PATCHES` is the whole list for DTensor: one :class:`Patch` per torch attribute we replace
(owner, name, the torch original we expect there, the replacement). :data:`FSDP2_PATCHES` holds
the rows for torch's FSDP2 (its ``register_fsdp_forward_method`` reaches ours for our modules,
its ``fully_shard.state`` returns our units' view for pipelining; a clear error when its
``fully_shard`` meets a RaggedShard parameter); :data:`OPTIM_PATCHES` the rows for torch's
Adam and AdamW, which step our units' parameters as runs of their flat shards;
:data:`PIPELINING_PATCHES` those for ``torch.distributed.pipelining``'s split backward (the
zero-bubble schedules' weight pass finds the tensors our units' forwards used).

Nothing is patched when the package is imported. :func:`install` runs the first time a
:class:`~ragged_placement.RaggedShard` is made (nothing reaches a patched path without one), and
:func:`install_fsdp2` the first time our ``fully_shard`` runs, :func:`install_pipelining` at the
first root forward of our units after ``torch.distributed.pipelining`` was imported (importing it
takes seconds; a pipeline schedule imports it before it runs a forward). Each checks every row's current
value against its expected original before patching anything (``RuntimeError`` naming the row
and what torch has there instead), so a torch that changed a target is left untouched rather
than half patched; :func:`uninstall` puts every original back. On a torch outside
:data:`ragged_placement._compat.SUPPORTED_TORCH` the import warns once, naming the version and
the rows whose target changed (:func:`changed_rows`).

Upstream, each row becomes a method on ``Placement`` consulted by the same call site
(``docs/upstream.md``; pytorch/pytorch#169320). The RaggedShard methods those call sites would
call (``_shard_tensor``, ``_to_replicate_tensor``, ``_transform_to``, ...) are defined in
:mod:`ragged_placement.transforms` and attached to the class there; the hooks here reach them
through :mod:`ragged_placement.distribute` and :mod:`ragged_placement.redistribute`.
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import sys
import threading
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from ragged_placement import _compat
from ragged_placement import placement as _placement
from ragged_placement.placement import RaggedShard

__all__ = [
    "FSDP2Hooks", "FSDP2_PATCHES", "OPTIM_PATCHES", "PATCHES", "PIPELINING_PATCHES", "Patch",
    "changed_rows", "install", "install_fsdp2", "install_pipelining", "installed", "uninstall",
    "warn_if_untested",
]

_ABSENT = object()
_LOCK = threading.RLock()  # re-entrant: building a row may make a RaggedShard


@dataclass(frozen=True)
class Patch:
    """One patched torch attribute.

    Attributes:
        owner: import path of the object that holds the attribute: a module
            (``"torch.distributed.tensor._api"``), a class (``"...:DTensor"``), or an object
            reached from one (``"...:DTensor._op_dispatcher.sharding_propagator"``).
        name: the attribute.
        expected: what torch has there, as ``module.qualname`` of the function (or the type of
            the object); ``None`` when torch has nothing there (we add the name).
        build: ``build(original) -> replacement``; ``original`` is torch's value as attribute
            lookup finds it (a class's function, an instance's bound method).
        params: the leading parameter names the replacement relies on (it calls torch's
            function with them, or swaps in a code object with exactly these), checked with
            ``expected``; ``None``: it passes every argument through as given.
    """

    owner: str
    name: str
    expected: str | None
    build: Callable[[object], object]
    params: tuple[str, ...] | None = None

    def resolve_owner(self) -> object:
        module, _, attrs = self.owner.partition(":")
        obj = importlib.import_module(module)
        for attr in filter(None, attrs.split(".")):
            obj = getattr(obj, attr)
        return obj


def _describe(value: object) -> str | None:
    """``module.qualname`` of a class / function / method / staticmethod / code object, else of
    its type."""
    if value is _ABSENT:
        return None
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if inspect.ismethod(value):
        value = value.__func__
    if inspect.iscode(value):
        return f"{value.co_filename.rsplit('/', 1)[-1]}:{value.co_qualname}"
    if isinstance(value, type) or callable(value) and hasattr(value, "__qualname__"):
        return f"{value.__module__}.{value.__qualname__}"
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _raw_get(owner: object, name: str) -> object:
    """The attribute as stored on ``owner`` itself (a class's staticmethod object, not the bare
    function), or ``_ABSENT`` (also when only ``owner``'s class has it: restoring then deletes
    the instance attribute); ``__code__`` of a function is read directly."""
    if name == "__code__":
        return owner.__code__  # type: ignore[attr-defined]
    return vars(owner).get(name, _ABSENT)


def _raw_set(owner: object, name: str, value: object) -> None:
    if value is _ABSENT:
        delattr(owner, name)
    else:
        setattr(owner, name, value)


def _ragged(placements) -> bool:
    return placements is not None and any(isinstance(p, RaggedShard) for p in placements)


def _current_mesh(device_mesh):
    from torch.distributed.tensor.device_mesh import _mesh_resources

    return device_mesh or _mesh_resources.get_current_mesh()


# -- distribute_tensor ---------------------------------------------------------------------------
def _distribute_tensor_trampoline(tensor, device_mesh=None, placements=None, *, src_data_rank=0):
    # Runs with torch's ``_api`` globals (its code object replaces distribute_tensor's).
    return _ragged_placement_distribute_tensor(  # noqa: F821 - injected into torch's _api module
        tensor, device_mesh, placements, src_data_rank=src_data_rank
    )


def _distribute_tensor_dispatch(fn):
    """The function the trampoline calls: ours for RaggedShard, a copy of torch's otherwise."""
    original = type(fn)(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    original.__kwdefaults__ = fn.__kwdefaults__

    def dispatch(tensor, device_mesh=None, placements=None, *, src_data_rank=0):
        if _ragged(placements):
            from ragged_placement.distribute import distribute_tensor

            return distribute_tensor(tensor, _current_mesh(device_mesh), placements, src_data_rank=src_data_rank)
        return original(tensor, device_mesh, placements, src_data_rank=src_data_rank)

    return dispatch


def _build_dispatch_global(_absent):
    from torch.distributed.tensor import _api

    return _distribute_tensor_dispatch(_api.distribute_tensor)


def _build_trampoline(_code):
    # Replacing the code of the function object itself reaches references users bound before
    # importing this package (``from torch.distributed.tensor import distribute_tensor``).
    return _distribute_tensor_trampoline.__code__


# -- redistribute ---------------------------------------------------------------------------------
def _build_redistribute(original):
    from ragged_placement.redistribute import redistribute_local_tensor as ragged_redistribute

    @functools.wraps(original)
    def redistribute_local_tensor(local_tensor, current_spec, target_spec, *args, **kwargs):
        if _ragged(current_spec.placements) or _ragged(target_spec.placements):
            return ragged_redistribute(local_tensor, current_spec, target_spec, **kwargs)
        return original(local_tensor, current_spec, target_spec, *args, **kwargs)

    return redistribute_local_tensor


# -- sharding propagation -------------------------------------------------------------------------
def _build_propagate_non_cached(original):
    from ragged_placement.ops import propagate, spec_has_ragged

    propagator = DTensor._op_dispatcher.sharding_propagator

    def propagate_op_sharding_non_cached(op_schema):
        if spec_has_ragged(op_schema):
            return propagate(propagator, op_schema)
        return original(op_schema)

    return propagate_op_sharding_non_cached


def _build_propagate_cached(original):
    # torch's own thread-local LRU cache class, over the RaggedShard-aware uncached path: keeps
    # ``cache_info`` / ``cache_clear`` (torch.distributed.tensor.debug) working.
    from torch.distributed.tensor._sharding_prop import LocalLRUCache

    return LocalLRUCache(DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding_non_cached)


# -- from_local -----------------------------------------------------------------------------------
def _build_global_tensor_info(original):
    from ragged_placement.distribute import global_shape_and_stride

    def compute_global_tensor_info(tensor, mesh, placements):
        if _ragged(placements):
            return global_shape_and_stride(tensor, mesh, placements, strict=False)
        return original(tensor, mesh, placements)

    return compute_global_tensor_info


def _build_from_local(original_fn):
    @functools.wraps(original_fn)
    # ``**kwargs``: what torch adds after ``stride`` (2.12's ``grad_placements``), passed through
    def from_local(local_tensor, device_mesh=None, placements=None, *, run_check=False, shape=None,
                   stride=None, **kwargs):
        if _ragged(placements):
            from ragged_placement.distribute import check_local_shape, global_shape_and_stride
            from ragged_placement.redistribute import validate_placements

            mesh = _current_mesh(device_mesh)
            ndim = len(shape) if shape is not None else local_tensor.ndim
            validate_placements(mesh, list(placements), ndim)
            if shape is None and stride is None:
                global_shape_and_stride(local_tensor, mesh, placements)  # raises if not inferable
            elif shape is not None and mesh.get_coordinate() is not None:
                check_local_shape(local_tensor, mesh, placements, shape, run_check)
        return original_fn(local_tensor, device_mesh, placements, run_check=run_check,
                           shape=shape, stride=stride, **kwargs)

    return staticmethod(from_local)


# -- pickling -------------------------------------------------------------------------------------
# torch's DTensor wrapper takes its local tensor's storage offset, so a RaggedShard DTensor whose
# local tensor starts inside its storage (a view of a ``fully_shard`` unit's flat buffer) has a
# nonzero ``data_ptr()`` while it has no storage: ``Tensor.__reduce_ex__`` and ``__deepcopy__``
# then take it for a dense tensor and fail on its storage. Such a DTensor is reduced and
# deep-copied as torch does any wrapper subclass (its local tensor, a view, is copied with its
# own storage), with the wrapper's offset 0, which means nothing for a storage-less wrapper;
# ``torch.load(weights_only=True)`` loads the result as it loads FSDP2's DTensors.
def _needs_wrapper_reduce(t: DTensor) -> bool:
    return t.storage_offset() != 0 and _ragged(t.placements)


def _wrapper_reduce(t: DTensor):
    state = torch._utils._get_obj_state(t)
    wrapper = (type(t), t.dtype, tuple(t.size()), t.stride(), 0, t.layout, t.device, t.requires_grad)
    return (torch._tensor._rebuild_from_type_v2,
            (torch._utils._rebuild_wrapper_subclass, type(t), wrapper, state))


def _build_reduce_ex(original):
    @functools.wraps(original)
    def __reduce_ex__(self, proto):
        return _wrapper_reduce(self) if _needs_wrapper_reduce(self) else original(self, proto)

    return __reduce_ex__


def _build_deepcopy(original):
    @functools.wraps(original)
    def __deepcopy__(self, memo):
        if not _needs_wrapper_reduce(self):
            return original(self, memo)
        if id(self) not in memo:
            rebuild, args = _wrapper_reduce(self)
            with torch.no_grad():
                new = rebuild(*copy.deepcopy(args, memo))
                if self.grad is not None:
                    new.grad = copy.deepcopy(self.grad, memo)
            memo[id(self)] = new
        return memo[id(self)]

    return __deepcopy__


# -- distributed checkpoint -----------------------------------------------------------------------
def _build_checkpoint_method(name: str):
    def build(original):
        from ragged_placement import checkpoint

        ragged_impl = getattr(checkpoint, name.strip("_"))

        def method(self, *args):
            if _ragged(self.placements):
                return ragged_impl(self, *args)
            return original(self, *args)

        return functools.update_wrapper(method, original)

    return build


def _build_distribute_tensors(original):
    """``set_model_state_dict(..., broadcast_from_rank0=True)`` slices each full tensor with
    ``compute_local_shape_and_global_offset``; a RaggedShard local tensor may be several boxes,
    so those keys take this rank's region directly."""

    @functools.wraps(original)
    def _distribute_tensors(local_state_dict, keys, device, pg=None):
        from ragged_placement.distribute import local_tensor_from_full

        rest = []
        for key in keys:
            value = local_state_dict.get(key)
            if value is None or torch.is_tensor(value) or not _ragged(value[0].placements):
                rest.append(key)
                continue
            local_state, full_tensor = value
            local = local_tensor_from_full(full_tensor, local_state.device_mesh, local_state.placements)
            if local_state.is_meta:
                local_state_dict[key] = DTensor.from_local(
                    local.detach().clone(), local_state.device_mesh, local_state.placements,
                    shape=local_state.shape, stride=local_state.stride(),
                )
            else:
                local_state.to_local().copy_(local)
                local_state_dict[key] = local_state
        return original(local_state_dict, rest, device, pg)

    return _distribute_tensors


# -- local shapes and offsets (factories, DCP planners, op rules, visualize_sharding) ------------
def _build_local_shape_and_offset(original):
    @functools.wraps(original)
    def _compute_local_shape_and_global_offset(global_shape, mesh_shape, my_coordinate, placements,
                                               skip_offset=False):
        if not _ragged(placements):
            return original(global_shape, mesh_shape, my_coordinate, placements, skip_offset)
        from ragged_placement.distribute import local_shape_and_global_offset

        coord = my_coordinate
        if callable(coord):
            coord = [coord(i) for i in range(len(mesh_shape))]
        return local_shape_and_global_offset(global_shape, mesh_shape, coord, placements, skip_offset=skip_offset)

    return _compute_local_shape_and_global_offset


def _local_shape_trampoline(global_shape, mesh_shape, my_coordinate, placements, skip_offset=False):
    # Runs with torch's ``_utils`` globals (its code object replaces the helper's).
    return _ragged_placement_local_shape_and_offset(  # noqa: F821 - injected into torch's _utils
        global_shape, mesh_shape, my_coordinate, placements, skip_offset
    )


def _build_local_shape_global(_absent):
    from torch.distributed.tensor import _utils

    fn = _utils._compute_local_shape_and_global_offset
    original = type(fn)(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    return _build_local_shape_and_offset(original)


def _build_local_shape_trampoline(_code):
    # Swapping the code of torch's function (not the module attribute) reaches every module that
    # bound it by name, imported before or after us (``debug._visualize_sharding``), without
    # importing them here (``torch.distributed.tensor.debug`` imports Dynamo: ~0.6 s).
    return _local_shape_trampoline.__code__


# -- random ops -----------------------------------------------------------------------------------
def _build_init_helper(original):
    @functools.wraps(original)
    def _dtensor_init_helper(init_op, size, device_mesh=None, placements=None, **kwargs):
        if _ragged(placements) and init_op in (torch.rand, torch.randn):
            from ragged_placement.rng import random_factory

            return random_factory(init_op, size, _current_mesh(device_mesh), placements, **kwargs)
        if _ragged(placements):
            from ragged_placement.redistribute import validate_placements

            validate_placements(_current_mesh(device_mesh), list(placements), len(size))
        return original(init_op, size, device_mesh, placements, **kwargs)

    return _dtensor_init_helper


def _build_local_results(original):
    from ragged_placement.rng import handles, local_random_results

    @functools.wraps(original)
    def _dispatch_get_local_results_slow_path(op_call, args, op_info):
        if handles(op_call, args):
            return local_random_results(op_call, args, op_info)
        return original(op_call, args, op_info)

    return _dispatch_get_local_results_slow_path


def _build_rng_guard(original):
    """torch's RNG offset helpers ignore placements they do not know, which would give every
    RaggedShard rank the same offset: refuse instead (our random ops never call them)."""

    @functools.wraps(original)
    def guarded(*args):
        spec = args[-1]
        if _ragged(getattr(spec, "placements", None)):
            raise NotImplementedError(
                f"torch.distributed.tensor._random.{original.__name__} does not know {spec.placements}; "
                f"random ops on RaggedShard DTensors run through ragged_placement.rng"
            )
        return original(*args)

    return guarded


_API = "torch.distributed.tensor._api"
_PROPAGATOR = f"{_API}:DTensor._op_dispatcher.sharding_propagator"
_REDISTRIBUTE = "torch.distributed.tensor._redistribute.redistribute_local_tensor"
_REDISTRIBUTE_PARAMS = ("local_tensor", "current_spec", "target_spec")
_UTILS = "torch.distributed.tensor._utils"

#: Every torch attribute the package replaces, in install order (uninstall runs it backwards).
PATCHES: tuple[Patch, ...] = (
    Patch(_API, "_ragged_placement_distribute_tensor", None, _build_dispatch_global),
    Patch(f"{_API}:distribute_tensor", "__code__", "_api.py:distribute_tensor", _build_trampoline,
          ("tensor", "device_mesh", "placements", "src_data_rank")),
    *(
        Patch(owner, "redistribute_local_tensor", _REDISTRIBUTE, _build_redistribute, _REDISTRIBUTE_PARAMS)
        for owner in ("torch.distributed.tensor._redistribute", _API, "torch.distributed.tensor._dispatch")
    ),
    Patch(_PROPAGATOR, "propagate_op_sharding_non_cached",
          "torch.distributed.tensor._sharding_prop.ShardingPropagator.propagate_op_sharding_non_cached",
          _build_propagate_non_cached),
    Patch(_PROPAGATOR, "propagate_op_sharding", "torch.distributed.tensor._sharding_prop.LocalLRUCache",
          _build_propagate_cached),
    Patch(_API, "compute_global_tensor_info", _compat.global_tensor_info_name(), _build_global_tensor_info,
          ("tensor", "mesh", "placements")),
    Patch(f"{_API}:DTensor", "from_local", f"{_API}.DTensor.from_local", _build_from_local,
          ("local_tensor", "device_mesh", "placements", "run_check", "shape", "stride")),
    Patch(f"{_API}:DTensor", "__reduce_ex__", "torch._tensor.Tensor.__reduce_ex__", _build_reduce_ex),
    Patch(f"{_API}:DTensor", "__deepcopy__", "torch._tensor.Tensor.__deepcopy__", _build_deepcopy),
    *(
        Patch(f"{_API}:DTensor", name, f"{_API}.DTensor.{name}", _build_checkpoint_method(name))
        for name in ("__create_write_items__", "__create_chunk_list__", "__get_tensor_shard__")
    ),
    Patch(_UTILS, "_ragged_placement_local_shape_and_offset", None, _build_local_shape_global),
    Patch(f"{_UTILS}:_compute_local_shape_and_global_offset", "__code__",
          "_utils.py:_compute_local_shape_and_global_offset", _build_local_shape_trampoline,
          ("global_shape", "mesh_shape", "my_coordinate", "placements", "skip_offset")),
    Patch("torch.distributed._state_dict_utils", "_distribute_tensors",
          "torch.distributed._state_dict_utils._distribute_tensors", _build_distribute_tensors,
          ("local_state_dict", "keys", "device", "pg")),
    Patch(_API, "_dtensor_init_helper", f"{_API}._dtensor_init_helper", _build_init_helper,
          ("init_op", "size", "device_mesh", "placements")),
    Patch(f"{_API}:DTensor._op_dispatcher", "_dispatch_get_local_results_slow_path",
          "torch.distributed.tensor._dispatch.OpDispatcher._dispatch_get_local_results_slow_path",
          _build_local_results, ("op_call", "args", "op_info")),
    *(
        Patch("torch.distributed.tensor._random", name, f"torch.distributed.tensor._random.{name}",
              _build_rng_guard)
        for name in _compat.rng_offset_helpers()
    ),
)


# -- torch FSDP2 ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class FSDP2Hooks:
    """What the FSDP2 rows call into our runtime with (``ragged_placement.fsdp`` passes them to
    :func:`install_fsdp2`; this module imports nothing of the runtime).

    Attributes:
        module_type: our ``FSDPModule`` class.
        register_forward_method: our ``register_fsdp_forward_method(module, name)``.
        sharded_by: ``sharded_by(module)``: the class name of our unit owning ``module``'s
            parameters, or ``None``.
        state_view: ``state_view(module)``: what torch's ``fully_shard.state`` returns for our
            module (pipelining's view), or ``None``.
        forward_tensors: ``forward_tensors(weights)``: ``weights`` with each of our sharded
            parameters replaced by the unsharded parameter its forward used.
    """

    module_type: type
    register_forward_method: Callable[[object, str], None]
    sharded_by: Callable[[object], str | None]
    state_view: Callable[[object], object | None]
    forward_tensors: Callable[[Iterable], list]


_fsdp2_hooks: FSDP2Hooks | None = None


def _build_fsdp2_param_guard(original):
    """torch FSDP2 takes any DTensor parameter for a tensor-parallel one and fails deep inside
    (torch 2.13: ``TypeError: Invariant encountered`` from ``DeviceMesh._concatenate``); a
    RaggedShard parameter (ragged_placement's ``fully_shard`` made it) gets a ``ValueError``
    naming the module and the parameter instead. Upstream: FSDP2 checks a DTensor parameter's
    placements against those it composes with (``Shard``, ``_StridedShard``, ``Replicate``)."""

    @functools.wraps(original)
    def _init_sharded_param(self, param, *args, **kwargs):
        if isinstance(param, DTensor) and _ragged(param.placements):
            raise ValueError(_fsdp2_mix_message(self._module_info, param))
        return original(self, param, *args, **kwargs)

    return _init_sharded_param


def _fsdp2_mix_message(module_info, param) -> str:
    what = f"parameter {module_info.param_name!r} of {type(module_info.module).__name__}"
    owner = _fsdp2_hooks.sharded_by(module_info.module)
    if owner is not None:
        return (
            f"torch.distributed.fsdp.fully_shard reached {what}, which "
            f"ragged_placement.fsdp.fully_shard sharded already (as part of {owner}): the two "
            f"fully_shard functions cannot be mixed in one model; shard every module with one of "
            f"them"
        )
    return (
        f"torch.distributed.fsdp.fully_shard got {what}, a DTensor with {tuple(param.placements)}: "
        f"torch's FSDP2 composes only with Shard/Replicate (tensor-parallel) placements; shard "
        f"RaggedShard modules with ragged_placement.fsdp.fully_shard"
    )


def _forward_method_trampoline(module, method_name):
    # Runs with the globals of torch's ``_fully_shard`` (its code replaces torch's function's).
    return _ragged_placement_register_fsdp_forward_method(  # noqa: F821 - injected there
        module, method_name
    )


def _build_forward_method_dispatch(_absent):
    """torch's ``register_fsdp_forward_method`` is a silent no-op on a module that is not its
    ``FSDPModule``: for ours it runs :func:`ragged_placement.fsdp.register_fsdp_forward_method`,
    for every other module a copy of torch's function."""
    from torch.distributed.fsdp._fully_shard import _fully_shard

    fn = _fully_shard.register_fsdp_forward_method
    original = type(fn)(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)

    def dispatch(module, method_name):
        if isinstance(module, _fsdp2_hooks.module_type):
            return _fsdp2_hooks.register_forward_method(module, method_name)
        return original(module, method_name)

    return dispatch


def _build_forward_method_trampoline(_code):
    # The code of the function object itself: reaches ``torch.distributed.fsdp``'s re-export
    # and names users bound before importing this package.
    return _forward_method_trampoline.__code__


def _build_fsdp2_state_lookup(original):
    """``torch.distributed.fsdp.fully_shard.state(m)`` (where ``torch.distributed.pipelining``
    reaches FSDP2's state of a module that is a ``torch.distributed.fsdp.FSDPModule``): torch's
    state where torch's ``fully_shard`` stored one (also the one it is building over ours, to
    fail at our guard above), else for ours the view of :mod:`ragged_placement.fsdp.fsdp2_state`.
    """

    @functools.wraps(original)
    def state(module):
        found = original(module)
        return _fsdp2_hooks.state_view(module) if found is None else found

    return state


_FSDP_PARAM = "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam"
_FULLY_SHARD = "torch.distributed.fsdp._fully_shard._fully_shard"

#: The rows for torch's FSDP2, applied the first time our ``fully_shard`` runs (only then can torch
#: code meet our modules; importing torch's FSDP2 costs about 0.2 s, which the placement alone
#: does not pay) and restored by :func:`uninstall` with the others.
FSDP2_PATCHES: tuple[Patch, ...] = (
    Patch(_FSDP_PARAM, "_init_sharded_param",
          "torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam._init_sharded_param",
          _build_fsdp2_param_guard, ("self", "param")),
    Patch(_FULLY_SHARD, "_ragged_placement_register_fsdp_forward_method", None,
          _build_forward_method_dispatch),
    Patch(f"{_FULLY_SHARD}:register_fsdp_forward_method", "__code__",
          "_fully_shard.py:register_fsdp_forward_method", _build_forward_method_trampoline,
          ("module", "method_name")),
    Patch(f"{_FULLY_SHARD}:fully_shard", "state",
          "torch.distributed._composable.contract.contract.<locals>.inner.<locals>.get_state",
          _build_fsdp2_state_lookup),
)


def _build_forward_tensors(position: int):
    """torch.distributed.pipelining's ``stage_backward_input`` (``weights`` its 4th argument)
    and ``stage_backward_weight`` (its 1st) map each of ``stage.submod.parameters()`` to its
    autograd accumulator and look those up in the graph the forward recorded: they get, for each
    of our sharded parameters, the unsharded one the forward computed with
    (:mod:`ragged_placement.fsdp.fsdp2_state`). A weight pass over our units through a region of
    selective activation checkpointing, which torch's checkpoint lets backward run through once
    (the input pass did), raises ``NotImplementedError`` naming the combination and the fix
    (FSDP2 fails there with torch's error alone). Upstream: FSDP2's module would tell
    pipelining which tensors its forward used."""

    def build(original):
        @functools.wraps(original)
        def with_forward_tensors(*args, **kwargs):
            args = list(args)
            if len(args) > position:
                weights = args[position] = list(args[position])
            else:
                weights = kwargs["weights"] = list(kwargs["weights"])
            tensors = _fsdp2_hooks.forward_tensors(weights)
            ours = any(t is not w for t, w in zip(tensors, weights))
            weights[:] = tensors
            try:
                return original(*args, **kwargs)
            except RuntimeError as exc:
                if ours and position == 0 and "backward an extra time" in str(exc):
                    raise NotImplementedError(_SPLIT_BACKWARD_AND_SAC) from exc
                raise

        return with_forward_tensors

    return build


_SPLIT_BACKWARD_AND_SAC = (
    "a zero-bubble pipeline schedule (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, "
    "ScheduleDualPipeV: a weight-gradient pass of its own after the input pass) over a stage "
    "with selective activation checkpointing: torch.utils.checkpoint lets backward run once "
    "through a selectively checkpointed region, and the weight pass is the second time (torch "
    "FSDP2 fails here too, with 'Trying to backward an extra time'). Use full activation "
    "checkpointing (torchtitan's FullAC) or none with these schedules, or a schedule without "
    "a separate weight pass (Schedule1F1B, ScheduleInterleaved1F1B, ScheduleGPipe, "
    "ScheduleLoopedBFS) with selective checkpointing"
)


_STAGE = "torch.distributed.pipelining.stage"
_BACKWARD = "torch.distributed.pipelining._backward"

#: The rows for torch.distributed.pipelining, applied by :func:`install_pipelining` (the names
#: its stages call, bound in ``stage.py``).
PIPELINING_PATCHES: tuple[Patch, ...] = (
    Patch(_STAGE, "stage_backward_input", f"{_BACKWARD}.stage_backward_input",
          _build_forward_tensors(3),
          ("stage_outputs_or_loss", "output_grads", "input_values", "weights")),
    Patch(_STAGE, "stage_backward_weight", f"{_BACKWARD}.stage_backward_weight",
          _build_forward_tensors(0), ("weights", "param_groups")),
)


# -- torch.optim's Adam and AdamW --------------------------------------------------------------
def _build_flat_adam(original):
    from ragged_placement.optim._flat_adam import flat_adam

    return flat_adam(original)


_ADAM = "torch.optim.adam"
_ADAM_PARAMS = ("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "state_steps",
                "grad_scale", "found_inf")

#: The rows for torch's optimizers, applied with :data:`FSDP2_PATCHES`: ``torch.optim.Adam`` and
#: ``AdamW`` (``foreach``, ``fused`` or the per-tensor loop torch picks for DTensors by default)
#: step the parameters of our units as runs of their flat shards
#: (:mod:`ragged_placement.optim._flat_adam`); every other call reaches torch's function.
OPTIM_PATCHES: tuple[Patch, ...] = tuple(
    Patch(_ADAM, name, f"{_ADAM}.{name}", _build_flat_adam, _ADAM_PARAMS)
    for name in ("_single_tensor_adam", "_multi_tensor_adam", "_fused_adam")
)

# (patch, owner, original raw value) of every applied row, in install order
_applied: list[tuple[Patch, object, object]] = []
_applied_fsdp2: list[tuple[Patch, object, object]] = []
_applied_pipelining: list[tuple[Patch, object, object]] = []
_installing = False  # inside install(): a RaggedShard made by a row's build must not recurse
_warned_untested = False


def installed() -> bool:
    """Whether RaggedShard support is installed into torch."""
    return bool(_applied)


def _signature(value: object) -> list[str] | None:
    fn = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a C++ function: nothing to read
        return None


def _mismatch(patch: Patch) -> str | None:
    """What torch has at ``patch``'s target if it is not what the row expects, else ``None``."""
    try:
        owner = patch.resolve_owner()
    except (ImportError, AttributeError) as exc:
        return f"its owner {patch.owner} is missing ({type(exc).__name__}: {exc})"
    value = getattr(owner, patch.name, _ABSENT)
    found = _describe(value)
    if found != patch.expected:
        return f"it is {found}, expected torch's {patch.expected}"
    if patch.name == "__code__" and owner.__code__.co_freevars:
        return f"it is a closure over {owner.__code__.co_freevars}; its code cannot be swapped"
    if patch.params is not None:
        params = _signature(owner if patch.name == "__code__" else value)
        if params is not None:
            leading = params if patch.name == "__code__" else params[:len(patch.params)]
            if tuple(leading) != patch.params:
                return f"its parameters are {tuple(params)}, expected {patch.params}"
    return None


def changed_rows(rows: tuple[Patch, ...] | None = None) -> list[tuple[str, str]]:
    """``(row, what changed)`` for every row of ``rows`` (default: :data:`PATCHES`,
    :data:`FSDP2_PATCHES`, :data:`OPTIM_PATCHES`, and :data:`PIPELINING_PATCHES` once
    pipelining is imported) whose target in this torch is not what the row expects. Reads
    torch, patches nothing."""
    if rows is None:  # pipelining's rows where it is imported (importing it takes seconds)
        rows = (*PATCHES, *FSDP2_PATCHES, *OPTIM_PATCHES,
                *(PIPELINING_PATCHES if _STAGE in sys.modules else ()))
    return [(f"{p.owner}.{p.name}", why) for p in rows if (why := _mismatch(p)) is not None]


def warn_if_untested() -> None:
    """On a torch outside :data:`~ragged_placement._compat.SUPPORTED_TORCH`: one warning naming
    the version and each row whose target changed (the package's import calls this)."""
    global _warned_untested
    if _compat.TORCH_VERSION in _compat.SUPPORTED_TORCH or _warned_untested:
        return
    _warned_untested = True
    changed = changed_rows()
    tested = ", ".join(".".join(map(str, v)) for v in _compat.SUPPORTED_TORCH)
    rows = "".join(f"\n  {row}: {why}" for row, why in changed)
    verdict = (f"{len(changed)} of its patch rows no longer match; the first RaggedShard or "
               f"fully_shard will raise naming them, and torch stays unpatched:{rows}"
               if changed else "every patch row still matches")
    warnings.warn(
        f"ragged_placement is tested on torch {tested}; this is torch {torch.__version__}: "
        f"{verdict}",
        stacklevel=3,
    )


def install() -> None:
    """Install RaggedShard support into torch's DTensor (idempotent).

    Runs the first time a :class:`~ragged_placement.RaggedShard` is made. On torch 2.11 it first
    makes FakeTensorMode's CUDA guard outlive the threads that use DTensor
    (:func:`ragged_placement._compat.keep_fake_cuda_guard_alive`). Every row of
    :data:`PATCHES` is checked before any is applied; ``RuntimeError`` naming each row whose
    target is not torch's original (another library patched it, or torch changed), with torch
    left untouched.
    """
    global _installing
    if _applied:
        return
    with _LOCK:
        if _applied or _installing:
            return
        _installing = True
        try:
            _compat.keep_fake_cuda_guard_alive()
            _apply(PATCHES, _applied)
        finally:
            _installing = False
        _placement._installed = True


def install_fsdp2(hooks: FSDP2Hooks) -> None:
    """Apply :data:`FSDP2_PATCHES` and :data:`OPTIM_PATCHES` after :data:`PATCHES`, calling into the runtime through
    ``hooks`` (idempotent; our ``fully_shard`` calls it). ``RuntimeError`` naming the rows if
    torch's FSDP2 is not what they expect."""
    global _fsdp2_hooks
    if _applied_fsdp2:
        return
    install()
    with _LOCK:
        if not _applied_fsdp2:
            _fsdp2_hooks = hooks
            _apply((*FSDP2_PATCHES, *OPTIM_PATCHES), _applied_fsdp2)


def install_pipelining() -> None:
    """Apply :data:`PIPELINING_PATCHES` once ``torch.distributed.pipelining`` is imported and
    :data:`FSDP2_PATCHES` are (idempotent; every root forward of our units calls it: a
    pipeline stage's forward runs after the import, before any split backward). A no-op
    while pipelining is not imported. ``RuntimeError`` naming the rows if its targets are not
    what they expect."""
    if _applied_pipelining or not _applied_fsdp2 or _STAGE not in sys.modules:
        return
    with _LOCK:
        if not _applied_pipelining and _applied_fsdp2:
            _apply(PIPELINING_PATCHES, _applied_pipelining)


def _apply(patches: tuple[Patch, ...], applied: list[tuple[Patch, object, object]]) -> None:
    """Check every row of ``patches``, then apply them all (none on an error)."""
    changed = changed_rows(patches)
    if changed:
        rows = "".join(f"\n  {row}: {why}" for row, why in changed)
        raise RuntimeError(
            f"ragged_placement cannot install into torch {torch.__version__}; not patching "
            f"anything. Rows whose target changed:{rows}"
        )
    owners = [patch.resolve_owner() for patch in patches]
    try:
        for patch, owner in zip(patches, owners):
            original = _raw_get(owner, patch.name)
            replacement = patch.build(getattr(owner, patch.name, _ABSENT))
            _raw_set(owner, patch.name, replacement)
            applied.append((patch, owner, original))
    except BaseException:
        _restore(applied)
        raise


def _restore(applied: list[tuple[Patch, object, object]] | None = None) -> None:
    for rows in ([applied] if applied is not None
                 else [_applied_pipelining, _applied_fsdp2, _applied]):
        while rows:
            patch, owner, original = rows.pop()
            _raw_set(owner, patch.name, original)


def uninstall() -> None:
    """Restore every patched torch attribute to torch's original object (no-op if not installed).

    RaggedShard DTensors created before must not be used afterwards: torch does not know them
    (the next RaggedShard made installs again). DTensor's sharding caches are cleared, so no
    RaggedShard rule outlives the install.
    """
    with _LOCK:
        if _applied:
            _restore()
            _placement._installed = False
            _compat.clear_sharding_caches()


_placement._install_hook = install
