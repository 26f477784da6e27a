"""The all-gather output of a flat buffer without FP8 weights and the unsharded parameters
as aliases of its storage: the plain gather beside the FP8 one
(:class:`~ragged_placement.fsdp.fp8.FP8UnitGather`), with the same interface (``gathered``,
``params``, ``weights``, :meth:`~PlainGather.allocate`, :meth:`~PlainGather.free`,
:meth:`~PlainGather.pack`, :meth:`~PlainGather.assemble`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ragged_placement.fsdp.param import ParamSlot, alias
from ragged_placement.planner.layout import FlatLayout

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
        self.free()  # set_ grew the storage to hold the aliases

    def allocate(self) -> None:
        """Give ``gathered`` its storage (before the all-gather)."""
        if not self._shared:
            self._storage.resize_(self._nbytes)

    def free(self) -> None:
        """Release the storage (the aliases stay, pointing at empty storage)."""
        if not self._shared:
            self._storage.resize_(0)

    def pack(self, rank: int, sharded: torch.Tensor) -> torch.Tensor:
        """This rank's send buffer: the sharded chunk itself, or its mixed-precision cast (the
        only copy)."""
        del rank  # every rank sends its chunk as it is laid out
        dtype = self.gathered.dtype
        return sharded if sharded.dtype == dtype else sharded.to(dtype)

    def assemble(self) -> None:
        """Nothing to assemble: every parameter is a view of ``gathered``."""
