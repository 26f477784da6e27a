"""One FSDP unit: the flat buffers of the parameters one ``fully_shard`` call owns.

Layout (from :func:`ragged_placement.planner.plan_segmented`): the unit's parameters are packed,
in plan order, into one global flat buffer of ``S * world_size`` elements (``S`` =
``plan.chunk_numel``); rank ``r`` owns the equal chunk ``[r*S, (r+1)*S)``. Where equal chunks
would pad (more than 1%, or more than per-parameter ``Shard(0)``) the planner returns uneven
chunks instead (:class:`~ragged_placement.planner.UnevenPlan`): the buffer holds exactly the
parameters (``plan.buffer_numel``), rank ``r`` owns ``[rank_starts[r], rank_starts[r+1])``, every
rank's sharded buffer has the largest chunk's size and uses its first ``plan.rank_numel(r)``
elements, and the collectives are the uneven ones of :mod:`ragged_placement._compat`. Because the planner cuts only on row (or
coarser) boundaries, each parameter's part of a chunk is a :class:`RaggedShard` local tensor.

Buffers a unit holds (``W`` = world size, ``P`` = ``param_dtype``, ``R`` = ``reduce_dtype``):

* ``sharded``: ``[S]`` in the parameters' dtype, persistent. Each sharded parameter is an
  ``nn.Parameter(DTensor)`` whose local tensor is a view of it: optimizers update it in place.
* ``unsharded``: ``[S*W]`` in ``P``, the all-gather output. Its storage is allocated on unshard
  and resized to 0 on reshard. The unsharded parameters are views of that storage at their plan
  offsets, so the all-gather is the only data movement: no copy-in, no copy-out.
* ``unsharded_grads``: one ``[S_k*W]`` buffer in ``P`` per plan segment ``k``, zero-filled when
  backward reaches the segment's first parameter. Each unsharded parameter's ``.grad`` is preset
  to a view of its segment's buffer, so autograd's ``AccumulateGrad`` adds the parameter
  gradient into it in place; the buffers are then the reduce-scatter inputs. For a unit that wraps
  other units the runtime asks the planner for segments that follow the unit's submodules where
  they pad no more, so that the embedding's gradient buffer, say, is not allocated at the output
  projection's gradient, a whole backward before it is needed.
* ``sharded_grad``: ``[S]`` in the parameters' dtype: the reduce-scatter output (averaged over
  the world). Each sharded parameter's ``.grad`` is a RaggedShard DTensor view of it.

With mixed precision the sharded chunk is cast into a ``[S]`` send buffer in ``P`` before the
all-gather and the gradient buffer is cast to ``R`` before the reduce-scatter: those casts are the
only element-wise passes besides the collectives.

With ``quant`` (block-wise FP8, :mod:`ragged_placement.fsdp.fp8`) a unit holding FP8 weights
replaces the cast by quantizing its own blocks into a uint8 send buffer, and ``unsharded`` is the
uint8 all-gather output (FP8 bytes, block scales and the other parameters in ``P``); the
gradient buffers are unchanged.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from ragged_placement._compat import all_gather_segments, all_gather_single, reduce_scatter_segments
from ragged_placement.fsdp.fp8 import FP8UnitGather, fp8_granularity, is_fp8_weight
from ragged_placement.fsdp.mesh import (
    DataParallelMesh,
    ParamLayout,
    spmd_mesh,
    tp_policy,
    tp_spec_of,
    unit_tp_mesh,
)

__all__ = ["CommStats", "FSDPUnit", "ParamSlot"]


def _submodule_groups(fqns: list[str]) -> list[list[str]]:
    """Parameter names grouped by the unit's direct submodule that holds them, in order."""
    groups: dict[str, list[str]] = {}
    for fqn in fqns:
        groups.setdefault(fqn.split(".", 1)[0] if "." in fqn else "", []).append(fqn)
    return list(groups.values())


@dataclass
class ParamSlot:
    """Where one managed parameter lives: every ``(module, attribute)`` that registers it.
    ``shape`` is the planned (for a tensor-parallel DTensor, the TP-local) shape."""

    fqn: str
    owners: list[tuple[nn.Module, str]]
    shape: torch.Size
    requires_grad: bool


@dataclass
class CommStats:
    """Per-unit counters of collectives issued and bytes moved (this rank's send + receive view)."""

    all_gathers: int = 0
    reduce_scatters: int = 0
    all_reduces: int = 0  # HSDP: over the replicate dim
    all_gather_bytes: int = 0
    reduce_scatter_bytes: int = 0
    all_reduce_bytes: int = 0

    def reset(self) -> None:
        self.all_gathers = self.reduce_scatters = self.all_reduces = 0
        self.all_gather_bytes = self.reduce_scatter_bytes = self.all_reduce_bytes = 0


class UnitState(enum.Enum):
    SHARDED = "sharded"
    UNSHARDING = "unsharding"  # all-gather issued, not waited on
    UNSHARDED = "unsharded"


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()


def _alias(
    storage: torch.UntypedStorage,
    dtype: torch.dtype,
    device: torch.device,
    offset: int,
    shape: torch.Size,
) -> torch.Tensor:
    """A tensor over ``storage`` with its own version counter (a plain view would share the
    buffer's, and the all-gather writing the buffer would invalidate tensors autograd saved)."""
    out = torch.empty(0, dtype=dtype, device=device)
    out.set_(storage, offset, shape, _contiguous_stride(shape))
    return out


class FSDPUnit:
    """The flat sharded/unsharded buffers and collectives of one ``fully_shard`` unit.

    Args:
        slots: the parameters this unit owns, in module order (deduplicated by identity).
        params: the original parameters, parallel to ``slots``.
        mesh: a 1-D device mesh (the unit shards over it) or a 2-D ``(replicate, shard)`` one
            (HSDP). Parameters may be DTensors on a tensor-parallel sibling mesh, see
            :mod:`ragged_placement.fsdp.mesh`.
        param_dtype: dtype of the all-gather and of the unsharded parameters.
        reduce_dtype: dtype of the gradient reduce-scatter.
        granularity: the planner's granularity policy for this unit's parameters.
        quant: block-wise FP8 for the weights of the unit's ``FP8Linear`` modules (planned at
            block granularity, all-gathered as FP8 + scales); ``None`` for none.
    """

    def __init__(
        self,
        slots: list[ParamSlot],
        params: list[nn.Parameter],
        mesh: DeviceMesh,
        param_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
        granularity,
        quant=None,
        split_by_submodule: bool = False,
    ) -> None:
        from ragged_placement.planner import plan_segmented

        self.dp = DataParallelMesh.of(mesh)
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(
                f"all parameters of one unit must share a dtype, got {sorted(map(str, dtypes))}"
            )
        self.slots = slots
        self.mesh = mesh
        self.group = self.dp.shard_group
        self.rank = self.dp.shard_rank
        self.world_size = self.dp.shard_size
        tp_specs = [tp_spec_of(s.fqn, p, self.dp) for s, p in zip(slots, params)]
        quantized = [quant is not None and is_fp8_weight(s.owners, s.shape) for s in slots]
        if any(quantized):
            tp_names = [s.fqn for s, t in zip(slots, tp_specs) if t is not None]
            if tp_names:
                raise ValueError(
                    f"quant does not compose with tensor-parallel parameters yet: {tp_names}"
                )
            fp8_shapes = {s.fqn: tuple(s.shape) for s, q in zip(slots, quantized) if q}
            granularity = fp8_granularity(granularity, fp8_shapes, quant.block)
        self.tp_mesh = unit_tp_mesh([s.fqn for s in slots], tp_specs)
        if self.tp_mesh is not None:
            granularity = tp_policy(granularity, {s.fqn: t for s, t in zip(slots, tp_specs)})
        params = [p.to_local() if isinstance(p, DTensor) else p for p in params]
        self.device = params[0].device if params else torch.device(mesh.device_type)
        self.orig_dtype = dtypes.pop() if dtypes else torch.float32
        self.param_dtype = param_dtype or self.orig_dtype
        self.reduce_dtype = reduce_dtype or self.param_dtype
        # A unit whose parameters all belong to inner units (a root container) has no plan,
        # empty buffers, and issues no collectives.
        self.plan = None
        if slots:
            # Segments (several flat layouts, one coalesced collective) when they pad less; the
            # FP8 gather packs every segment into one send buffer (one all-gather). A unit that
            # wraps other units (a root: embedding first in forward, output projection last)
            # also asks for one segment per submodule where that pads no more: its gradients
            # arrive a whole backward apart, and each segment's gradient buffer is allocated
            # when backward reaches it. Inside a leaf unit they arrive within one unit's
            # backward, where extra segments would only cost collective parts.
            self.plan = plan_segmented(
                [(s.fqn, tuple(s.shape)) for s in slots],
                self.world_size,
                granularity=granularity,
                dtype=self.orig_dtype,
                groups=_submodule_groups([s.fqn for s in slots]) if split_by_submodule else None,
                uneven=not any(quantized),  # the FP8 gather packs equal chunks
            )
            self.plan.check_consistent(self.group)
        S = self.plan.chunk_numel if slots else 0
        self.chunk_numel = S

        self.sharded = torch.zeros(S, dtype=self.orig_dtype, device=self.device)
        with torch.no_grad():
            for slot, p in zip(slots, params):
                begin, end = self.plan.local_slice(slot.fqn, self.rank)
                if end > begin:
                    run = self.plan.placements[slot.fqn].shard_local(p.detach(), self.rank)
                    self.sharded[begin:end].copy_(run.reshape(-1))
        # One spec per parameter, shared by the sharded parameter and its gradient. DTensors are
        # built from it directly (as FSDP2 does): from_local would add an autograd node and
        # re-derive the global shape on every gradient landing.
        self.layouts: list[ParamLayout] = []
        self.specs: list[DTensorSpec] = []
        self.spmd_mesh = spmd_mesh(self.dp, self.tp_mesh)  # the mesh of the sharded parameters
        local_views = self.plan.local_views(self.sharded, self.rank) if slots else {}
        self.sharded_params: list[nn.Parameter] = []
        for slot, tp_spec in zip(slots, tp_specs):
            placement = self.plan.placements[slot.fqn]
            placement.check_mesh_size(self.world_size)
            layout = ParamLayout(
                slot.fqn, placement, slot.shape, tp_spec, self.tp_mesh, self.spmd_mesh
            )
            layout.check(self.plan.granularities[slot.fqn])
            self.layouts.append(layout)
            local = local_views[slot.fqn]
            if tuple(local.shape) != placement.local_shape(slot.shape, self.rank):
                raise ValueError(
                    f"plan gives {slot.fqn} a local view of shape {tuple(local.shape)}, but "
                    f"{placement!r} needs {placement.local_shape(slot.shape, self.rank)}"
                )
            spec = layout.sharded_spec(self.dp, self.orig_dtype)
            self.specs.append(spec)
            self.sharded_params.append(
                nn.Parameter(
                    DTensor(local, spec, requires_grad=False), requires_grad=slot.requires_grad
                )
            )

        self.fp8: FP8UnitGather | None = None
        if any(quantized):
            self.fp8 = FP8UnitGather(
                self.plan,
                [s.fqn for s in slots],
                [s.shape for s in slots],
                quantized,
                [s.requires_grad for s in slots],
                quant,
                self.param_dtype,
                self.device,
            )
            self.unsharded = self.fp8.gathered  # its storage is the FP8 gather's
            self._storage = self.unsharded.untyped_storage()
            self.unsharded_params = self.fp8.params
            self.unsharded_specs = [None] * len(slots)
        else:
            self.unsharded = torch.empty(
                self.plan.buffer_numel if slots else 0, dtype=self.param_dtype, device=self.device
            )
            self._storage = self.unsharded.untyped_storage()
            self._storage_nbytes = self._storage.nbytes()
            self._storage.resize_(0)
            self.unsharded_params: list[nn.Parameter] = []
            # Tensor-parallel parameters are unsharded as DTensors on the TP mesh (TP-local
            # views).
            self.unsharded_specs = [lay.unsharded_spec(self.param_dtype) for lay in self.layouts]
            for slot, tp in zip(slots, self.unsharded_specs):
                t = _alias(
                    self._storage,
                    self.param_dtype,
                    self.device,
                    self.plan.offsets[slot.fqn],
                    slot.shape,
                )
                if tp is not None:
                    t = DTensor(t, tp, requires_grad=False)
                self.unsharded_params.append(nn.Parameter(t, requires_grad=slot.requires_grad))
        self.state = UnitState.SHARDED
        self._ag_work: dist.Work | None = None
        self._ag_send: torch.Tensor | None = None
        # Gradient buffers, one per plan segment, each allocated at the first gradient that
        # reaches one of its parameters (see prepare_grads).
        self._segment_of = [self.plan.segment_index(slot.fqn) for slot in slots]
        n_segments = len(self.plan.segments) if slots else 0
        self.unsharded_grads: list[torch.Tensor | None] = [None] * n_segments
        self.sharded_grad: torch.Tensor | None = None
        self._rs_work: dist.Work | None = None
        self._rs_input: list[torch.Tensor] | None = None
        self._rs_output: torch.Tensor | None = None
        self.stats = CommStats()
        self.register(sharded=True)

    # -- parameters ----------------------------------------------------------------------------
    def register(self, *, sharded: bool) -> None:
        """Point every owning module attribute at the sharded or the unsharded parameter."""
        params = self.sharded_params if sharded else self.unsharded_params
        for slot, p in zip(self.slots, params):
            for module, attr in slot.owners:
                module._parameters[attr] = p
        if self.fp8 is not None:  # FP8Linear reads the gathered (q, s), not the parameter
            for slot, w in zip(self.slots, self.fp8.weights):
                if w is not None:
                    for module, _ in slot.owners:
                        module.weight_fp8 = None if sharded else w

    # -- all-gather ------------------------------------------------------------------------------
    def unshard(self, *, async_op: bool) -> None:
        """Issue the all-gather into the unsharded buffer (no-op unless sharded)."""
        if self.state is not UnitState.SHARDED or not self.slots:
            return
        if self.fp8 is not None:
            self.fp8.allocate()
            send = self.fp8.pack(self.rank, self.sharded)  # own blocks -> FP8 + scales, no comm
        elif self.param_dtype == self.orig_dtype:
            self._storage.resize_(self._storage_nbytes)
            send = self.sharded
        else:
            self._storage.resize_(self._storage_nbytes)
            send = self.sharded.to(self.param_dtype)  # the mixed-precision cast: the only copy
        self._ag_send = send
        self.stats.all_gathers += 1
        self.stats.all_gather_bytes += self.unsharded.numel() * self.unsharded.element_size()
        if self.fp8 is not None:
            self._ag_work = all_gather_single(self.unsharded, send, group=self.group, async_op=True)
        else:
            self._ag_work = all_gather_segments(
                self.unsharded, send, self.plan.segments, self.world_size, group=self.group, async_op=True
            )
        self.state = UnitState.UNSHARDING
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        """Wait for an issued all-gather; afterwards the unsharded parameters hold the full values."""
        if self.state is UnitState.UNSHARDING:
            assert self._ag_work is not None
            self._ag_work.wait()
            self._ag_work = None
            self._ag_send = None
            if self.fp8 is not None:
                self.fp8.assemble()
            self.state = UnitState.UNSHARDED

    def reshard(self) -> None:
        """Register the sharded parameters and free the unsharded buffer's storage."""
        self.wait_unshard()
        self.register(sharded=True)
        if self.state is UnitState.UNSHARDED:
            if self.fp8 is not None:
                self.fp8.free()
            else:
                self._storage.resize_(0)
            self.state = UnitState.SHARDED

    # -- gradients -------------------------------------------------------------------------------
    def release_dropped_grads(self) -> None:
        """Free the flat sharded gradient once ``zero_grad()`` has dropped every ``.grad`` viewing
        it, so that it does not sit through the next forward."""
        if self.sharded_grad is not None and all(
            p.grad is None or not p.requires_grad for p in self.sharded_params
        ):
            self.sharded_grad = None

    @property
    def has_unsharded_grads(self) -> bool:
        """Whether backward has produced gradients that are not reduced yet."""
        return any(g is not None for g in self.unsharded_grads)

    def grad_buffer_of(self, index: int) -> tuple[torch.Tensor | None, int]:
        """The gradient buffer of slot ``index``'s segment and the slot's offset in it."""
        k = self._segment_of[index]
        seg = self.plan.segments[k]
        return self.unsharded_grads[k], self.plan.offsets[self.slots[index].fqn] - seg.buffer_offset

    def prepare_grads(self, index: int) -> None:
        """Called before slot ``index``'s first gradient of a backward lands: allocate its
        segment's zeroed flat buffer and preset the ``.grad`` of each parameter in the segment
        to its view of it, so that AccumulateGrad adds into the buffer in place."""
        k = self._segment_of[index]
        if self.unsharded_grads[k] is not None:
            return  # allocated by an earlier parameter, or accumulating micro-batches
        self.release_dropped_grads()
        seg = self.plan.segments[k]
        buf = torch.zeros(seg.buffer_numel(self.world_size), dtype=self.param_dtype, device=self.device)
        self.unsharded_grads[k] = buf
        for i, (slot, p, tp) in enumerate(
            zip(self.slots, self.unsharded_params, self.unsharded_specs)
        ):
            if slot.requires_grad and self._segment_of[i] == k:
                o = self.plan.offsets[slot.fqn] - seg.buffer_offset
                g = buf[o : o + slot.shape.numel()].view(slot.shape)
                p.grad = g if tp is None else DTensor(g, tp, requires_grad=False)

    def reduce_grads(self) -> None:
        """Issue the reduce-scatter of the gradient buffers (async, one coalesced collective);
        :meth:`finish_reduce` completes it. The unsharded gradient buffers are released here; a
        segment no gradient reached contributes zeros."""
        assert self.has_unsharded_grads and self._rs_work is None
        for p in self.unsharded_params:
            p.grad = None
        rs_in = [
            g if g is not None else torch.zeros(
                seg.buffer_numel(self.world_size), dtype=self.reduce_dtype, device=self.device
            )
            for g, seg in zip(self.unsharded_grads, self.plan.segments)
        ]
        self.unsharded_grads = [None] * len(rs_in)
        rs_in = [g.to(self.reduce_dtype) for g in rs_in]  # the mixed-precision cast, if any
        out = torch.empty(self.chunk_numel, dtype=self.reduce_dtype, device=self.device)
        self.stats.reduce_scatters += 1
        self.stats.reduce_scatter_bytes += sum(g.numel() * g.element_size() for g in rs_in)
        self._rs_input, self._rs_output = rs_in, out
        self._rs_work = reduce_scatter_segments(
            out, rs_in, self.plan.segments, self.world_size, op=dist.ReduceOp.SUM, group=self.group,
            async_op=True,
        )

    def finish_reduce(self, scale: float = 1.0) -> None:
        """Wait for the reduce-scatter, average (times ``scale``), and land it in the sharded
        gradients."""
        if self._rs_work is None:
            return
        self._rs_work.wait()
        out = self._rs_output
        self._rs_work = self._rs_input = self._rs_output = None
        if self.dp.hsdp:  # HSDP: sum the replicas' reduced shards
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.dp.replicate_group)
            self.stats.all_reduces += 1
            self.stats.all_reduce_bytes += out.numel() * out.element_size()
        if scale == 1.0:  # a division: bitwise what FSDP2's averaging gives
            out.div_(self.world_size * self.dp.replicate_size)
        else:
            out.mul_(scale / (self.world_size * self.dp.replicate_size))
        if out.dtype != self.orig_dtype:
            out = out.to(self.orig_dtype)
        self.release_dropped_grads()
        if self.sharded_grad is None:
            self.sharded_grad = out
            views = self.plan.local_views(out, self.rank)
            for slot, spec, p in zip(self.slots, self.specs, self.sharded_params):
                if slot.requires_grad:
                    p.grad = DTensor(views[slot.fqn], spec, requires_grad=False)
        else:
            self._accumulate_sharded(out)

    def _accumulate_sharded(self, new: torch.Tensor) -> None:
        views = self.plan.local_views(new, self.rank)
        own = self.plan.local_views(self.sharded_grad, self.rank)
        for slot, spec, p in zip(self.slots, self.specs, self.sharded_params):
            if not slot.requires_grad:
                continue
            if p.grad is None:
                own[slot.fqn].copy_(views[slot.fqn])
                p.grad = DTensor(own[slot.fqn], spec, requires_grad=False)
            else:
                p.grad._local_tensor.add_(views[slot.fqn])
