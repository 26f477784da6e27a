"""Teach torch's DTensor about RaggedShard: every hook into torch, in one place.

torch (2.11, 2.13) has no public extension point for a new placement: ``distribute_tensor``,
``redistribute_local_tensor``, the sharding propagator and the checkpoint helpers only know
``Shard``, ``_StridedShard``, ``Replicate`` and ``Partial``. Each hook below is a thin wrapper that
handles specs containing a RaggedShard and passes every other call to torch's own function
unchanged, so DTensors without a RaggedShard behave exactly as before.

Upstream, these hooks become methods on ``Placement`` (``_distribute``, ``_region``,
``_transform_to``), consulted by the same call sites (pytorch/pytorch#169320).

=============================================  ===============================================
torch call site                                what it gets
=============================================  ===============================================
``distribute_tensor`` (the function object)    :func:`ragged_placement.distribute.distribute_tensor`
``redistribute_local_tensor`` (3 modules)      :func:`ragged_placement.redistribute.redistribute_local_tensor`
``ShardingPropagator.propagate_op_sharding``   :func:`ragged_placement.ops.propagate`
``compute_global_tensor_info`` (from_local)    :func:`ragged_placement.distribute.global_shape_and_stride`
``DTensor.from_local``                         argument checks for RaggedShard
``DTensor.__create_chunk_list__`` & co (DCP)   one chunk per box of the local run
=============================================  ===============================================
"""

from __future__ import annotations

import functools
import importlib
import inspect
import warnings

import torch
from torch.distributed.tensor import DTensor

from ragged_placement import _compat
from ragged_placement.placement import RaggedShard

__all__ = ["install", "installed"]

_INSTALLED = False
_REDISTRIBUTE_MODULES = (
    "torch.distributed.tensor._redistribute",
    "torch.distributed.tensor._api",
    "torch.distributed.tensor._dispatch",
)


def installed() -> bool:
    return _INSTALLED


def _ragged(placements) -> bool:
    return placements is not None and any(isinstance(p, RaggedShard) for p in placements)


# -- distribute_tensor ---------------------------------------------------------------------------
def _distribute_tensor_trampoline(tensor, device_mesh=None, placements=None, *, src_data_rank=0):
    # Runs with torch's ``_api`` globals (its code object replaces distribute_tensor's).
    return _ragged_placement_distribute_tensor(  # noqa: F821 - injected into torch's _api module
        tensor, device_mesh, placements, src_data_rank=src_data_rank
    )


def _install_distribute_tensor() -> None:
    from torch.distributed.tensor import _api

    fn = _api.distribute_tensor
    expected = ["tensor", "device_mesh", "placements", "src_data_rank"]
    if list(inspect.signature(fn).parameters) != expected or fn.__code__.co_freevars:
        raise ImportError(f"ragged_placement: unexpected distribute_tensor signature in torch {torch.__version__}")
    # A copy of torch's function keeps its behaviour for every other placement.
    original = type(fn)(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    original.__kwdefaults__ = fn.__kwdefaults__

    def dispatch(tensor, device_mesh=None, placements=None, *, src_data_rank=0):
        if _ragged(placements):
            from torch.distributed.tensor.device_mesh import _mesh_resources

            from ragged_placement.distribute import distribute_tensor

            mesh = device_mesh or _mesh_resources.get_current_mesh()
            return distribute_tensor(tensor, mesh, placements, src_data_rank=src_data_rank)
        return original(tensor, device_mesh, placements, src_data_rank=src_data_rank)

    _api._ragged_placement_distribute_tensor = dispatch
    # Replace the code of the function object itself, so that references users bound before
    # importing this package (``from torch.distributed.tensor import distribute_tensor``) work.
    fn.__code__ = _distribute_tensor_trampoline.__code__


# -- redistribute ---------------------------------------------------------------------------------
def _install_redistribute() -> None:
    from torch.distributed.tensor import _redistribute

    from ragged_placement.redistribute import redistribute_local_tensor as ragged_redistribute

    original = _redistribute.redistribute_local_tensor

    @functools.wraps(original)
    def redistribute_local_tensor(local_tensor, current_spec, target_spec, *args, **kwargs):
        if _ragged(current_spec.placements) or _ragged(target_spec.placements):
            return ragged_redistribute(local_tensor, current_spec, target_spec, **kwargs)
        return original(local_tensor, current_spec, target_spec, *args, **kwargs)

    for name in _REDISTRIBUTE_MODULES:
        module = importlib.import_module(name)
        if getattr(module, "redistribute_local_tensor", None) is not original:
            raise ImportError(f"ragged_placement: {name}.redistribute_local_tensor is not torch's in {torch.__version__}")
        module.redistribute_local_tensor = redistribute_local_tensor


# -- sharding propagation -------------------------------------------------------------------------
def _install_sharding_rules() -> None:
    from ragged_placement.ops import propagate, spec_has_ragged

    propagator = DTensor._op_dispatcher.sharding_propagator
    cached, uncached = propagator.propagate_op_sharding, propagator.propagate_op_sharding_non_cached

    def propagate_op_sharding_non_cached(op_schema):
        if spec_has_ragged(op_schema):
            return propagate(propagator, op_schema)
        return uncached(op_schema)

    def propagate_op_sharding(op_schema):
        if spec_has_ragged(op_schema):
            return propagate(propagator, op_schema)
        return cached(op_schema)

    propagator.propagate_op_sharding_non_cached = propagate_op_sharding_non_cached
    propagator.propagate_op_sharding = propagate_op_sharding


# -- from_local -----------------------------------------------------------------------------------
def _install_from_local() -> None:
    from torch.distributed.tensor import _api

    from ragged_placement.distribute import global_shape_and_stride

    original_info = _api.compute_global_tensor_info

    def compute_global_tensor_info(tensor, mesh, placements):
        if _ragged(placements):
            return global_shape_and_stride(tensor, mesh, placements, strict=False)
        return original_info(tensor, mesh, placements)

    _api.compute_global_tensor_info = compute_global_tensor_info

    original_from_local = DTensor.from_local

    @functools.wraps(original_from_local)
    def from_local(local_tensor, device_mesh=None, placements=None, *, run_check=False, shape=None,
                   stride=None, grad_placements=None):
        if _ragged(placements):
            from torch.distributed.tensor.device_mesh import _mesh_resources

            from ragged_placement.redistribute import validate_placements

            mesh = device_mesh or _mesh_resources.get_current_mesh()
            ndim = len(shape) if shape is not None else local_tensor.ndim
            validate_placements(mesh, list(placements), ndim)
            if shape is None and stride is None:
                global_shape_and_stride(local_tensor, mesh, placements)  # raises if not inferable
        return original_from_local(local_tensor, device_mesh, placements, run_check=run_check,
                                   shape=shape, stride=stride, grad_placements=grad_placements)

    DTensor.from_local = staticmethod(from_local)


# -- distributed checkpoint -----------------------------------------------------------------------
def _install_checkpoint() -> None:
    from ragged_placement import checkpoint

    for name in ("__create_write_items__", "__create_chunk_list__", "__get_tensor_shard__"):
        original = getattr(DTensor, name)
        ragged_impl = getattr(checkpoint, name.strip("_"))

        def method(self, *args, _original=original, _ragged_impl=ragged_impl):
            if _ragged(self.placements):
                return _ragged_impl(self, *args)
            return _original(self, *args)

        functools.update_wrapper(method, original)
        setattr(DTensor, name, method)


def install() -> None:
    """Install RaggedShard support into torch's DTensor (idempotent; runs on package import)."""
    global _INSTALLED
    if _INSTALLED:
        return
    if _compat.TORCH_VERSION not in _compat.SUPPORTED_TORCH:
        warnings.warn(
            f"ragged_placement is tested on torch {_compat.SUPPORTED_TORCH}, found {torch.__version__}",
            stacklevel=2,
        )
    _install_distribute_tensor()
    _install_redistribute()
    _install_sharding_rules()
    _install_from_local()
    _install_checkpoint()
    _INSTALLED = True
