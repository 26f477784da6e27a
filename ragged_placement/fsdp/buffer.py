"""One dtype's flat storage in an FSDP unit: the sharded and unsharded buffers and the
parameter views over them, with no collectives (the unit, :class:`~ragged_placement.fsdp.unit.
FSDPUnit`, issues those for all its buffers at once).

Layout (from :func:`ragged_placement.planner.plan_segmented`): the buffer's parameters are
packed, in plan order, into one global flat buffer of ``S * world_size`` elements (``S`` =
``plan.chunk_numel``); rank ``r`` owns the equal chunk ``[r*S, (r+1)*S)``. Where equal chunks
would pad (more than 1%, or more than per-parameter ``Shard(0)``) the planner returns uneven
chunks instead (:class:`~ragged_placement.planner.UnevenPlan`): the buffer holds exactly the
parameters (``plan.buffer_numel``), rank ``r`` owns ``[rank_starts[r], rank_starts[r+1])``, every
rank's sharded buffer has the largest chunk's size and uses its first ``plan.rank_numel(r)``
elements, and the collectives are the uneven ones of :mod:`ragged_placement.fsdp.collectives`.
Because the planner cuts only on row (or coarser) boundaries, each parameter's part of a chunk
is a :class:`RaggedShard` local tensor.

Buffers (``W`` = world size, ``P`` = ``param_dtype``, ``R`` = ``reduce_dtype``):

* ``sharded``: ``[S]`` in the parameters' dtype, persistent. Each sharded parameter is an
  ``nn.Parameter(DTensor)`` whose local tensor is a view of it: optimizers update it in place.
* ``unsharded``: ``[S*W]`` in ``P``, the all-gather output. Its storage is allocated on unshard
  and resized to 0 on reshard. The unsharded parameters are views of that storage at their plan
  offsets, so the all-gather is the only data movement: no copy-in, no copy-out.
* the gradient buffers (:class:`~ragged_placement.fsdp.grads.FlatGrads`): one ``[S_k*W]``
  buffer in ``P`` per plan segment ``k`` that ``AccumulateGrad`` adds into in place, allocated
  when backward reaches the segment (for a unit that wraps other units the planner's segments
  follow the unit's submodules where they pad no more, so that the embedding's gradient buffer,
  say, is not allocated at the output projection's gradient, a whole backward before it is
  needed), and the ``[S]`` sharded gradient in the parameters' dtype, the averaged
  reduce-scatter output that the sharded parameters' ``.grad`` DTensors view.

With mixed precision the sharded chunk is cast into a ``[S]`` send buffer in ``P`` before the
all-gather and the gradient buffer is cast to ``R`` before the reduce-scatter: those casts are the
only element-wise passes besides the collectives.

With CPU offload ``sharded`` and the sharded gradient live on the host and the rest on the mesh's
device ``device``, staged by :class:`~ragged_placement.fsdp.offload.OffloadStaging`.

With ``quant`` (block-wise FP8, :mod:`ragged_placement.fsdp.fp8`) a buffer holding FP8 weights
replaces the cast by quantizing its own blocks into a uint8 send buffer, and ``unsharded`` is the
uint8 all-gather output (FP8 bytes, block scales and the other parameters in ``P``); the
gradient buffers are unchanged.

With an ``int`` ``reshard_after_forward`` ``N``
(:class:`~ragged_placement.fsdp.mesh.PostForwardMesh`) post-forward keeps ``post_forward_shard``: this rank's ``1/N`` of the gathered buffer (the
chunks of ``W // N`` consecutive shard ranks, contiguous in every plan segment: the plan's
segments coarsened, :meth:`PostForwardMesh.coarsen`), copied out once before
``unsharded`` is freed; backward's all-gather runs over the ``N``-rank group from it, into
``unsharded`` as before, and frees it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from ragged_placement.fsdp.collectives import Gather
from ragged_placement.fsdp.common import CommStats, Registration, UnitOptions
from ragged_placement.fsdp.gather import PlainGather, PlainGathers
from ragged_placement.fsdp.grads import FlatGrads, GradLayout, GradPlace
from ragged_placement.fsdp.mesh import BufferComm, PostForwardMesh, ShardComm, UnitMesh
from ragged_placement.fsdp.offload import DeviceStaging, OffloadStaging, staging
from ragged_placement.fsdp.param import (
    ParamLayout,
    ParamSlot,
    mesh_device,
    rebind,
    record_forward_tensors,
    resolve_granularity,
    spmd_mesh,
    tp_spec_of,
    unit_tp_mesh,
)
from ragged_placement.fsdp.spmd import SPMDMesh
from ragged_placement.planner.layout import FlatLayout
from ragged_placement.planner.plan import Segment

__all__ = ["FlatBuffer", "check_move_target", "plan_buffer"]


def _submodule_groups(fqns: list[str]) -> list[list[str]]:
    """Parameter names grouped by the unit's direct submodule that holds them, in order."""
    groups: dict[str, list[str]] = {}
    for fqn in fqns:
        groups.setdefault(fqn.split(".", 1)[0] if "." in fqn else "", []).append(fqn)
    return list(groups.values())


def plan_buffer(
    slots: list[ParamSlot],
    world_size: int,
    policy,
    dtype: torch.dtype,
    group,
    *,
    split_by_submodule: bool,
    uneven: bool = True,
) -> FlatLayout:
    """The buffer's flat layout, checked equal on every rank of ``group``.

    Segments (several flat layouts, one coalesced collective) when they pad less; the FP8
    gather packs every segment into one send buffer (one all-gather). A unit that wraps other
    units (a root: embedding first in forward, output projection last) also asks for one
    segment per submodule where that pads no more (``split_by_submodule``): its gradients
    arrive a whole backward apart, and each segment's gradient buffer is allocated when
    backward reaches it. Inside a leaf unit they arrive within one unit's backward, where extra
    segments would only cost collective parts. ``uneven``: uneven per-rank chunks where equal
    ones would pad (:class:`~ragged_placement.planner.UnevenPlan`), FP8 units included."""
    from ragged_placement.planner import plan_segmented

    fqns = [s.fqn for s in slots]
    plan = plan_segmented(
        [(s.fqn, tuple(s.shape)) for s in slots],
        world_size,
        granularity=policy,
        dtype=dtype,
        groups=_submodule_groups(fqns) if split_by_submodule else None,
        uneven=uneven,
    )
    plan.check_consistent(group)
    return plan


def _buffer_device(slots: list[ParamSlot], params: list[torch.Tensor]) -> torch.device:
    """The one device of a buffer's parameters: all on the meta device, or none."""
    meta = [s.fqn for s, p in zip(slots, params) if p.is_meta]
    if meta and len(meta) < len(params):
        real = next(s.fqn for s, p in zip(slots, params) if not p.is_meta)
        raise ValueError(
            f"parameter {meta[0]} of one fully_shard unit is on the meta device but {real} is "
            f"not: build the whole unit under torch.device('meta') or none of it"
        )
    return params[0].device


def _checked_result(out: object, before: DTensor, fqn: str, what: str) -> DTensor:
    """``out`` (``fn(before)`` in :meth:`FlatBuffer.apply_`) if it keeps ``before``'s sharding."""
    if (
        not isinstance(out, DTensor)
        or out.shape != before.shape
        or out.device_mesh != before.device_mesh
        or tuple(out.placements) != tuple(before.placements)
        or out._local_tensor.shape != before._local_tensor.shape
    ):
        got = (
            f"a DTensor of shape {tuple(out.shape)} with {tuple(out.placements)}"
            if isinstance(out, DTensor)
            else type(out).__name__
        )
        raise ValueError(
            f"a move or cast of a fully_shard module maps sharded {what} {fqn} "
            f"({tuple(before.shape)}, {tuple(before.placements)}) to {got}: only device and "
            f"dtype may change"
        )
    return out


def _param_layouts(
    plan: FlatLayout,
    slots: list[ParamSlot],
    tp_specs: list[DTensorSpec | None],
    rank: int,
    world_size: int,
    tp_mesh: DeviceMesh | None,
    mesh: DeviceMesh,
) -> list[ParamLayout]:
    """Each parameter's :class:`ParamLayout` in ``plan``, checked against its cut."""
    layouts: list[ParamLayout] = []
    views = plan.local_views(torch.empty(plan.chunk_numel, device="meta"), rank)
    for slot, tp_spec in zip(slots, tp_specs):
        placement = plan.placements[slot.fqn]
        placement.check_mesh_size(world_size)
        layout = ParamLayout(slot.fqn, placement, slot.shape, tp_spec, tp_mesh, mesh)
        layout.check(plan.granularities[slot.fqn])
        local = views[slot.fqn]
        if tuple(local.shape) != placement.local_shape(slot.shape, rank):
            raise ValueError(
                f"plan gives {slot.fqn} a local view of shape {tuple(local.shape)}, but "
                f"{placement!r} needs {placement.local_shape(slot.shape, rank)}"
            )
        layouts.append(layout)
    return layouts


def check_move_target(
    buffer: FlatBuffer, device: torch.device, dtype: torch.dtype, fqn: str
) -> None:
    """``ValueError`` unless ``buffer`` can live on ``device`` in ``dtype`` (a move or cast of
    its module, :meth:`FlatBuffer.apply_`; ``fqn`` names the parameter moved first): as its
    gather (an FP8 one keeps its other parameters floating) and its staging (CPU offload keeps
    the chunk on the host) allow."""
    buffer.gathers.check_cast(buffer.slots, dtype, buffer.mp_dtypes[0])
    buffer.staging.check_move(device, fqn, buffer.dp.mesh.device_type)


class FlatBuffer:
    """The flat buffers and parameter views of one dtype's parameters in a ``fully_shard`` unit.

    Construction runs four steps, each a method or function of its own:

    1. :func:`~ragged_placement.fsdp.param.resolve_granularity`: the planner policy (the
       user's, then tensor-parallel constraints), then the gather's (FP8: whole blocks);
    2. :func:`plan_buffer`: the flat layout and, per parameter, its :class:`ParamLayout`;
    3. :meth:`allocate`: the flat buffers on a device in a dtype (nothing on the meta device);
    4. :meth:`bind`: the sharded and unsharded parameters as views of those buffers.

    :meth:`apply_` (``nn.Module._apply``: ``to``, ``to_empty``, ``float``, ...) re-runs 3 and 4
    on the moved or cast values, keeping every parameter object.

    Args:
        slots: the parameters of this dtype the unit owns, in module order (at least one).
        params: the original parameters, parallel to ``slots``, all of one dtype. On the meta
            device they are not copied (the buffer stays on the meta device until
            ``to_empty``).
        dp: the unit's mesh (:class:`~ragged_placement.fsdp.mesh.UnitMesh`); the buffer is
            planned over its shard ranks and communicates as its :meth:`~ragged_placement.
            fsdp.mesh.UnitMesh.buffer_comm` says. Parameters may be DTensors on a
            tensor-parallel sibling mesh, see :mod:`ragged_placement.fsdp.param`.
        options: the unit's settings.
        stats: the unit's counters (the CPU-offload copies are counted here).
    """

    slots: list[ParamSlot]
    dp: UnitMesh
    rank: int
    world_size: int
    spmd: SPMDMesh | None  # fully_shard(dp_mesh_dims=...)'s full mesh
    tp_mesh: object
    spmd_mesh: object
    plan: FlatLayout
    chunk_numel: int
    layouts: list[ParamLayout]
    specs: list[DTensorSpec]
    unsharded_specs: list[DTensorSpec | None]
    sharded_params: list[nn.Parameter]
    unsharded_params: list[nn.Parameter]
    registration: Registration | None  # what the owning modules give (None: hidden)
    # how the unit's buffers gather (chosen once per unit from its quant, fsdp/gather.py), and
    # this buffer's all-gather output and unsharded tensors (None on the meta device)
    gathers: PlainGathers
    gather: PlainGather | None  # or the FP8 gather, of the same interface
    # where the sharded chunk and gradient live, and their copies (CPU offload's, or none)
    staging: DeviceStaging | OffloadStaging
    device: torch.device  # the compute device (the mesh's under CPU offload)
    orig_dtype: torch.dtype
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    sharded: torch.Tensor
    grads: FlatGrads
    post_forward_shard: torch.Tensor | None  # see the module docstring
    comm: BufferComm  # the all-gather's and the reductions' groups and buffers (dp's)
    _sends_chunk: bool  # the all-gather sends `sharded` itself (cast at most)
    mp_dtypes: tuple[torch.dtype | None, torch.dtype | None]  # (param, reduce); None: own dtype
    _gathered_dtype: torch.dtype | None  # the param_dtype the gather was built for
    _ag_send: torch.Tensor | None  # the all-gather's input, alive until it is waited on
    _owners: list[tuple[nn.Module, str, int]]  # (module, attribute, slot index) per owner

    def __init__(
        self,
        slots: list[ParamSlot],
        params: list[nn.Parameter],
        dp: UnitMesh,
        options: UnitOptions,
        stats: CommStats,
    ) -> None:
        self.slots = slots
        self._owners = [(m, attr, i) for i, slot in enumerate(slots) for m, attr in slot.owners]
        self.dp = dp
        self.rank = dp.shard_rank
        self.world_size = dp.shard_size
        self.gathers = options.gathers
        self.spmd = options.spmd
        self.mp_dtypes = (options.param_dtype, options.reduce_dtype)
        self.staging = staging(options.offload_policy, stats)
        dtype = params[0].dtype
        tp_specs = [tp_spec_of(s.fqn, p, dp) for s, p in zip(slots, params)]
        self.gathers.check_params(slots, tp_specs)
        policy = resolve_granularity(options.granularity, slots, tp_specs)
        policy = self.gathers.granularity(slots, policy)
        self.tp_mesh = unit_tp_mesh([s.fqn for s in slots], tp_specs)
        self.spmd_mesh = spmd_mesh(dp, self.tp_mesh)  # the mesh of the sharded parameters
        self.plan = plan_buffer(
            slots, self.world_size, policy, dtype, dp.shard_group,
            split_by_submodule=options.split_by_submodule,
        )
        self.chunk_numel = self.plan.chunk_numel
        self.comm = dp.buffer_comm(self.plan)
        self.layouts = _param_layouts(
            self.plan, slots, tp_specs, self.rank, self.world_size, self.tp_mesh, self.spmd_mesh
        )
        self.grads = FlatGrads(GradLayout(self.plan, slots, self.rank, self.world_size,
                                          self.comm, self.staging, self.spmd))
        self.sharded_params = []
        self.unsharded_params = []
        self.registration = Registration.SHARDED
        self.gather = None
        self._gathered_dtype = None
        locals_ = [p.to_local() if isinstance(p, DTensor) else p for p in params]
        device = _buffer_device(slots, locals_)
        self.allocate(device, dtype)
        if device.type != "meta":
            self._copy_in(locals_)
        self.bind()

    # -- layout ---------------------------------------------------------------------------------
    # -- buffers --------------------------------------------------------------------------------
    def allocate(self, device: torch.device, dtype: torch.dtype) -> None:
        """Allocate the flat buffers for parameters in ``dtype`` on ``device``: the zeroed
        ``[S]`` sharded chunk and the unsharded (all-gather output) buffer with its storage
        freed. On the meta device nothing is allocated. With CPU offload the sharded chunk is
        on the host (pinned if asked) and the unsharded buffer on the mesh's device, whatever
        ``device`` is but meta. Gradients and the binding of the parameters are left to the
        caller (:meth:`bind`)."""
        device = torch.device(device)
        self.device = self.staging.compute_device(device, mesh_device(self.dp.mesh))
        self.orig_dtype = dtype
        param_dtype, reduce_dtype = self.mp_dtypes
        self.param_dtype = param_dtype or dtype
        self.reduce_dtype = reduce_dtype or self.param_dtype
        # The unsharded parameters never live on the meta device: they keep their hooks only
        # through moves between devices of one tensor type (see rebind).
        self.sharded = self.new_sharded(dtype)
        # the chunk where the all-gather sends it itself, cast at most (no staging, no packing)
        sends = self.offload_device is None and self.gathers.sends_chunk(self.slots)
        sent = self.sharded if sends else None
        self._sends_chunk = sends
        self._allocate_unsharded(self.device, sent)
        self._ag_send = None
        self.post_forward_shard = None
        self.grads.reset(GradPlace(self.device, self.sharded_device, self.param_dtype,
                                   self.reduce_dtype, dtype))
        self.comm.allocate(self.gather, sent)

    @property
    def offload_device(self) -> torch.device | None:
        """Where ``sharded`` and the sharded gradient live under CPU offload (``None``: none)."""
        return self.staging.host

    @property
    def sharded_device(self) -> torch.device:
        """Where ``sharded`` and the sharded gradient live: the host under CPU offload (unless on
        the meta device), else the compute device :attr:`device`."""
        return self.staging.sharded_device(self.device)

    def new_sharded(self, dtype: torch.dtype, *, zero: bool = True) -> torch.Tensor:
        """A new ``[S]`` buffer for the sharded chunk or gradient on :attr:`sharded_device`,
        in pinned memory under ``CPUOffloadPolicy(pin_memory=True)``."""
        return self.staging.new_sharded(self.chunk_numel, dtype, self.sharded_device, zero=zero)

    @property
    def unsharded(self) -> torch.Tensor | None:
        """The all-gather output (``None`` on the meta device)."""
        return self.gather.gathered if self.gather is not None else None

    @property
    def gathers_own_chunk(self) -> bool:
        """Whether the unit's all-gather may be built once over this buffer
        (:meth:`~ragged_placement.fsdp.mesh.UnitMesh.fixed_all_gather`): a plain gather (not an
        FP8 one) over the shard ranks sending the sharded chunk itself (no CPU offload)."""
        return self._sends_chunk and type(self.gather) is PlainGather and type(self.comm) is ShardComm

    def _allocate_unsharded(self, device: torch.device, sent: torch.Tensor | None) -> None:
        """The gather (all-gather output and unsharded tensors) on ``device`` in
        ``param_dtype``, its storage freed; kept as it is if it already is there (a move of the
        sharded chunk alone), over ``sent``'s storage where the communication shares it
        (:meth:`~ragged_placement.fsdp.mesh.BufferComm.shared_unsharded`). A buffer on the meta
        device has none until ``to_empty``: :meth:`bind` gives it placeholders."""
        if self.device.type == "meta":
            self.gather = None
            return
        old = self.gather
        shared = self.comm.shared_unsharded(sent, self.param_dtype)
        if shared is None and old is not None and (old.gathered.device, self._gathered_dtype) == (
            device,
            self.param_dtype,
        ):
            return
        self._gathered_dtype = self.param_dtype
        self.gather = self.gathers.build(self.plan, self.slots, self.param_dtype, device, shared)

    def _copy_in(self, params: list[torch.Tensor]) -> None:
        """Copy this rank's run of each (TP-local) parameter into the sharded chunk."""
        with torch.no_grad():
            for slot, p in zip(self.slots, params):
                begin, end = self.plan.local_slice(slot.fqn, self.rank)
                if end > begin:
                    run = self.plan.placements[slot.fqn].shard_local(p.detach(), self.rank)
                    self.sharded[begin:end].copy_(run.reshape(-1))

    def bind(self) -> None:
        """Make the sharded parameters DTensors over views of :attr:`sharded` and the unsharded
        ones aliases of the unsharded buffer's storage, and register the sharded ones.

        The first call creates the parameters; later calls (after :meth:`allocate` moved the
        buffers) re-point the same ``nn.Parameter`` objects, so optimizers and hooks that hold
        them stay valid."""
        # One spec per parameter, shared by the sharded parameter and its gradient. DTensors are
        # built from it directly (as FSDP2 does): from_local would add an autograd node and
        # re-derive the global shape on every gradient landing.
        self.specs = [lay.sharded_spec(self.dp, self.orig_dtype) for lay in self.layouts]
        local_views = self.plan.local_views(self.sharded, self.rank)
        sharded = [
            DTensor(local_views[slot.fqn], spec, requires_grad=False)
            for slot, spec in zip(self.slots, self.specs)
        ]
        unsharded = self._unsharded_views()
        fresh = not self.sharded_params
        for i, slot in enumerate(self.slots):
            if fresh:
                self.sharded_params.append(
                    nn.Parameter(sharded[i], requires_grad=slot.requires_grad)
                )
                u = unsharded[i]
                if not isinstance(u, nn.Parameter):  # the FP8 gather's are parameters already
                    u = nn.Parameter(u, requires_grad=slot.requires_grad)
                self.unsharded_params.append(u)
            else:
                rebind(self.sharded_params[i], sharded[i])
                rebind(self.unsharded_params[i], unsharded[i])
        self.grads.bind(self.sharded_params, self.unsharded_params, self.specs,
                        self.unsharded_specs)
        if fresh:
            record_forward_tensors(self)
        self.register(Registration.SHARDED)

    def _unsharded_views(self) -> list[torch.Tensor]:
        """The unsharded parameters' tensors (and :attr:`unsharded_specs`): the gather's
        (tensor-parallel ones wrapped as DTensors on the TP mesh, TP-local views), or
        placeholders on the meta device. (An FP8 buffer has no tensor-parallel parameter but
        FP8 stacks sharded by expert,
        :meth:`~ragged_placement.fsdp.fp8.FP8Gathers.check_params`, nor a full SPMD mesh:
        ``dp_mesh_dims`` refuses ``quant``.)"""
        self.unsharded_specs = [lay.unsharded_spec(self.param_dtype) for lay in self.layouts]
        if self.spmd is not None:  # fully_shard(dp_mesh_dims=...): on the full SPMD mesh
            self.unsharded_specs = [
                self.spmd.unsharded_spec(lay.tp_spec, lay.global_shape, self.param_dtype)
                for lay in self.layouts
            ]
        if self.gather is None:
            # On the meta device: one-element placeholders of each parameter's shape on the
            # mesh's device, re-pointed (hooks kept) at the all-gather output by to_empty.
            compute = mesh_device(self.dp.mesh)
            tensors = [
                torch.zeros((), dtype=self.param_dtype, device=compute).expand(slot.shape)
                for slot in self.slots
            ]
        else:
            tensors = self.gather.params
        return [  # (an FP8 gradient sink is a parameter: its TP wrapper holds it detached)
            t if tp is None else
            DTensor(t.detach() if isinstance(t, nn.Parameter) else t, tp, requires_grad=False)
            for t, tp in zip(tensors, self.unsharded_specs)
        ]

    # -- parameters ----------------------------------------------------------------------------
    def register(self, how: Registration) -> None:
        """Point every owning module at the sharded or the unsharded parameters, as ``how``
        says (:class:`~ragged_placement.fsdp.common.Registration`): ``module._parameters`` and,
        for ``SHARDED_UNSHARDED_ATTRIBUTES``, the unsharded parameter in the module's instance
        ``__dict__``, which an attribute read finds before ``nn.Module.__getattr__`` looks at
        ``_parameters``."""
        params = self.unsharded_params if how is Registration.UNSHARDED else self.sharded_params
        show = how is Registration.SHARDED_UNSHARDED_ATTRIBUTES
        shown = self.registration is Registration.SHARDED_UNSHARDED_ATTRIBUTES
        if show or shown:
            for module, attr, i in self._owners:
                module._parameters[attr] = params[i]
                if show:
                    module.__dict__[attr] = self.unsharded_params[i]
                else:
                    module.__dict__.pop(attr, None)
        else:  # every pass boundary: one dict store per owner
            for module, attr, i in self._owners:
                module._parameters[attr] = params[i]
        if self.gather is not None:  # FP8Linear reads the gathered (q, s), not the parameter
            self.gather.register_weights(self.slots, sharded=how is Registration.SHARDED)
        self.registration = how

    def unregister(self) -> None:
        """Hide the parameters from their modules (so that ``nn.Module._apply`` does not map
        them one by one); :meth:`register` shows them again."""
        self.register(Registration.SHARDED)  # drops the attributes an unsharded one had
        for slot in self.slots:
            for module, attr in slot.owners:
                module._parameters[attr] = None
        self.registration = None

    # -- moves and casts ---------------------------------------------------------------------
    def apply_(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Map the sharded parameters (and their gradients) through ``fn``, as
        ``nn.Module._apply`` does for ``to``, ``to_empty``, ``float``, ``bfloat16``, ...: the
        results are copied, one parameter at a time, into flat buffers :meth:`allocate`\\ d on
        the device and in the dtype ``fn`` gives, and :meth:`bind` re-points the same
        parameter objects at them. A buffer ``fn`` leaves unchanged (every result is its input)
        keeps its buffers. On the meta device (``to_empty`` of a meta-initialized model)
        nothing is copied: this rank allocates its chunk and one parameter's result at a time.
        The caller reshards first and checks that no gradient is pending.

        Raises ``ValueError`` naming the parameter if ``fn`` changes a parameter's shape,
        placements or mesh, gives the buffer's parameters several devices or dtypes, or moves
        them off the mesh's device type.
        """
        old = [(p, p.grad) for p in self.sharded_params]
        grads: list[torch.Tensor | None] = [None] * len(old)
        target: tuple[torch.device, torch.dtype] | None = None  # set at the first change
        with torch.no_grad():
            for i, (slot, (p, g)) in enumerate(zip(self.slots, old)):
                out = _checked_result(fn(p), p, slot.fqn, "parameter")
                if target is None:
                    if out is p:
                        continue
                    target = (out._local_tensor.device, out.dtype)
                    check_move_target(self, *target, slot.fqn)
                    self.allocate(*target)
                    for j in range(i):  # the parameters fn left unchanged
                        self._store(j, old[j][0], target, self.slots[j].fqn)
                self._store(i, out, target, slot.fqn)
                del out
                if g is not None:
                    grads[i] = _checked_result(fn(g), g, slot.fqn, "gradient")
        if target is None:
            return
        for p, _ in old:
            p.grad = None  # a gradient of the old dtype would block the rebind
        self.bind()
        self.grads.land_moved(grads)

    def _store(
        self, index: int, value: DTensor, target: tuple[torch.device, torch.dtype], fqn: str
    ) -> None:
        """Copy ``value``'s local tensor into slot ``index``'s run of the new sharded chunk."""
        if (value._local_tensor.device, value.dtype) != target:
            raise ValueError(
                f"moving or casting a fully_shard unit gave parameter {fqn} "
                f"{value.dtype} on {value._local_tensor.device}, but the unit's other "
                f"parameters {target[1]} on {target[0]}: one unit's parameters share a device "
                f"and a dtype"
            )
        begin, end = self.plan.local_slice(fqn, self.rank)
        if end > begin and "meta" not in (self.device.type, value._local_tensor.device.type):
            self.sharded[begin:end].copy_(value._local_tensor.reshape(-1))

    # -- all-gather ------------------------------------------------------------------------------
    def prepare_unshard(self, pf: PostForwardMesh | None) -> Gather:
        """Give the unsharded buffer its storage and build the send buffer (cast, CPU-offload
        staging, FP8 packing, or the post-forward shard where ``pf``); returns what to
        all-gather. The unit issues it with its other buffers'."""
        if self.device.type == "meta":
            raise ValueError(
                f"parameter {self.slots[0].fqn} (and the rest of its fully_shard unit) is on the "
                f"meta device: materialize the model with model.to_empty(device=...) and "
                f"initialize it (init_weights() / reset_parameters()) before the first forward"
            )
        gather = self.comm.prepare_unshard(self.send_buffer, pf)
        self._ag_send = gather.input
        return gather

    def send_buffer(self, pf: PostForwardMesh | None) -> torch.Tensor:
        """This rank's input of the all-gather: the post-forward shard, or the gather's packing
        (FP8 blocks and scales, or the mixed-precision cast) of the sharded chunk, staged
        host-to-device first under CPU offload (a plain gather's cast in the same copy)."""
        if pf is not None:
            return self.post_forward_shard
        dtype = self.gather.stage_dtype(self.orig_dtype)
        own = self.staging.to_device(self.sharded, dtype, self.device)
        return self.gather.pack(self.rank, own)

    def finish_unshard(self) -> None:
        """After the all-gather completed: free its send buffer and the post-forward shard it
        was gathered from, and assemble the FP8 weights."""
        self._ag_send = None
        self.post_forward_shard = None
        self.gather.assemble()

    def free_unsharded(self) -> None:
        """Free the unsharded buffer's storage (the unsharded parameters keep their views),
        unless the mesh keeps the parameters unsharded (a ``state_sharding`` with
        ``params=()``)."""
        if not self.dp.keeps_params_unsharded:
            self.gather.free()

    def wait_offload_copies(self) -> None:
        """Block the host until the asynchronous staging copies are complete (see
        :meth:`~ragged_placement.fsdp.offload.OffloadStaging.wait`)."""
        self.staging.wait()

    # -- reshard after forward to a smaller group (an int reshard_after_forward) ---------------
    @property
    def gather_segments(self) -> Sequence[Segment]:
        """The segments of the all-gather: the plan's, or for an FP8 buffer the one segment of
        its send buffers (bytes, in rank order; uneven where they are)."""
        return self.gather.send_segments

    def post_forward_copy(self, pf: PostForwardMesh) -> torch.Tensor:
        """This rank's place of the gathered buffer (``1/N`` of it, one copy), to keep in
        :attr:`post_forward_shard` once the buffer is freed (FSDP2's
        ``to_sharded_post_forward``)."""
        segments = pf.coarsen(self.gather_segments)
        kept = self.unsharded.new_empty(sum(s.chunk_numel for s in segments))
        for seg in segments:
            lo, hi = seg.rank_range(pf.rank)
            kept[seg.chunk_offset : seg.chunk_offset + hi - lo].copy_(
                self.unsharded[seg.buffer_offset + lo : seg.buffer_offset + hi]
            )
        return kept
