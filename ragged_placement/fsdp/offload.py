"""CPU offload's staging of one flat buffer (``CPUOffloadPolicy``, as FSDP2).

Under CPU offload a buffer's ``sharded`` chunk and ``sharded_grad`` live on the host
(:attr:`OffloadStaging.host`, pinned if asked) and the rest on the mesh's device: the chunk is
copied host-to-device into the all-gather's send buffer (with the mixed-precision cast, one
``copy_``) before each all-gather, and the averaged reduction device-to-host into the sharded
gradient. The copies are made even where both devices are the CPU, so that CPU runs take the
CUDA code path. From pinned memory to an accelerator they are asynchronous; the events here
let the host wait for them before it writes the chunk or reads the gradient.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import CPUOffloadPolicy

from ragged_placement.fsdp.common import CommStats

__all__ = ["OffloadStaging"]


def _recorded_event(device: torch.device) -> torch.Event:
    """An event recorded on ``device``'s current stream."""
    event = torch.Event(device=device)
    event.record()
    return event


class OffloadStaging:
    """The host-to-device and device-to-host copies of one offloaded flat buffer, with their
    events, counted in ``stats`` (``h2d_*`` / ``d2h_*``).

    Args:
        policy: the unit's :class:`~torch.distributed.fsdp.CPUOffloadPolicy`.
        stats: the unit's counters.
    """

    host: torch.device
    pin_memory: bool
    _stats: CommStats
    _h2d_event: torch.Event | None
    _d2h_event: torch.Event | None

    def __init__(self, policy: CPUOffloadPolicy, stats: CommStats) -> None:
        self.host = torch.device("cpu")
        self.pin_memory = policy.pin_memory
        self._stats = stats
        self._h2d_event = None
        self._d2h_event = None

    def _asynchronous(self, device: torch.device) -> bool:
        """Whether copies to and from ``device`` are asynchronous: pinned host memory and an
        accelerator."""
        return self.pin_memory and device.type != "cpu"

    def new_host(self, numel: int, dtype: torch.dtype, *, zero: bool) -> torch.Tensor:
        """A new ``[numel]`` host buffer (pinned with ``pin_memory``)."""
        new = torch.zeros if zero else torch.empty
        return new(numel, dtype=dtype, device=self.host, pin_memory=self.pin_memory)

    def to_device(
        self, sharded: torch.Tensor, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The host chunk ``sharded`` copied into a new buffer on ``device`` in ``dtype`` (the
        mixed-precision cast, if any, in the same ``copy_``). The copy is always made, also
        where both devices are the CPU.

        From pinned memory to an accelerator it is asynchronous (``non_blocking``): it is
        ordered before the all-gather on the current stream, and :meth:`wait_to_device` blocks
        the host on its event before the host chunk can be written (optimizer step, load,
        init)."""
        send = torch.empty(sharded.numel(), dtype=dtype, device=device)
        non_blocking = self._asynchronous(device)
        send.copy_(sharded, non_blocking=non_blocking)
        if non_blocking:
            self._h2d_event = _recorded_event(device)
        self._stats.h2d_copies += 1
        self._stats.h2d_bytes += sharded.numel() * sharded.element_size()
        return send

    def to_host(self, reduced: torch.Tensor, *, landing: bool) -> torch.Tensor:
        """The reduced gradient chunk (averaged, in the parameters' dtype) copied into a new
        host buffer.

        Asynchronous from an accelerator into pinned memory only where it lands as a new
        gradient (``landing``), as FSDP2: a gradient added to an existing one is read by the
        host right away. :meth:`wait` (called at the end of backward and of
        ``reduce_gradients``) blocks the host on its event before the optimizer can read it."""
        host = self.new_host(reduced.numel(), reduced.dtype, zero=False)
        non_blocking = self._asynchronous(reduced.device) and landing
        host.copy_(reduced, non_blocking=non_blocking)
        if non_blocking:
            self._d2h_event = _recorded_event(reduced.device)
        self._stats.d2h_copies += 1
        self._stats.d2h_bytes += host.numel() * host.element_size()
        return host

    def wait_to_device(self) -> None:
        """Block the host until the last asynchronous host-to-device copy is done."""
        if self._h2d_event is not None:
            self._h2d_event.synchronize()
            self._h2d_event = None

    def wait(self) -> None:
        """Block the host until both copies are complete (CUDA with pinned memory; nothing to
        wait for otherwise): afterwards the host may write the sharded chunk and read the
        sharded gradient."""
        self.wait_to_device()
        if self._d2h_event is not None:
            self._d2h_event.synchronize()
            self._d2h_event = None
