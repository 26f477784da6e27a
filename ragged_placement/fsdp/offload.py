"""Where a flat buffer's sharded chunk and gradient live, and their staging copies: chosen once
per buffer, :class:`DeviceStaging` (no offload: on the compute device, nothing copied) or
:class:`OffloadStaging` (``CPUOffloadPolicy``, as FSDP2), with one interface
(``host``, :meth:`~DeviceStaging.compute_device`, :meth:`~DeviceStaging.sharded_device`,
:meth:`~DeviceStaging.new_sharded`, :meth:`~DeviceStaging.check_move`,
:meth:`~DeviceStaging.to_device`, :meth:`~DeviceStaging.to_host`,
:meth:`~DeviceStaging.wait_to_device`, :meth:`~DeviceStaging.wait`).

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

__all__ = ["DeviceStaging", "OffloadStaging", "staging"]


def staging(policy: CPUOffloadPolicy | None, stats: CommStats) -> DeviceStaging | OffloadStaging:
    """The staging of a buffer under ``policy`` (``None``: no offload)."""
    return DeviceStaging() if policy is None else OffloadStaging(policy, stats)


class DeviceStaging:
    """A buffer without CPU offload: its sharded chunk and gradient live on the compute device,
    nothing is staged."""

    host = None  # no host copy

    def compute_device(self, device: torch.device, mesh_device: torch.device) -> torch.device:
        """Where the buffer computes when its parameters go to ``device``: there."""
        del mesh_device
        return device

    def sharded_device(self, device: torch.device) -> torch.device:
        """Where the sharded chunk lives when the buffer computes on ``device``: there."""
        return device

    def new_sharded(
        self, numel: int, dtype: torch.dtype, device: torch.device, *, zero: bool
    ) -> torch.Tensor:
        """A new ``[numel]`` buffer for the sharded chunk or gradient on ``device``."""
        new = torch.zeros if zero else torch.empty
        return new(numel, dtype=dtype, device=device)

    def check_move(self, device: torch.device, fqn: str, mesh_type: str) -> None:
        """``ValueError`` unless a parameter (``fqn``) may move to ``device``: the mesh's device
        type (or meta)."""
        if device.type not in (mesh_type, "meta"):
            raise ValueError(
                f"cannot move parameter {fqn} of a fully_shard unit to {device}: its mesh is on "
                f"{mesh_type} (move the model before fully_shard, or build the mesh "
                f"on {device.type})"
            )

    def to_device(
        self, sharded: torch.Tensor, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """``sharded`` itself: it is on the compute device (the gather casts it)."""
        del dtype, device
        return sharded

    def to_host(self, reduced: torch.Tensor, *, landing: bool) -> torch.Tensor:
        """``reduced`` itself: the sharded gradient lives on the compute device."""
        del landing
        return reduced

    def wait_to_device(self) -> None:
        """Nothing in flight."""

    def wait(self) -> None:
        """Nothing in flight."""


def _recorded_event(device: torch.device) -> torch.Event:
    """An event recorded on ``device``'s current stream."""
    event = torch.Event(device=device)
    event.record()
    return event


class OffloadStaging:
    """The host-to-device and device-to-host copies of one offloaded flat buffer, with their
    events, counted in ``stats`` (``h2d_*`` / ``d2h_*``); the interface of
    :class:`DeviceStaging`.

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

    def compute_device(self, device: torch.device, mesh_device: torch.device) -> torch.device:
        """The mesh's device ``mesh_device`` (the chunk lives on the host), or meta."""
        return device if device.type == "meta" else mesh_device

    def sharded_device(self, device: torch.device) -> torch.device:
        """The host, unless the buffer is on the meta device."""
        return device if device.type == "meta" else self.host

    def new_sharded(
        self, numel: int, dtype: torch.dtype, device: torch.device, *, zero: bool
    ) -> torch.Tensor:
        """A new ``[numel]`` buffer on ``device`` (:meth:`sharded_device`), pinned on the host
        under ``CPUOffloadPolicy(pin_memory=True)``."""
        if device.type == "cpu":
            return self.new_host(numel, dtype, zero=zero)
        new = torch.zeros if zero else torch.empty
        return new(numel, dtype=dtype, device=device)

    def check_move(self, device: torch.device, fqn: str, mesh_type: str) -> None:
        """``ValueError`` unless ``device`` is the host (or meta): the sharded parameters
        stay there."""
        if device.type not in (self.host.type, "meta"):
            raise ValueError(
                f"cannot move parameter {fqn} of a fully_shard unit to {device}: the unit "
                f"offloads its sharded parameters (offload_policy=CPUOffloadPolicy()), so "
                f"they stay on {self.host} and are copied to the mesh's "
                f"{mesh_type} device for each all-gather; materialize a "
                f"meta-device model with to_empty(device='cpu') (as FSDP2 requires)"
            )

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
