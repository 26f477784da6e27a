"""The all-gather output of a flat buffer without FP8 weights and the unsharded parameters
as aliases of its storage: the plain gather beside the FP8 one
(:class:`~ragged_placement.fsdp.fp8.FP8UnitGather`), with the same interface, chosen once per
flat buffer (:class:`~ragged_placement.fsdp.buffer.FlatBuffer`, by whether it holds FP8
weights):

* before the plan: :meth:`~PlainGather.check_params` (what the gather cannot take) and
  :meth:`~PlainGather.granularity` (the gather's constraint on the planner policy, last);
* before a cast of the buffer: :meth:`~PlainGather.check_cast`;
* :meth:`~PlainGather.for_buffer` builds it on a device; then ``gathered``, ``params``,
  ``weights``, ``send_segments``, :meth:`~PlainGather.allocate`, :meth:`~PlainGather.free`,
  :meth:`~PlainGather.stage_dtype`, :meth:`~PlainGather.pack`,
  :meth:`~PlainGather.assemble`, :meth:`~PlainGather.register_weights`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from ragged_placement.fsdp.param import ParamSlot, alias
from ragged_placement.planner.layout import FlatLayout
from ragged_placement.planner.plan import Segment

if TYPE_CHECKING:
    from ragged_placement.fsdp.buffer import FlatBuffer

__all__ = ["PlainGather"]


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

    # -- the gather's constraints, read before it exists ---------------------------------------
    @staticmethod
    def check_params(buffer: FlatBuffer, tp_specs: Sequence[DTensorSpec | None]) -> None:
        """``ValueError`` if the gather cannot take ``buffer``'s parameters (``tp_specs``:
        their tensor-parallel specs); the plain gather takes any."""
        del buffer, tp_specs

    @staticmethod
    def granularity(buffer: FlatBuffer, policy):
        """The planner policy ``policy`` (the user's, then tensor parallel) with the gather's
        own constraint; the plain gather has none."""
        del buffer
        return policy

    @staticmethod
    def check_cast(buffer: FlatBuffer, dtype: torch.dtype) -> None:
        """``ValueError`` if ``buffer`` cannot be cast to ``dtype``; any dtype gathers plainly."""
        del buffer, dtype

    @classmethod
    def for_buffer(cls, buffer: FlatBuffer, device: torch.device) -> PlainGather:
        """The gather of ``buffer`` on ``device`` in its ``param_dtype`` (over the storage its
        communication shares, :meth:`~ragged_placement.fsdp.mesh.BufferComm.shared_unsharded`)."""
        return cls(buffer.plan, buffer.slots, buffer.param_dtype, device,
                   buffer.comm.shared_unsharded())

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
