"""The all-gather output of a flat buffer without FP8 weights and the unsharded parameters
as aliases of its storage: the plain gather beside the FP8 one
(:class:`~ragged_placement.fsdp.fp8.FP8UnitGather`), with the same interface.

How a unit's buffers gather is chosen once per unit, by ``fully_shard`` from its ``quant``
(:func:`~ragged_placement.fsdp.fp8.unit_gathers`): :class:`PlainGathers` here, or
:class:`~ragged_placement.fsdp.fp8.FP8Gathers`, which gathers the buffers holding FP8 weights
its way and the others plainly. Each flat buffer asks it with its own parameters:

* at the unit: :meth:`~PlainGathers.check_unit`;
* before the plan: :meth:`~PlainGathers.check_params` (what the gather cannot take) and
  :meth:`~PlainGathers.granularity` (the gather's constraint on the planner policy, last);
* before a cast of the buffer: :meth:`~PlainGathers.check_cast`;
* :meth:`~PlainGathers.sends_chunk`: whether the all-gather sends the sharded chunk itself,
  cast at most (what the communication needs to know: over one rank the unsharded buffer may
  then share the chunk's storage, or take its cast directly);
* :meth:`~PlainGathers.build` builds the gather on a device; then ``gathered``, ``params``,
  ``weights``, ``send_segments``, :meth:`~PlainGather.allocate`, :meth:`~PlainGather.free`,
  :meth:`~PlainGather.stage_dtype`, :meth:`~PlainGather.pack`,
  :meth:`~PlainGather.assemble`, :meth:`~PlainGather.register_weights`."""

from __future__ import annotations

from collections.abc import Sequence
import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from ragged_placement.fsdp.param import ParamSlot, alias
from ragged_placement.planner.layout import FlatLayout
from ragged_placement.planner.plan import Segment

__all__ = ["PlainGather", "PlainGathers"]


class PlainGathers:
    """How the flat buffers of a unit without ``quant`` gather: plainly, each its
    :class:`PlainGather` (see the module docstring; the interface of
    :class:`~ragged_placement.fsdp.fp8.FP8Gathers`). ``slots``: a buffer's parameters."""

    def check_unit(self, slots: Sequence[ParamSlot], params: Sequence[torch.Tensor]) -> None:
        """``ValueError`` if the gather cannot take the unit's parameters; any go plainly."""
        del slots, params

    def check_params(self, slots: Sequence[ParamSlot],
                     tp_specs: Sequence[DTensorSpec | None]) -> None:
        """``ValueError`` if the gather cannot take a buffer's parameters (``tp_specs``: their
        tensor-parallel specs); the plain gather takes any."""
        del slots, tp_specs

    def granularity(self, slots: Sequence[ParamSlot], policy):
        """The planner policy ``policy`` (the user's, then tensor parallel) with the gather's
        own constraint; the plain gather has none."""
        del slots
        return policy

    def check_cast(self, slots: Sequence[ParamSlot], dtype: torch.dtype,
                   param_dtype: torch.dtype | None) -> None:
        """``ValueError`` if a buffer cannot be cast to ``dtype`` (``param_dtype``: the
        mixed-precision policy's, ``None`` for the buffer's own); any dtype gathers plainly."""
        del slots, dtype, param_dtype

    def sends_chunk(self, slots: Sequence[ParamSlot]) -> bool:
        """Whether the all-gather sends a buffer's sharded chunk itself, cast to
        ``param_dtype`` at most (:meth:`PlainGather.pack`): always."""
        del slots
        return True

    def build(self, plan: FlatLayout, slots: Sequence[ParamSlot], param_dtype: torch.dtype,
              device: torch.device, shared: torch.Tensor | None) -> PlainGather:
        """A buffer's gather on ``device`` in ``param_dtype`` (over ``shared``'s storage where
        not ``None``, see :class:`PlainGather`)."""
        return PlainGather(plan, slots, param_dtype, device, shared)


class PlainGather:
    """``gathered``: the buffer's unsharded parameters in plan order (``plan.buffer_numel``
    elements in ``dtype``), its storage allocated only between :meth:`allocate` and
    :meth:`free`; ``params``: each parameter's alias of it (a tensor with its own version
    counter, see :func:`~ragged_placement.fsdp.param.alias`).

    Args:
        plan: the buffer's layout.
        slots: the buffer's parameters.
        dtype: ``param_dtype``, the dtype of the all-gather.
        device: where the buffer lives (the compute device).
        shared: a tensor (in ``dtype`` on ``device``, laid out as the unsharded buffer) whose
            storage ``gathered`` and the aliases share, persistently: :meth:`allocate` and
            :meth:`free` do nothing (the sharded chunk of a buffer over one rank,
            :meth:`~ragged_placement.fsdp.mesh.BufferComm.shared_unsharded`). ``None``: a
            storage of its own.
    """

    gathered: torch.Tensor
    params: list[torch.Tensor]
    weights: list[None]  # no FP8 weights
    send_segments: list[Segment]  # the all-gather's segments: the plan's
    _storage: torch.UntypedStorage
    _nbytes: int
    _shared: bool

    def __init__(
        self,
        plan: FlatLayout,
        slots: Sequence[ParamSlot],
        dtype: torch.dtype,
        device: torch.device,
        shared: torch.Tensor | None = None,
    ) -> None:
        self._shared = shared is not None
        if shared is None:
            self.gathered = torch.empty(plan.buffer_numel, dtype=dtype, device=device)
        else:
            self.gathered = shared[:plan.buffer_numel]
        self._storage = self.gathered.untyped_storage()
        self._nbytes = self._storage.nbytes()
        base = self.gathered.storage_offset()
        self.params = [
            alias(self._storage, dtype, device, base + plan.offsets[slot.fqn], slot.shape)
            for slot in slots
        ]
        self.weights = [None] * len(slots)
        self.send_segments = list(plan.segments)
        self.free()  # set_ grew the storage to hold the aliases

    def allocate(self) -> None:
        """Give ``gathered`` its storage (before the all-gather)."""
        if not self._shared:
            self._storage.resize_(self._nbytes)

    def free(self) -> None:
        """Release the storage (the aliases stay, pointing at empty storage)."""
        if not self._shared:
            self._storage.resize_(0)

    def stage_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype :meth:`pack` reads the sharded chunk (in ``dtype``) in: a CPU-offload
        staging copy casts it to ``param_dtype`` on the way."""
        del dtype
        return self.gathered.dtype

    def pack(self, rank: int, sharded: torch.Tensor) -> torch.Tensor:
        """This rank's send buffer: the sharded chunk itself, or its mixed-precision cast (the
        only copy)."""
        del rank  # every rank sends its chunk as it is laid out
        dtype = self.gathered.dtype
        return sharded if sharded.dtype == dtype else sharded.to(dtype)

    def register_weights(self, slots: Sequence[ParamSlot], *, sharded: bool) -> None:
        """Nothing to register beside the parameters (no FP8 weights)."""
        del slots, sharded

    def assemble(self) -> None:
        """Nothing to assemble: every parameter is a view of ``gathered``."""
