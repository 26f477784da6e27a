"""The gradient buffers of one flat buffer (:class:`~ragged_placement.fsdp.buffer.FlatBuffer`).

* ``unsharded``: one ``[S_k*W]`` buffer in ``param_dtype`` per plan segment ``k``, zero-filled
  when backward reaches the segment's first parameter (:meth:`FlatGrads.prepare`). Each
  unsharded parameter's ``.grad`` is preset to a view of its segment's buffer, so autograd's
  ``AccumulateGrad`` adds the parameter gradient into it in place; the buffers are then the
  reduce-scatter inputs (:meth:`FlatGrads.prepare_reduce`).
* ``accumulated``: per segment, in ``reduce_dtype`` where it differs from ``param_dtype``: the
  gradients of backwards run without gradient sync, moved out of ``unsharded`` after each
  (:meth:`FlatGrads.accumulate_unreduced`), so that micro-batches accumulate in
  ``reduce_dtype`` as FSDP2's (its ``unsharded_accumulated_grad``), not in ``param_dtype``.
* ``sharded``: ``[S]`` in the parameters' dtype: the reduce-scatter output, averaged over the
  world (:meth:`FlatGrads.land`). Each sharded parameter's ``.grad`` is a RaggedShard DTensor
  view of it; a later reduction without ``zero_grad()`` adds into it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ragged_placement.fsdp.collectives import Reduction

if TYPE_CHECKING:
    from ragged_placement.fsdp.buffer import FlatBuffer

__all__ = ["FlatGrads"]


class FlatGrads:
    """The gradient side of ``buffer``: its unsharded per-segment gradient buffers, its
    sharded gradient and the reduce-scatter output in flight (see the module docstring).

    Args:
        buffer: the flat buffer whose parameters, plan, dtypes and device the gradients follow.
    """

    unsharded: list[torch.Tensor | None]  # per plan segment
    accumulated: list[torch.Tensor | None]  # per plan segment, in reduce_dtype
    sharded: torch.Tensor | None
    segment_of: list[int]  # slot index -> plan segment
    # slot index -> (shape, stride, offset) of its local view in this rank's chunk
    _local_views: list[tuple[torch.Size, tuple[int, ...], int]]
    _buffer: FlatBuffer
    _reduction: Reduction | None  # the reduce-scatter in flight, until it lands
    # FSDPModule.set_separate_reduce_scatter_group: the reduce-scatter's own group over the
    # shard ranks; None: the shard group (the all-gather's)
    reduce_group: dist.ProcessGroup | None

    def __init__(self, buffer: FlatBuffer) -> None:
        self._buffer = buffer
        self.reduce_group = None
        self.segment_of = [buffer.plan.segment_index(slot.fqn) for slot in buffer.slots]
        views = buffer.plan.local_views(torch.empty(buffer.plan.chunk_numel, device="meta"),
                                        buffer.rank)
        self._local_views = [
            (v.shape, v.stride(), v.storage_offset())
            for v in (views[slot.fqn] for slot in buffer.slots)
        ]
        self.reset()

    def local_views(self, chunk: torch.Tensor) -> list[torch.Tensor]:
        """Each slot's view of this rank's flat ``chunk`` (a sharded gradient), in slot order:
        the plan's ``local_views``, computed once."""
        base = chunk.storage_offset()
        return [chunk.as_strided(shape, stride, base + offset)
                for shape, stride, offset in self._local_views]

    def reset(self) -> None:
        """No gradients (new buffers: each segment's is allocated at its first gradient)."""
        self.unsharded = [None] * len(self._buffer.plan.segments)
        self.accumulated = [None] * len(self._buffer.plan.segments)
        self.sharded = None
        self._reduction = None

    def release_dropped(self) -> None:
        """Free the flat sharded gradient once ``zero_grad()`` has dropped every ``.grad`` viewing
        it, so that it does not sit through the next forward."""
        b = self._buffer
        if self.sharded is not None and all(
            p.grad is None or not p.requires_grad for p in b.sharded_params
        ):
            self.sharded = None

    @property
    def pending(self) -> bool:
        """Whether backward has produced gradients that are not reduced yet."""
        return (any(g is not None for g in self.unsharded)
                or any(g is not None for g in self.accumulated))

    @property
    def reducing(self) -> bool:
        """Whether a reduce-scatter of this buffer's gradients has not landed yet."""
        return self._reduction is not None

    def buffer_of(self, index: int) -> tuple[torch.Tensor | None, int]:
        """The gradient buffer of slot ``index``'s segment and the slot's offset in it."""
        b = self._buffer
        k = self.segment_of[index]
        seg = b.plan.segments[k]
        return self.unsharded[k], b.plan.offsets[b.slots[index].fqn] - seg.buffer_offset

    def prepare(self, index: int) -> None:
        """Called before slot ``index``'s first gradient of a backward lands: allocate its
        segment's zeroed flat buffer and preset the ``.grad`` of each parameter in the segment
        to its view of it, so that AccumulateGrad adds into the buffer in place."""
        b = self._buffer
        k = self.segment_of[index]
        if self.unsharded[k] is not None:
            return  # allocated by an earlier parameter, or accumulating micro-batches
        self.release_dropped()
        seg = b.plan.segments[k]
        buf = torch.zeros(seg.buffer_numel(b.world_size), dtype=b.param_dtype, device=b.device)
        self.unsharded[k] = buf
        for i, (slot, p, tp) in enumerate(zip(b.slots, b.unsharded_params, b.unsharded_specs)):
            if slot.requires_grad and self.segment_of[i] == k:
                o = b.plan.offsets[slot.fqn] - seg.buffer_offset
                g = buf[o : o + slot.shape.numel()].view(slot.shape)
                if tp is not None and b.spmd is not None:
                    tp = b.spmd.grad_spec(tp)
                p.grad = g if tp is None else DTensor(g, tp, requires_grad=False)

    def drop_unreduced(self) -> None:
        """Forget the gradients not reduced yet (``reset_iter_state`` after an exception)."""
        self.unsharded = [None] * len(self.unsharded)
        self.accumulated = [None] * len(self.accumulated)

    def accumulate_unreduced(self) -> None:
        """After a backward without gradient sync, where ``reduce_dtype`` differs from
        ``param_dtype``: add each segment's gradients into its ``reduce_dtype`` accumulator and
        zero them for the next micro-batch (FSDP2's ``to_accumulated_grad_if_needed`` and
        ``accumulate_unsharded_grad_if_needed``, bitwise: the same casts and additions)."""
        b = self._buffer
        if b.reduce_dtype == b.param_dtype:
            return
        for k, g in enumerate(self.unsharded):
            if g is None:
                continue
            if self.accumulated[k] is None:
                self.accumulated[k] = g.to(b.reduce_dtype)
            else:
                self.accumulated[k].add_(g)
            g.zero_()

    def prepare_reduce(self) -> Reduction:
        """Release the unsharded gradients into the reduce-scatter inputs (cast to
        ``reduce_dtype``; a segment no gradient reached contributes zeros) and allocate its
        output; returns what to reduce-scatter. The unit issues it with its other buffers'.
        The buffer's communication builds it (:meth:`~ragged_placement.fsdp.mesh.BufferComm.
        reduction`: under a ``state_sharding`` the reduce-scatter over the ``params`` dims;
        none, and no output, for ``params=()``)."""
        b = self._buffer
        assert self.pending and self._reduction is None
        for p in b.unsharded_params:
            p.grad = None
        rs_in = [
            (acc.add_(g) if g is not None else acc) if acc is not None
            else g if g is not None else torch.zeros(
                seg.buffer_numel(b.world_size), dtype=b.reduce_dtype, device=b.device
            )
            for g, acc, seg in zip(self.unsharded, self.accumulated, b.plan.segments)
        ]
        self.unsharded = [None] * len(rs_in)
        self.accumulated = [None] * len(rs_in)
        rs_in = [g.to(b.reduce_dtype) for g in rs_in]  # the mixed-precision cast, if any
        self._reduction = b.comm.reduction(rs_in, self.reduce_group)
        return self._reduction

    def take_reduced(self) -> Reduction | None:
        """The reduce-scatter (its ``output`` holds the result) once the unit waited on it
        (``None`` if this buffer had no gradients to reduce)."""
        out, self._reduction = self._reduction, None
        return out

    def land(self, out: torch.Tensor, scale: float, divisor: float) -> None:
        """Average the summed reduction ``out`` (times ``scale``, over ``divisor``) and land it
        in the sharded gradients (through the host under CPU offload)."""
        b = self._buffer
        if scale == 1.0 and divisor != 1:  # a division: bitwise what FSDP2's averaging gives
            out.div_(divisor)
        elif scale != 1.0 or divisor != 1:
            out.mul_(scale / divisor)
        if out.dtype != b.orig_dtype:
            out = out.to(b.orig_dtype)
        self.release_dropped()
        out = b.staging.to_host(out, landing=self.sharded is None)
        if self.sharded is None:
            self.sharded = out
            for slot, spec, p, view in zip(b.slots, b.specs, b.sharded_params,
                                           self.local_views(out)):
                if not slot.requires_grad:
                    continue
                if p.grad is None:
                    p.grad = DTensor(view, spec, requires_grad=False)
                else:  # kept while it was frozen (released with the old buffer): accumulate
                    p.grad._local_tensor.add_(view)
        else:
            self._accumulate(out)

    def _accumulate(self, new: torch.Tensor) -> None:
        b = self._buffer
        for slot, spec, p, view, own in zip(b.slots, b.specs, b.sharded_params,
                                            self.local_views(new), self.local_views(self.sharded)):
            if not slot.requires_grad:
                continue
            if p.grad is None:
                own.copy_(view)
                p.grad = DTensor(own, spec, requires_grad=False)
            else:
                p.grad._local_tensor.add_(view)

    def land_moved(self, grads: list[torch.Tensor | None]) -> None:
        """Copy gradients mapped by :meth:`apply_` into a new flat sharded gradient."""
        b = self._buffer
        if all(g is None for g in grads):
            return
        self.sharded = b.new_sharded(b.orig_dtype)
        for spec, p, g, view in zip(b.specs, b.sharded_params, grads,
                                    self.local_views(self.sharded)):
            if g is None:
                continue
            if "meta" not in (b.device.type, g._local_tensor.device.type):
                view.copy_(g._local_tensor.to(b.orig_dtype))
            p.grad = DTensor(view, spec, requires_grad=False)
