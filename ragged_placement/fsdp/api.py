"""``fully_shard``: torch FSDP2's call shape on a zero-copy, RaggedShard-placed runtime."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from ragged_placement.fsdp.fp8 import check_quant, convert_unit_linears
from ragged_placement.fsdp.hooks import FSDPState
from ragged_placement.fsdp.mesh import DataParallelMesh, ParamLayout
from ragged_placement.fsdp.unit import FSDPUnit, ParamSlot, build_unit
from ragged_placement.quant import BlockFP8Config

__all__ = ["FSDPModule", "MixedPrecisionPolicy", "fully_shard"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of the unsharded parameters and of the gradient reduction (as torch FSDP2's).

    Args:
        param_dtype: dtype of the all-gather and of the unsharded parameters used in forward and
            backward; ``None`` keeps the parameters' dtype. Sharded parameters (what the
            optimizer sees) always keep their original dtype.
        reduce_dtype: dtype of the gradient reduce-scatter; ``None`` uses ``param_dtype``.
        output_dtype: if set, floating outputs of the module are cast to it.
        cast_forward_inputs: cast floating inputs of the module's forward to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


class FSDPModule:
    """Mixin added to the class of every module passed to :func:`fully_shard`."""

    _fsdp_state: FSDPState

    @property
    def fsdp_unit(self) -> FSDPUnit:
        """This module's unit: its plan (``.plan``), buffers and communication counters (``.stats``)."""
        return self._fsdp_state.unit

    def fsdp_units(self) -> Iterator[tuple[str, FSDPUnit]]:
        """``(module name, unit)`` for this module and every ``fully_shard`` module below it."""
        for name, m in self.named_modules():
            if isinstance(m, FSDPModule):
                yield name, m._fsdp_state.unit

    def unshard(self, async_op: bool = False) -> None:
        """All-gather this unit's parameters and register the unsharded ones; with
        ``async_op=True`` only issue the all-gather (the next forward waits for it)."""
        unit = self._fsdp_state.unit
        unit.unshard(async_op=async_op)
        if not async_op:
            unit.register(sharded=False)

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
        for m in self.modules() if recurse else [self]:
            if isinstance(m, FSDPModule):
                m._fsdp_state.requires_gradient_sync = requires_gradient_sync

    def reduce_gradients(self, *, scale: float = 1.0) -> None:
        """Reduce-scatter the gradients accumulated under ``set_requires_gradient_sync(False)``:
        one collective per unit holding some, innermost units last, each finished before the
        next; the averaged gradients are multiplied by ``scale``.

        Use it where no backward with sync on follows, e.g. after a pipeline schedule whose
        micro-batches ran with sync off: ``torch.distributed.pipelining`` only drives torch's own
        FSDP, and its schedules divide the gradients they can see by the number of micro-batches
        before these exist, so pass ``scale=1 / n_microbatches`` for a mean-reduced loss.
        Collective: every rank of the units' meshes must call it after running backward through
        the same units."""
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise ValueError(f"scale must be a number, got {scale!r}")
        for m in reversed(list(self.modules())):
            if isinstance(m, FSDPModule):
                unit = m._fsdp_state.unit
                if unit.has_unsharded_grads:
                    unit.reduce_grads()
                    unit.finish_reduce(scale=float(scale))

    def set_reshard_after_forward(
        self, reshard_after_forward: bool, *, recurse: bool = True
    ) -> None:
        """Whether units free their unsharded parameters after forward (root units never do)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward must be a bool, got {reshard_after_forward!r}")
        for m in self.modules() if recurse else [self]:
            if isinstance(m, FSDPModule):
                m._fsdp_state.reshard_after_forward = reshard_after_forward

    def load_state_dict(
        self, state_dict: Mapping[str, object], strict: bool = True, assign: bool = False
    ):
        """Load into the sharded parameters in place. Values may be DTensors with this module's
        placements, DTensors with other placements (redistributed), or full tensors (this rank's
        RaggedShard run is taken from them). Other entries go through ``nn.Module``'s loader."""
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


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    handle = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, handle.current_device())


def _collect_params(
    module: nn.Module,
) -> tuple[list[ParamSlot], list[nn.Parameter], list[nn.Module]]:
    """Parameters of ``module`` not owned by a ``fully_shard`` module below it, deduplicated."""
    slots: dict[int, ParamSlot] = {}
    params: dict[int, nn.Parameter] = {}
    owned_modules: list[nn.Module] = []
    stack = [("", module)]
    while stack:
        prefix, m = stack.pop()
        owned_modules.append(m)
        for attr, p in m._parameters.items():
            if p is None:
                continue
            if id(p) in slots:
                slots[id(p)].owners.append((m, attr))
            else:
                # A tensor-parallel DTensor is planned on its TP-local shape.
                shape = p._local_tensor.shape if isinstance(p, DTensor) else p.shape
                slots[id(p)] = ParamSlot(f"{prefix}{attr}", [(m, attr)], shape, p.requires_grad)
                params[id(p)] = p
        for name, child in reversed(list(m._modules.items())):
            if child is not None and not isinstance(child, FSDPModule):
                stack.append((f"{prefix}{name}.", child))
    order = list(slots)
    return [slots[i] for i in order], [params[i] for i in order], owned_modules


def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    granularity=None,
    quant: BlockFP8Config | None = None,
) -> nn.Module:
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

    Args:
        module: the module to shard; its class is swapped to a subclass that also derives from
            :class:`FSDPModule` (as torch FSDP2 does). Returned for convenience.
        mesh: a 1-D device mesh; ``None`` builds one over the default process group (``cuda``
            for NCCL, else ``cpu``). A 2-D ``(replicate, shard)`` mesh gives HSDP: the unit is
            sharded over dim 1 and its gradients are also all-reduced over dim 0. Parameters
            that are DTensors on a tensor-parallel mesh (``parallelize_module`` on a sibling
            sub-mesh of the same root) are planned on their TP-local shape and become DTensors
            on the ``(mesh..., tp)`` mesh (see :mod:`ragged_placement.fsdp.mesh`).
        reshard_after_forward: free the unsharded parameters after forward and all-gather them
            again in backward. The outermost (root) unit keeps them, as FSDP2 does.
        mp_policy: parameter / reduction dtypes, see :class:`MixedPrecisionPolicy`.
        granularity: the planner's policy: ``None``, a callable ``(name, shape) -> Granularity``
            or a ``{fnmatch pattern: Granularity}`` dict over parameter names in ``module``.
        quant: block-wise FP8 training (:class:`~ragged_placement.quant.BlockFP8Config`): the
            unit's ``nn.Linear`` modules become :class:`~ragged_placement.quant.FP8Linear`, their
            weights (unless tied to a non-Linear) are planned at ``block`` granularity, each
            rank quantizes its own blocks, and the unit's one all-gather moves FP8 bytes and
            block scales; master weights stay in the sharded buffer. See
            :mod:`ragged_placement.fsdp.fp8`.
    """
    if not isinstance(module, nn.Module):
        raise ValueError(f"module must be an nn.Module, got {type(module).__name__}")
    if isinstance(module, FSDPModule):
        raise ValueError(f"fully_shard was already applied to this {type(module).__name__}")
    if not isinstance(reshard_after_forward, bool):
        raise ValueError(f"reshard_after_forward must be a bool, got {reshard_after_forward!r}")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise ValueError(f"mp_policy must be a MixedPrecisionPolicy, got {mp_policy!r}")
    mesh = mesh if mesh is not None else _default_mesh()
    DataParallelMesh.of(mesh)
    device = _mesh_device(mesh)
    slots, params, owned_modules = _collect_params(module)
    if check_quant(quant) is not None:
        convert_unit_linears(module, slots, params, quant)
        slots, params, owned_modules = _collect_params(module)  # owners are the FP8Linears now
    # Tensors on the meta device stay there until ``to_empty`` (FSDP2's meta-device init).
    for m in owned_modules:
        for k, b in m._buffers.items():
            if b is not None and b.device != device and not b.is_meta:
                m._buffers[k] = b.to(device)
    if params and any(p.device != device and not p.is_meta for p in params):
        params = [p if p.is_meta else p.to(device) for p in params]
    wraps_units = any(isinstance(m, FSDPModule) for m in module.modules() if m is not module)
    unit = build_unit(
        slots, params, mesh, mp_policy.param_dtype, mp_policy.reduce_dtype, granularity, quant,
        split_by_submodule=wraps_units,
    )
    module._fsdp_state = FSDPState(module, unit, reshard_after_forward, mp_policy)
    module.__class__ = _fsdp_class(type(module))
    return module
