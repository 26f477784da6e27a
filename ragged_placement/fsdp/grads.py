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

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from ragged_placement.fsdp.collectives import Reduction
from ragged_placement.fsdp.mesh import BufferComm, ShardComm
from ragged_placement.fsdp.param import ParamSlot
from ragged_placement.planner.layout import FlatLayout

__all__ = ["FlatGrads", "GradLayout", "GradPlace"]


@dataclass(frozen=True)
class GradLayout:
    """What a flat buffer's gradients follow for the buffer's life: its ``plan`` over
    ``world_size`` ranks (this one ``rank``), its parameters ``slots``, its communication
    (``comm``, which builds the reduce-scatter), its ``staging`` (where the sharded gradient
    lives: :mod:`ragged_placement.fsdp.offload`) and ``spmd`` (``fully_shard(dp_mesh_dims=...)``'s
    full mesh, ``None`` without)."""

    plan: FlatLayout
    slots: Sequence[ParamSlot]
    rank: int
    world_size: int
    comm: BufferComm
    staging: Any  # DeviceStaging or OffloadStaging
    spmd: Any  # SPMDMesh or None


@dataclass(frozen=True)
class GradPlace:
    """Where and in which dtypes a flat buffer's gradients live since its last allocation:
    the compute ``device`` (the unsharded gradients), ``sharded_device`` (the sharded gradient:
    the host under CPU offload), ``param_dtype`` (the unsharded gradients), ``reduce_dtype``
    (the reduce-scatter) and ``orig_dtype`` (the sharded gradient, the parameters')."""

    device: torch.device
    sharded_device: torch.device
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    orig_dtype: torch.dtype

_FLAT_REFS: list[int] = []


def _flat_refs() -> int:
    """``sys.getrefcount`` of a tensor that one attribute and one local name hold while views
    of it exist (each view's autograd metadata keeps the base, which may keep its Python object
    alive once more): what :meth:`FlatGrads._spare_of` sees when nothing else holds the flat
    gradient. Measured once, on this torch, outside inference mode (where the flat gradients are
    made: an inference tensor's view does not keep its base, and a count taken under
    ``torch.inference_mode()``, the first pre-forward's, would never match again)."""
    if not _FLAT_REFS:
        with torch.inference_mode(False):
            _FLAT_REFS.append(_refs_with_a_view())
    return _FLAT_REFS[0]


def _refs_with_a_view() -> int:
    """:func:`_flat_refs`' count, taken in the current mode: the same names hold the tensor as
    in ``_spare_of`` (one attribute, one local) beside one view."""
    holder = type("Holder", (), {})()
    holder.sharded = torch.empty(1)
    view = holder.sharded.as_strided((1,), (1,), 0)
    flat = holder.sharded
    refs = sys.getrefcount(flat)
    del view
    return refs


# BufferComm.start_rest as the base class defines it: the reduction's output is the summed
# chunk that lands (a state_sharding's reductions beyond ``params`` give another)
_LANDS_OUTPUT = BufferComm.start_rest


class FlatGrads:
    """The gradient side of a flat buffer: its unsharded per-segment gradient buffers, its
    sharded gradient and the reduce-scatter output in flight (see the module docstring).

    The buffer hands it what it needs and it never reads the buffer: the layout here, where the
    gradients live at each allocation (:meth:`reset`), the parameters and their specs at each
    binding (:meth:`bind`).

    Args:
        layout: what the gradients follow for the buffer's life.
    """

    unsharded: list[torch.Tensor | None]  # per plan segment
    accumulated: list[torch.Tensor | None]  # per plan segment, in reduce_dtype
    sharded: torch.Tensor | None
    segment_of: list[int]  # slot index -> plan segment
    # slot index -> (shape, stride, offset) of its local view in this rank's chunk
    _local_views: list[tuple[torch.Size, tuple[int, ...], int]]
    _layout: GradLayout
    _place: GradPlace | None  # since the last reset (None before the first)
    # the buffer's parameters (the same objects for its life) and their specs (bind)
    _sharded_params: Sequence[nn.Parameter]
    _unsharded_params: Sequence[nn.Parameter]
    _specs: Sequence[DTensorSpec]
    _unsharded_specs: Sequence[DTensorSpec | None]
    _reduction: Reduction | None  # the reduce-scatter in flight, until it lands
    # per slot, the ``.grad`` DTensor that views ``sharded`` (None: none does), set at landing
    _landed: list[DTensor | None] | None
    # a flat sharded gradient that zero_grad() dropped, its storage freed, with the ``.grad``
    # DTensors that viewed it, while nothing else references them: the next reduction lands in
    # it and hands out the same DTensors (see _spare_of); ``_lending`` while it is in flight
    _spare: tuple[torch.Tensor, list[DTensor | None]] | None
    _lending: tuple[torch.Tensor, list[DTensor | None]] | None
    # per plan segment, where the buffer's communication is a ShardComm (its reduce-scatter
    # reads the inputs only until it is waited on): the gradient buffer, its storage allocated
    # from the first gradient of a backward until the reduce-scatter is waited on, and the
    # ``.grad`` each trainable parameter of the segment gets (views of it, built once)
    _kept: list[tuple[torch.Tensor, list[tuple[ParamSlot, torch.Tensor, torch.Tensor]]] | None]
    _keeps: bool
    _reducing: list[torch.Tensor]  # the kept buffers the reduce-scatter in flight reads
    # the steady state's reduction (see _steady_reduction): the kept buffers into the spare
    # flat gradient, built once per spare and reduce_group, with the reduce_group it was
    # built for (None: not yet)
    _steady: tuple[Reduction, dist.ProcessGroup | None] | None
    # FSDPModule.set_separate_reduce_scatter_group: the reduce-scatter's own group over the
    # shard ranks; None: the shard group (the all-gather's)
    reduce_group: dist.ProcessGroup | None

    def __init__(self, layout: GradLayout) -> None:
        self._layout = layout
        self._place = None
        self._sharded_params = self._unsharded_params = self._specs = []
        self._unsharded_specs = []
        self.reduce_group = None
        plan = layout.plan
        self.segment_of = [plan.segment_index(slot.fqn) for slot in layout.slots]
        self._keeps = type(layout.comm) is ShardComm
        views = plan.local_views(torch.empty(plan.chunk_numel, device="meta"), layout.rank)
        self._local_views = [
            (v.shape, v.stride(), v.storage_offset())
            for v in (views[slot.fqn] for slot in layout.slots)
        ]
        self.reset(None)

    def local_views(self, chunk: torch.Tensor) -> list[torch.Tensor]:
        """Each slot's view of this rank's flat ``chunk`` (a sharded gradient), in slot order:
        the plan's ``local_views``, computed once."""
        base = chunk.storage_offset()
        return [chunk.as_strided(shape, stride, base + offset)
                for shape, stride, offset in self._local_views]

    def reset(self, place: GradPlace | None) -> None:
        """No gradients (new buffers: each segment's is allocated at its first gradient), to
        live at ``place`` (the buffer's allocation)."""
        self._place = place
        layout = self._layout
        self.unsharded = [None] * len(layout.plan.segments)
        self.accumulated = [None] * len(layout.plan.segments)
        self.sharded = None
        self._reduction = None
        self._landed = self._spare = self._lending = None
        self._kept = [None] * len(layout.plan.segments)
        self._reducing = []
        self._steady = None

    def bind(self, sharded_params: Sequence[nn.Parameter],
             unsharded_params: Sequence[nn.Parameter], specs: Sequence[DTensorSpec],
             unsharded_specs: Sequence[DTensorSpec | None]) -> None:
        """The buffer's parameters (the same objects at every call) and, since this binding,
        their specs: the sharded gradients' and the unsharded ones' (``None``: a plain
        tensor)."""
        self._sharded_params, self._unsharded_params = sharded_params, unsharded_params
        self._specs, self._unsharded_specs = specs, unsharded_specs

    def release_dropped(self) -> None:
        """Free the flat sharded gradient once ``zero_grad()`` has dropped every ``.grad`` viewing
        it, so that it does not sit through the next forward."""
        if self.sharded is not None and all(
            p.grad is None or not p.requires_grad for p in self._sharded_params
        ):
            self._spare = self._spare_of()
            self._landed = None
            self.sharded = None

    def _spare_of(self) -> tuple[torch.Tensor, list[DTensor | None]] | None:
        """The dropped flat gradient ``sharded`` and its ``.grad`` DTensors (``_landed``), its
        storage freed, if nothing but this object references them (AccumulateGrad's rule for
        stealing a gradient): no DTensor, no local tensor, no view of the storage is held
        elsewhere, so handing them out again after the next reduction wrote the storage is
        indistinguishable from new ones, and saves a view and a DTensor per parameter."""
        landed, flat = self._landed, self.sharded
        if landed is None or self._layout.staging.host is not None:  # none under offload
            return None
        views = 0
        for d in landed:  # references: the list's, ``d``, getrefcount's argument
            if d is None:
                continue
            if sys.getrefcount(d) != 3 or sys.getrefcount(d._local_tensor) != 2:
                return None
            views += 1
        # ``flat``: as many references as a tensor with views held by one attribute (_FLAT_REFS);
        # its storage: ``flat``, each view, the temporary storage object
        storage = flat.untyped_storage()
        steady = self._steady  # the steady reduction's output is one more reference
        held = 1 if steady is not None and steady[0].output is flat else 0
        if (sys.getrefcount(flat) != _flat_refs() + held
                or torch._C._storage_Use_Count(storage._cdata) != 2 + views):
            return None
        storage.resize_(0)
        return flat, landed

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
        layout = self._layout
        k = self.segment_of[index]
        seg = layout.plan.segments[k]
        return self.unsharded[k], layout.plan.offsets[layout.slots[index].fqn] - seg.buffer_offset

    def prepare(self, index: int) -> None:
        """Called before slot ``index``'s first gradient of a backward lands: allocate its
        segment's zeroed flat buffer and preset the ``.grad`` of each parameter in the segment
        to its view of it, so that AccumulateGrad adds into the buffer in place."""
        k = self.segment_of[index]
        if self.unsharded[k] is not None:
            return  # allocated by an earlier parameter, or accumulating micro-batches
        self.release_dropped()
        kept = self._kept[k]
        if kept is None:
            kept = self._segment_grads(k)
            if self._keeps:
                self._kept[k] = kept
        else:
            buf = kept[0]
            buf.untyped_storage().resize_(buf.numel() * buf.element_size())
            buf.zero_()
        buf, grads = kept
        self.unsharded[k] = buf
        for slot, p, g in grads:
            if slot.requires_grad:
                p.grad = g

    def _segment_grads(self, k: int) -> tuple[torch.Tensor, list]:
        """Segment ``k``'s zeroed gradient buffer and, per parameter of the segment, the
        ``.grad`` its unsharded parameter gets: its view of the buffer (a DTensor on the
        tensor-parallel mesh for a tensor-parallel parameter)."""
        layout, place = self._layout, self._place
        seg = layout.plan.segments[k]
        buf = torch.zeros(seg.buffer_numel(layout.world_size), dtype=place.param_dtype,
                          device=place.device)
        grads = []
        params = zip(layout.slots, self._unsharded_params, self._unsharded_specs)
        for i, (slot, p, tp) in enumerate(params):
            if self.segment_of[i] == k:
                o = layout.plan.offsets[slot.fqn] - seg.buffer_offset
                g = buf[o : o + slot.shape.numel()].view(slot.shape)
                if tp is not None and layout.spmd is not None:
                    tp = layout.spmd.grad_spec(tp)
                grads.append((slot, p, g if tp is None else DTensor(g, tp, requires_grad=False)))
        return buf, grads

    def _free_kept(self, buffers) -> None:
        """Release the storage of those of ``buffers`` that are kept segment buffers."""
        for k, kept in enumerate(self._kept):
            if kept is not None and any(kept[0] is x for x in buffers):
                kept[0].untyped_storage().resize_(0)

    def drop_unreduced(self) -> None:
        """Forget the gradients not reduced yet (``reset_iter_state`` after an exception)."""
        self._free_kept(self.unsharded)
        self.unsharded = [None] * len(self.unsharded)
        self.accumulated = [None] * len(self.accumulated)

    def accumulate_unreduced(self) -> None:
        """After a backward without gradient sync, where ``reduce_dtype`` differs from
        ``param_dtype``: add each segment's gradients into its ``reduce_dtype`` accumulator and
        zero them for the next micro-batch (FSDP2's ``to_accumulated_grad_if_needed`` and
        ``accumulate_unsharded_grad_if_needed``, bitwise: the same casts and additions)."""
        place = self._place
        if place.reduce_dtype == place.param_dtype:
            return
        for k, g in enumerate(self.unsharded):
            if g is None:
                continue
            if self.accumulated[k] is None:
                self.accumulated[k] = g.to(place.reduce_dtype)
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
        assert self.pending and self._reduction is None
        steady = self._steady_reduction()
        if steady is not None:
            return steady
        layout, place = self._layout, self._place
        for p in self._unsharded_params:
            p.grad = None
        grads = self.unsharded
        rs_in = [
            (acc.add_(g) if g is not None else acc) if acc is not None
            else g if g is not None else torch.zeros(
                seg.buffer_numel(layout.world_size), dtype=place.reduce_dtype, device=place.device
            )
            for g, acc, seg in zip(grads, self.accumulated, layout.plan.segments)
        ]
        self.unsharded = [None] * len(rs_in)
        self.accumulated = [None] * len(rs_in)
        rs_in = [g.to(place.reduce_dtype) for g in rs_in]  # the mixed-precision cast, if any
        reduction = layout.comm.reduction(rs_in, self.reduce_group)
        for k, kept in enumerate(self._kept):
            if kept is not None and kept[0] is reduction.output:
                self._kept[k] = None  # one rank: the gradient buffer lands as the .grad
        self._reducing = [x for x in grads if x is not None and any(x is y for y in rs_in)]
        self._free_kept([x for x in grads if x is not None and all(x is not y for y in rs_in)])
        spare, self._spare = self._spare, None
        out = reduction.output
        if (spare is not None and self.sharded is None and out is not None
                and place.reduce_dtype == place.orig_dtype
                and type(layout.comm).start_rest is _LANDS_OUTPUT
                and all(out is not x for x in rs_in)
                and (out.shape, out.dtype, out.device) == (spare[0].shape, spare[0].dtype,
                                                           spare[0].device)):
            # the reduction's output is what lands: write it into the spare instead
            flat = spare[0]
            flat.untyped_storage().resize_(flat.numel() * flat.element_size())
            reduction = Reduction(flat, reduction.inputs, reduction.segments,
                                  reduction.world_size, reduction.group)
            self._lending = spare
        self._reduction = reduction
        return reduction

    def _is_steady(self) -> bool:
        """Whether this backward's reduction is the steady state's (see
        :meth:`_steady_reduction`)."""
        if self._spare is None or not self._keeps or self.sharded is not None:
            return False
        kept, accumulated = self._kept, self.accumulated
        for k, g in enumerate(self.unsharded):
            if g is None or kept[k] is None or kept[k][0] is not g or accumulated[k] is not None:
                return False
        place = self._place
        return place.reduce_dtype == place.param_dtype == place.orig_dtype

    @property
    def steady(self) -> Reduction | None:
        """The steady state's reduction last built (see :meth:`_steady_reduction`)."""
        return self._steady[0] if self._steady is not None else None

    def _steady_reduction(self) -> Reduction | None:
        """:meth:`prepare_reduce` on the steady state of a training loop, where it gives what
        the general path gives without remaking it; ``None`` elsewhere. The steady state: the
        buffer's communication keeps its segment buffers (a :class:`ShardComm` over more than
        one rank), every segment's gradients are in its kept buffer, none were accumulated
        without sync, no dtype changes on the way (``reduce_dtype``, ``param_dtype`` and the
        parameters' are one), and ``zero_grad()`` left the flat gradient as a spare to land in.
        The reduce-scatter then reads the kept buffers themselves and writes the spare, so its
        :class:`Reduction` is the same object at every step: built once per spare and reduce
        group, and the unit reuses its c10d views (:class:`~ragged_placement.fsdp.collectives.
        FixedReduceScatter`)."""
        if not self._is_steady():
            # what it was built over (a flat gradient the caller may be holding) is not kept
            # alive beyond its steady state
            self._steady = None
            return None
        spare, kept = self._spare, self._kept
        flat, built = spare[0], self._steady
        if built is not None and built[0].output is flat and built[1] is self.reduce_group:
            steady = built[0]
        else:
            inputs = list(self.unsharded)
            general = self._layout.comm.reduction(inputs, self.reduce_group)
            if (general.world_size == 1 or general.output is None
                    or (general.output.shape, general.output.dtype, general.output.device)
                    != (flat.shape, flat.dtype, flat.device)):
                self._steady = None
                return None
            steady = Reduction(flat, inputs, general.segments, general.world_size, general.group)
            self._steady = (steady, self.reduce_group)
        for p in self._unsharded_params:
            p.grad = None
        self._reducing = steady.inputs
        self.unsharded = [None] * len(kept)
        self._spare, self._lending = None, spare
        flat.untyped_storage().resize_(flat.numel() * flat.element_size())
        self._reduction = steady
        return steady

    def take_reduced(self) -> Reduction | None:
        """The reduce-scatter (its ``output`` holds the result) once the unit waited on it
        (``None`` if this buffer had no gradients to reduce)."""
        out, self._reduction = self._reduction, None
        self._free_kept(self._reducing)
        self._reducing = []
        return out

    def land(self, out: torch.Tensor, scale: float, divisor: float, *, shared: bool) -> None:
        """Average the summed reduction ``out`` (times ``scale``, over ``divisor``) and land it
        in the sharded gradients (through the host under CPU offload). ``shared``: code outside
        the runtime saw ``out`` (an all-reduce hook), so it is never landed in again."""
        layout, place = self._layout, self._place
        if scale == 1.0 and divisor != 1:  # a division: bitwise what FSDP2's averaging gives
            out.div_(divisor)
        elif scale != 1.0 or divisor != 1:
            out.mul_(scale / divisor)
        if out.dtype != place.orig_dtype:
            out = out.to(place.orig_dtype)
        self.release_dropped()
        out = layout.staging.to_host(out, landing=self.sharded is None)
        lending, self._lending = self._lending, None
        if self.sharded is None:
            self.sharded = out
            spare = lending[1] if lending is not None and lending[0] is out else None
            views = None
            landed: list[DTensor | None] = []
            params = zip(layout.slots, self._specs, self._sharded_params)
            for i, (slot, spec, p) in enumerate(params):
                d = None
                if slot.requires_grad and p.grad is None:
                    d = spare[i] if spare is not None else None
                    if d is None:
                        views = views or self.local_views(out)
                        d = DTensor(views[i], spec, requires_grad=False)
                    p.grad = d
                elif slot.requires_grad:  # kept while it was frozen (released with the old
                    views = views or self.local_views(out)  # buffer): accumulate
                    p.grad._local_tensor.add_(views[i])
                landed.append(d)
            self._landed = None if shared else landed
        else:
            self._accumulate(out)

    def _accumulate(self, new: torch.Tensor) -> None:
        layout = self._layout
        self._landed = None  # the DTensors viewing ``sharded`` are not tracked here
        for slot, spec, p, view, own in zip(layout.slots, self._specs, self._sharded_params,
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
        if all(g is None for g in grads):
            return
        layout, place = self._layout, self._place
        self.sharded = layout.staging.new_sharded(
            layout.plan.chunk_numel, place.orig_dtype, place.sharded_device, zero=True)
        self._landed = None
        for spec, p, g, view in zip(self._specs, self._sharded_params, grads,
                                    self.local_views(self.sharded)):
            if g is None:
                continue
            if "meta" not in (place.device.type, g._local_tensor.device.type):
                view.copy_(g._local_tensor.to(place.orig_dtype))
            p.grad = DTensor(view, spec, requires_grad=False)
