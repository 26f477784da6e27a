"""One FSDP unit: the flat buffers of the parameters one ``fully_shard`` call owns.

Layout (from :func:`ragged_placement.planner.plan_segmented`): the unit's parameters are packed,
in plan order, into one global flat buffer of ``S * world_size`` elements (``S`` =
``plan.chunk_numel``); rank ``r`` owns the equal chunk ``[r*S, (r+1)*S)``. Where equal chunks
would pad (more than 1%, or more than per-parameter ``Shard(0)``) the planner returns uneven
chunks instead (:class:`~ragged_placement.planner.UnevenPlan`): the buffer holds exactly the
parameters (``plan.buffer_numel``), rank ``r`` owns ``[rank_starts[r], rank_starts[r+1])``, every
rank's sharded buffer has the largest chunk's size and uses its first ``plan.rank_numel(r)``
elements, and the collectives are the uneven ones of :mod:`ragged_placement.fsdp.collectives`. Because
the planner cuts only on row (or coarser) boundaries, each parameter's part of a chunk is a :class:`RaggedShard` local tensor.

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

With CPU offload (``CPUOffloadPolicy``, as FSDP2) ``sharded`` and ``sharded_grad`` live on
``offload_device`` (CPU, pinned if asked) and the rest on the mesh's device ``device``: the chunk
is copied host-to-device into the send buffer (with the cast, one ``copy_``) before each
all-gather, and the averaged reduction is copied device-to-host into the sharded gradient. The
copies are made even where both devices are the CPU, so that CPU runs take the CUDA code path.

Parameters of several dtypes (fp32 norms next to bf16 matrices; FSDP2 refuses such a unit at
its first forward) make a :class:`MultiDtypeUnit` (:func:`build_unit`): one unit as above per
dtype, each zero-copy in its own dtype, driven together; it issues one all-gather and one
reduce-scatter per pass for all dtypes together (each part's share of one coalesced collective,
:meth:`MultiDtypeUnit.unshard`).

Meta-device initialization and moves (FSDP2's recipe)::

    with torch.device("meta"):
        model = Transformer(cfg)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cuda")   # each rank allocates its chunk of each unit, nothing else
    model.init_weights()            # nn.init / copy_ on the sharded parameters

A unit built from meta parameters keeps ``sharded`` on the meta device and allocates nothing
(its unsharded parameters are one-element placeholders on the mesh's device until ``to_empty``). ``nn.Module._apply`` (``to_empty``,
``to``, ``float``, ``bfloat16``, ...; ``FSDPModule._apply``) maps the unit's sharded parameters
one at a time into a newly allocated ``sharded`` chunk (:meth:`FSDPUnit.apply_`), so a rank holds
at most its chunk plus one parameter's result per unit, and re-points the same parameter
objects at it: optimizers built before the move keep working and every parameter stays a view of
the unit's buffer. A forward while the unit is still on the meta device raises ``ValueError``.

The RNG contract of initialization: random ops on the sharded parameters (``nn.init.normal_``,
``uniform_``, ``kaiming_*``, ``xavier_*``; :mod:`ragged_placement.rng`) give each rank its region
of the full tensor that the same op draws on one device from the same generator state, so the
full parameters equal a single-device initialization with the same seed for any world size and
any units (every rank must start from the same generator state). torch 2.13's
``trunc_normal_`` with bounds wider than about one standard deviation rejection-samples with
``mask.any()``, which has no RaggedShard rule yet and raises ``NotImplementedError``. ``copy_``
from a full plain tensor works under ``torch.distributed.tensor.experimental.implicit_replication()``
(torch's rule for mixing plain tensors and DTensors, as under FSDP2), and ``load_state_dict``
takes full tensors directly.

With ``quant`` (block-wise FP8, :mod:`ragged_placement.fsdp.fp8`) a unit holding FP8 weights
replaces the cast by quantizing its own blocks into a uint8 send buffer, and ``unsharded`` is the
uint8 all-gather output (FP8 bytes, block scales and the other parameters in ``P``); the
gradient buffers are unchanged.

With an ``int`` ``reshard_after_forward`` ``N`` (:class:`~ragged_placement.fsdp.mesh.PostForwardMesh`)
post-forward keeps ``post_forward_shard``: this rank's ``1/N`` of the gathered buffer (the
chunks of ``W // N`` consecutive shard ranks, contiguous in every plan segment: the plan's
segments coarsened, :meth:`FSDPUnit.post_forward_segments`), copied out once before
``unsharded`` is freed; backward's all-gather runs over the ``N``-rank group from it, into
``unsharded`` as before, and frees it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from ragged_placement.fsdp.collectives import (
    Gather,
    Reduction,
    issue_all_gather,
    issue_reduce_scatter,
)
from ragged_placement.fsdp.common import CommStats, UnitState
from ragged_placement.fsdp.fp8 import FP8UnitGather, is_fp8_weight
from ragged_placement.fsdp.mesh import DataParallelMesh, PostForwardMesh
from ragged_placement.fsdp.param import (
    ParamLayout,
    ParamSlot,
    alias,
    mesh_device,
    rebind,
    resolve_granularity,
    spmd_mesh,
    tp_spec_of,
    unit_tp_mesh,
)
from ragged_placement.planner.plan import Segment

__all__ = ["FSDPUnit", "MultiDtypeUnit", "build_unit", "plan_unit"]


def _submodule_groups(fqns: list[str]) -> list[list[str]]:
    """Parameter names grouped by the unit's direct submodule that holds them, in order."""
    groups: dict[str, list[str]] = {}
    for fqn in fqns:
        groups.setdefault(fqn.split(".", 1)[0] if "." in fqn else "", []).append(fqn)
    return list(groups.values())


def plan_unit(
    slots: list[ParamSlot],
    world_size: int,
    policy,
    dtype: torch.dtype,
    group,
    *,
    split_by_submodule: bool,
    uneven: bool = True,
):
    """The unit's flat layout (``None`` for a unit without parameters), checked equal on every
    rank of ``group``.

    Segments (several flat layouts, one coalesced collective) when they pad less; the FP8
    gather packs every segment into one send buffer (one all-gather). A unit that wraps other
    units (a root: embedding first in forward, output projection last) also asks for one
    segment per submodule where that pads no more (``split_by_submodule``): its gradients
    arrive a whole backward apart, and each segment's gradient buffer is allocated when
    backward reaches it. Inside a leaf unit they arrive within one unit's backward, where extra
    segments would only cost collective parts. ``uneven``: uneven per-rank chunks where equal
    ones would pad (:class:`~ragged_placement.planner.UnevenPlan`); off for FP8 units, whose
    gather packs equal chunks."""
    from ragged_placement.planner import plan_segmented

    if not slots:
        return None
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


def _unit_dtype(slots: list[ParamSlot], params: list[torch.Tensor]) -> torch.dtype:
    """The one dtype of a unit's parameters (``float32`` for a unit without parameters)."""
    by_dtype: dict[torch.dtype, list[str]] = {}
    for slot, p in zip(slots, params):
        by_dtype.setdefault(p.dtype, []).append(slot.fqn)
    if len(by_dtype) > 1:
        found = "; ".join(f"{d}: {', '.join(names[:3])}" for d, names in by_dtype.items())
        raise ValueError(
            f"all parameters of one fully_shard unit must share a dtype, got {found}. Give "
            f"the differently-typed modules units of their own (fully_shard them first), or "
            f"cast the module to one dtype and use mp_policy for the compute dtype"
        )
    return next(iter(by_dtype), torch.float32)


def _unit_device(
    slots: list[ParamSlot], params: list[torch.Tensor], mesh: DeviceMesh
) -> torch.device:
    """The one device of a unit's parameters: all on the meta device, or none."""
    if not params:
        return torch.device(mesh.device_type)
    meta = [s.fqn for s, p in zip(slots, params) if p.is_meta]
    if meta and len(meta) < len(params):
        real = next(s.fqn for s, p in zip(slots, params) if not p.is_meta)
        raise ValueError(
            f"parameter {meta[0]} of one fully_shard unit is on the meta device but {real} is "
            f"not: build the whole unit under torch.device('meta') or none of it"
        )
    return params[0].device


class FSDPUnit:
    """The flat sharded/unsharded buffers and collectives of one ``fully_shard`` unit.

    Construction runs four steps, each a method or function of its own:

    1. :func:`resolve_granularity`: the planner policy (the user's, then tensor-parallel, then
       FP8 constraints);
    2. :func:`plan_unit`: the flat layout and, per parameter, its :class:`ParamLayout`;
    3. :meth:`allocate`: the flat buffers on a device in a dtype (nothing on the meta device);
    4. :meth:`bind`: the sharded and unsharded parameters as views of those buffers.

    :meth:`apply_` (``nn.Module._apply``: ``to``, ``to_empty``, ``float``, ...) re-runs 3 and 4
    on the moved or cast values, keeping every parameter object.

    Args:
        slots: the parameters this unit owns, in module order (deduplicated by identity).
        params: the original parameters, parallel to ``slots``. On the meta device they are
            not copied (the unit stays on the meta device until ``to_empty``).
        mesh: a 1-D device mesh (the unit shards over it) or a 2-D ``(replicate, shard)`` one
            (HSDP). Parameters may be DTensors on a tensor-parallel sibling mesh, see
            :mod:`ragged_placement.fsdp.mesh`.
        param_dtype: dtype of the all-gather and of the unsharded parameters (``None``: the
            parameters' dtype, also after a cast).
        reduce_dtype: dtype of the gradient reduce-scatter (``None``: ``param_dtype``).
        granularity: the planner's granularity policy for this unit's parameters.
        quant: block-wise FP8 for the weights of the unit's ``FP8Linear`` modules (planned at
            block granularity, all-gathered as FP8 + scales); ``None`` for none.
        split_by_submodule: prefer one plan segment per direct submodule (see :func:`plan_unit`).
        offload_policy: a :class:`~torch.distributed.fsdp.CPUOffloadPolicy` keeps ``sharded``
            and ``sharded_grad`` on :attr:`offload_device` (CPU; pinned with ``pin_memory``)
            and stages them through the compute device :attr:`device` (see
            :meth:`_copy_to_device`, :meth:`_copy_to_host`); ``None`` or a plain
            ``OffloadPolicy``: no offload.
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
        offload_policy=None,
    ) -> None:
        self.dp = DataParallelMesh.of(mesh)
        # CPU offload: where ``sharded`` / ``sharded_grad`` live (None: on ``device``)
        offload = isinstance(offload_policy, CPUOffloadPolicy)
        self.offload_device = torch.device("cpu") if offload else None
        self.pin_memory = offload and offload_policy.pin_memory
        self.slots = slots
        self.mesh = mesh
        self.group = self.dp.shard_group
        self.rank = self.dp.shard_rank
        self.world_size = self.dp.shard_size
        self.quant = quant
        self._mp_dtypes = (param_dtype, reduce_dtype)
        dtype = _unit_dtype(slots, params)
        tp_specs = [tp_spec_of(s.fqn, p, self.dp) for s, p in zip(slots, params)]
        self.quantized = [quant is not None and is_fp8_weight(s.owners, s.shape) for s in slots]
        policy = resolve_granularity(granularity, slots, tp_specs, self.quantized, quant)
        self.tp_mesh = unit_tp_mesh([s.fqn for s in slots], tp_specs)
        self.spmd_mesh = spmd_mesh(self.dp, self.tp_mesh)  # the mesh of the sharded parameters
        # A unit whose parameters all belong to inner units (a root container) has no plan,
        # empty buffers, and issues no collectives.
        self.plan = plan_unit(
            slots, self.world_size, policy, dtype, self.group, split_by_submodule=split_by_submodule,
            uneven=not any(self.quantized),
        )
        self.chunk_numel = self.plan.chunk_numel if slots else 0
        self.layouts = self._layouts(tp_specs)
        self._segment_of = [self.plan.segment_index(slot.fqn) for slot in slots]
        self.sharded_params: list[nn.Parameter] = []
        self.unsharded_params: list[nn.Parameter] = []
        self.fp8: FP8UnitGather | None = None
        self.stats = CommStats()
        # FSDPModule.set_gradient_divide_factor; None: the data-parallel world size
        self.gradient_divide_factor: float | None = None
        locals_ = [p.to_local() if isinstance(p, DTensor) else p for p in params]
        device = _unit_device(slots, locals_, mesh)
        self.allocate(device, dtype)
        if device.type != "meta":
            self._copy_in(locals_)
        self.bind()

    # -- layout ---------------------------------------------------------------------------------
    def _layouts(self, tp_specs: list[DTensorSpec | None]) -> list[ParamLayout]:
        """Each parameter's :class:`ParamLayout`, checked against its plan cut."""
        layouts: list[ParamLayout] = []
        if not self.slots:
            return layouts
        views = self.plan.local_views(torch.empty(self.chunk_numel, device="meta"), self.rank)
        for slot, tp_spec in zip(self.slots, tp_specs):
            placement = self.plan.placements[slot.fqn]
            placement.check_mesh_size(self.world_size)
            layout = ParamLayout(
                slot.fqn, placement, slot.shape, tp_spec, self.tp_mesh, self.spmd_mesh
            )
            layout.check(self.plan.granularities[slot.fqn])
            local = views[slot.fqn]
            if tuple(local.shape) != placement.local_shape(slot.shape, self.rank):
                raise ValueError(
                    f"plan gives {slot.fqn} a local view of shape {tuple(local.shape)}, but "
                    f"{placement!r} needs {placement.local_shape(slot.shape, self.rank)}"
                )
            layouts.append(layout)
        return layouts

    # -- buffers --------------------------------------------------------------------------------
    def allocate(self, device: torch.device, dtype: torch.dtype) -> None:
        """Allocate the flat buffers for parameters in ``dtype`` on ``device``: the zeroed
        ``[S]`` sharded chunk and the unsharded (all-gather output) buffer with its storage
        freed. On the meta device nothing is allocated. With CPU offload the sharded chunk is
        on :attr:`offload_device` (pinned if asked) and the unsharded buffer on the mesh's
        device, whatever ``device`` is but meta. Gradients and the binding of the parameters
        are left to the caller (:meth:`bind`)."""
        device = torch.device(device)
        offloaded = self.offload_device is not None and device.type != "meta"
        self.device = mesh_device(self.mesh) if offloaded else device  # the compute device
        self.orig_dtype = dtype
        param_dtype, reduce_dtype = self._mp_dtypes
        self.param_dtype = param_dtype or dtype
        self.reduce_dtype = reduce_dtype or self.param_dtype
        # The unsharded parameters never live on the meta device: they keep their hooks only
        # through moves between devices of one tensor type (see rebind).
        self.sharded = self._new_sharded(dtype)
        self._allocate_unsharded(self.device)
        self.state = UnitState.SHARDED
        self._ag_work: dist.Work | None = None
        self._ag_send: torch.Tensor | None = None
        # Between forward and backward under an int reshard_after_forward: this rank's place
        # of the gathered buffer and the mesh it was kept for (see reshard_post_forward).
        self.post_forward_shard: torch.Tensor | None = None
        self._post_forward: PostForwardMesh | None = None
        # CUDA offload with pinned memory: the last asynchronous staging copies (see
        # wait_offload_copies)
        self._h2d_event: torch.Event | None = None
        self._d2h_event: torch.Event | None = None
        # Gradient buffers, one per plan segment, each allocated at the first gradient that
        # reaches one of its parameters (see prepare_grads).
        n_segments = len(self.plan.segments) if self.slots else 0
        self.unsharded_grads: list[torch.Tensor | None] = [None] * n_segments
        self.sharded_grad: torch.Tensor | None = None
        self._rs_work: dist.Work | None = None
        self._rs_input: list[torch.Tensor] | None = None
        self._rs_output: torch.Tensor | None = None

    @property
    def sharded_device(self) -> torch.device:
        """Where ``sharded`` and ``sharded_grad`` live: :attr:`offload_device` under CPU
        offload (unless on the meta device), else the compute device :attr:`device`."""
        if self.offload_device is None or self.device.type == "meta":
            return self.device
        return self.offload_device

    def _new_sharded(self, dtype: torch.dtype, *, zero: bool = True) -> torch.Tensor:
        """A new ``[S]`` buffer for the sharded chunk or gradient on :attr:`sharded_device`,
        in pinned memory under ``CPUOffloadPolicy(pin_memory=True)``."""
        device = self.sharded_device
        pin = self.pin_memory and device.type == "cpu"
        new = torch.zeros if zero else torch.empty
        return new(self.chunk_numel, dtype=dtype, device=device, pin_memory=pin)

    def _allocate_unsharded(self, device: torch.device) -> None:
        """The all-gather output on ``device`` in ``param_dtype``, its storage freed; kept as
        it is if it already is there (a move of the sharded chunk alone). A unit on the meta
        device has none (``None``) until ``to_empty``: :meth:`bind` gives it placeholders."""
        if self.device.type == "meta":
            self.unsharded = self._storage = self.fp8 = None
            return
        old = getattr(self, "unsharded", None)
        if old is not None and (old.device, self._gathered_dtype) == (device, self.param_dtype):
            return
        self._gathered_dtype = self.param_dtype
        if any(self.quantized):
            self.fp8 = FP8UnitGather(
                self.plan,
                [s.fqn for s in self.slots],
                [s.shape for s in self.slots],
                self.quantized,
                [s.requires_grad for s in self.slots],
                self.quant,
                self.param_dtype,
                device,
            )
            self.unsharded = self.fp8.gathered  # its storage is the FP8 gather's
            self._storage = self.unsharded.untyped_storage()
        else:
            self.unsharded = torch.empty(
                self.plan.buffer_numel if self.slots else 0, dtype=self.param_dtype, device=device
            )
            self._storage = self.unsharded.untyped_storage()
            self._storage_nbytes = self._storage.nbytes()
            self._storage.resize_(0)

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
        local_views = self.plan.local_views(self.sharded, self.rank) if self.slots else {}
        sharded = [
            DTensor(local_views[slot.fqn], spec, requires_grad=False)
            for slot, spec in zip(self.slots, self.specs)
        ]
        if self.unsharded is None:
            # On the meta device: one-element placeholders of each parameter's shape on the
            # mesh's device, re-pointed (hooks kept) at the all-gather output by to_empty.
            self.unsharded_specs = [lay.unsharded_spec(self.param_dtype) for lay in self.layouts]
            compute = mesh_device(self.mesh)
            unsharded = [
                torch.zeros((), dtype=self.param_dtype, device=compute).expand(slot.shape)
                for slot in self.slots
            ]
            unsharded = [
                t if tp is None else DTensor(t, tp, requires_grad=False)
                for t, tp in zip(unsharded, self.unsharded_specs)
            ]
        elif self.fp8 is not None:
            unsharded = self.fp8.params
            self.unsharded_specs = [None] * len(self.slots)
        else:
            # Tensor-parallel parameters are unsharded as DTensors on the TP mesh (TP-local
            # views).
            self.unsharded_specs = [lay.unsharded_spec(self.param_dtype) for lay in self.layouts]
            unsharded = []
            for slot, tp in zip(self.slots, self.unsharded_specs):
                t = alias(
                    self._storage,
                    self.param_dtype,
                    self.unsharded.device,
                    self.plan.offsets[slot.fqn],
                    slot.shape,
                )
                unsharded.append(t if tp is None else DTensor(t, tp, requires_grad=False))
            self._storage.resize_(0)  # set_ grew it to hold the aliases
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

    # -- moves and casts ---------------------------------------------------------------------
    @contextlib.contextmanager
    def unregistered(self) -> Iterator[None]:
        """Hide the unit's parameters from their modules (so that ``nn.Module._apply`` does not
        map them one by one); the sharded ones are registered again on exit."""
        self.reshard()
        for slot in self.slots:
            for module, attr in slot.owners:
                module._parameters[attr] = None
        try:
            yield
        finally:
            self.register(sharded=True)

    def apply_(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Map the sharded parameters (and their gradients) through ``fn``, as
        ``nn.Module._apply`` does for ``to``, ``to_empty``, ``float``, ``bfloat16``, ...: the
        results are copied, one parameter at a time, into flat buffers :meth:`allocate`\\ d on
        the device and in the dtype ``fn`` gives, and :meth:`bind` re-points the same
        parameter objects at them. A unit ``fn`` leaves unchanged (every result is its input)
        keeps its buffers. On the meta device (``to_empty`` of a meta-initialized model)
        nothing is copied: this rank allocates its chunk of the unit and one parameter's
        result at a time.

        Raises ``ValueError`` naming the parameter if ``fn`` changes a parameter's shape,
        placements or mesh, gives the unit's parameters several devices or dtypes, or moves
        them off the mesh's device type; or if gradients accumulated without sync are pending.
        """
        if not self.slots:
            return
        self.reshard()
        if self.has_unsharded_grads or self._rs_work is not None:
            raise ValueError(
                f"cannot move or cast the unit holding {self.slots[0].fqn} while gradients "
                f"accumulated with set_requires_gradient_sync(False) are pending: call "
                f"reduce_gradients() or run a backward with sync on first"
            )
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
                    self._check_target(*target, slot.fqn)
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
        self._land_moved_grads(grads)

    def _check_target(self, device: torch.device, dtype: torch.dtype, fqn: str) -> None:
        """``ValueError`` unless the unit can live on ``device`` in ``dtype``."""
        fp8 = [s.fqn for s, q in zip(self.slots, self.quantized) if q]
        allowed = (torch.float32, torch.bfloat16, torch.float16)
        if fp8 and self._mp_dtypes[0] is None and dtype not in allowed:
            raise ValueError(
                f"cannot cast the FP8 unit holding {fp8[0]} to {dtype}: the parameters it "
                f"all-gathers next to the FP8 weights must be float32, bfloat16 or float16"
            )
        if self.offload_device is not None:
            if device.type not in (self.offload_device.type, "meta"):
                raise ValueError(
                    f"cannot move parameter {fqn} of a fully_shard unit to {device}: the unit "
                    f"offloads its sharded parameters (offload_policy=CPUOffloadPolicy()), so "
                    f"they stay on {self.offload_device} and are copied to the mesh's "
                    f"{self.mesh.device_type} device for each all-gather; materialize a "
                    f"meta-device model with to_empty(device='cpu') (as FSDP2 requires)"
                )
            return
        if device.type not in (self.mesh.device_type, "meta"):
            raise ValueError(
                f"cannot move parameter {fqn} of a fully_shard unit to {device}: its mesh is on "
                f"{self.mesh.device_type} (move the model before fully_shard, or build the mesh "
                f"on {device.type})"
            )

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

    def _land_moved_grads(self, grads: list[torch.Tensor | None]) -> None:
        """Copy gradients mapped by :meth:`apply_` into a new flat sharded gradient."""
        if all(g is None for g in grads):
            return
        self.sharded_grad = self._new_sharded(self.orig_dtype)
        views = self.plan.local_views(self.sharded_grad, self.rank)
        for slot, spec, p, g in zip(self.slots, self.specs, self.sharded_params, grads):
            if g is None:
                continue
            view = views[slot.fqn]
            if "meta" not in (self.device.type, g._local_tensor.device.type):
                view.copy_(g._local_tensor.to(self.orig_dtype))
            p.grad = DTensor(view, spec, requires_grad=False)

    # -- all-gather ------------------------------------------------------------------------------
    def unshard(self, *, async_op: bool) -> None:
        """Issue the all-gather into the unsharded buffer (no-op unless sharded)."""
        gather = self.prepare_unshard()
        if gather is None:
            return
        self.hold_unshard(issue_all_gather([gather], self.stats))
        if not async_op:
            self.wait_unshard()

    def prepare_unshard(self) -> Gather | None:
        """Everything of :meth:`unshard` but the collective: give the unsharded buffer its
        storage and build the send buffer (cast, CPU-offload staging, FP8 packing, or the
        post-forward shard); returns what to all-gather (``None`` unless sharded). The caller
        issues it (:func:`issue_all_gather`, possibly with other units') and passes the work
        to :meth:`hold_unshard`."""
        if self.state is not UnitState.SHARDED or not self.slots:
            return None
        if self.device.type == "meta":
            raise ValueError(
                f"parameter {self.slots[0].fqn} (and the rest of its fully_shard unit) is on the "
                f"meta device: materialize the model with model.to_empty(device=...) and "
                f"initialize it (init_weights() / reset_parameters()) before the first forward"
            )
        pf = self._post_forward if self.post_forward_shard is not None else None
        if self.fp8 is not None:
            self.fp8.allocate()
        else:
            self._storage.resize_(self._storage_nbytes)
        send = self._send_buffer(pf)
        self._ag_send = send
        world_size = self.world_size if pf is None else pf.size
        if self.fp8 is not None:  # the send buffers, gathered whole in rank order
            segments = [Segment(0, 0, send.numel())]
        elif pf is None:
            segments = self.plan.segments
        else:
            segments = self.post_forward_segments(pf)
        group = self.group if pf is None else pf.group
        return Gather(self.unsharded, send, segments, world_size, group, pf is not None)

    def _send_buffer(self, pf: PostForwardMesh | None) -> torch.Tensor:
        """This rank's input of the all-gather: the post-forward shard, the packed FP8 chunk,
        the staged (CPU offload) or cast chunk, or the sharded chunk itself."""
        if pf is not None:
            return self.post_forward_shard
        if self.fp8 is not None:
            own = self.sharded
            if self.offload_device is not None:
                own = self._copy_to_device(self.orig_dtype)
            return self.fp8.pack(self.rank, own)  # own blocks -> FP8 + scales, no comm
        if self.offload_device is not None:
            return self._copy_to_device(self.param_dtype)  # with the mixed-precision cast
        if self.param_dtype == self.orig_dtype:
            return self.sharded
        return self.sharded.to(self.param_dtype)  # the mixed-precision cast: the only copy

    def hold_unshard(self, work) -> None:
        """Take the work of the all-gather issued for :meth:`prepare_unshard`'s request (shared
        with other units when coalesced with theirs); :meth:`wait_unshard` waits on it."""
        self._ag_work = work
        self.state = UnitState.UNSHARDING

    def _copy_to_device(self, dtype: torch.dtype) -> torch.Tensor:
        """CPU offload's host-to-device staging: the sharded chunk copied into a new ``[S]``
        buffer on the compute device in ``dtype`` (the mixed-precision cast, if any, in the
        same ``copy_``). The copy is always made, also where both devices are the CPU.

        From pinned memory to an accelerator it is asynchronous (``non_blocking``): it is
        ordered before the all-gather on the current stream, and :meth:`reshard` (and
        :meth:`wait_offload_copies`) block the host on its event before the host chunk can be
        written (optimizer step, load, init)."""
        send = torch.empty(self.chunk_numel, dtype=dtype, device=self.device)
        non_blocking = self._async_copies
        send.copy_(self.sharded, non_blocking=non_blocking)
        if non_blocking:
            self._h2d_event = _recorded_event(self.device)
        self.stats.h2d_copies += 1
        self.stats.h2d_bytes += self.sharded.numel() * self.sharded.element_size()
        return send

    def _copy_to_host(self, reduced: torch.Tensor, *, landing: bool) -> torch.Tensor:
        """CPU offload's device-to-host staging: the reduced gradient chunk (averaged, in the
        parameters' dtype) copied into a new ``[S]`` buffer on :attr:`offload_device`.

        Asynchronous from an accelerator into pinned memory only where it lands as a new
        gradient (``landing``), as FSDP2: a gradient added to an existing one is read by the
        host right away. :meth:`wait_offload_copies` (called at the end of backward and of
        ``reduce_gradients``) blocks the host on its event before the optimizer can read it."""
        host = self._new_sharded(reduced.dtype, zero=False)
        non_blocking = self._async_copies and landing
        host.copy_(reduced, non_blocking=non_blocking)
        if non_blocking:
            self._d2h_event = _recorded_event(self.device)
        self.stats.d2h_copies += 1
        self.stats.d2h_bytes += host.numel() * host.element_size()
        return host

    @property
    def _async_copies(self) -> bool:
        """Whether the staging copies are asynchronous: pinned host memory and an accelerator."""
        return self.pin_memory and self.device.type != "cpu"

    def wait_offload_copies(self) -> None:
        """Block the host until this unit's asynchronous staging copies are complete (CUDA
        with pinned memory; nothing to wait for otherwise): afterwards the host may write the
        sharded chunk and read the sharded gradient."""
        self._wait_host_to_device()
        if self._d2h_event is not None:
            self._d2h_event.synchronize()
            self._d2h_event = None

    def _wait_host_to_device(self) -> None:
        """Block the host until the last asynchronous host-to-device staging copy is done."""
        if self._h2d_event is not None:
            self._h2d_event.synchronize()
            self._h2d_event = None

    def wait_unshard(self) -> None:
        """Wait for an issued all-gather; afterwards the unsharded parameters hold the full values."""
        if self.state is UnitState.UNSHARDING:
            assert self._ag_work is not None
            self._ag_work.wait()
            self._ag_work = None
            self._ag_send = None
            self.post_forward_shard = None  # gathered from, if it was kept: free it
            if self.fp8 is not None:
                self.fp8.assemble()
            self.state = UnitState.UNSHARDED

    def reshard(self) -> None:
        """Register the sharded parameters and free the unsharded buffer's storage (and a
        post-forward shard)."""
        self.wait_unshard()
        self.expose_sharded()
        if self.state is UnitState.UNSHARDED:
            if self.fp8 is not None:
                self.fp8.free()
            else:
                self._storage.resize_(0)
            self.state = UnitState.SHARDED
        self.post_forward_shard = None

    # -- reshard after forward to a smaller group (an int reshard_after_forward) ---------------
    def post_forward_segments(self, pf: PostForwardMesh) -> list:
        """The plan's segments coarsened to ``pf``'s ``N`` places: place ``j`` owns, in each
        segment, the chunks of shard ranks ``j * factor`` to ``(j + 1) * factor - 1`` (equal:
        ``factor * chunk_numel`` elements; uneven: ``rank_starts[::factor]``), at
        ``chunk_offset`` in :attr:`post_forward_shard`."""
        out, offset = [], 0
        for seg in self.plan.segments:
            if seg.rank_starts is None:
                starts, numel = None, seg.chunk_numel * pf.factor
            else:
                starts = seg.rank_starts[:: pf.factor]
                numel = max(b - a for a, b in zip(starts, starts[1:]))
            out.append(replace(seg, chunk_offset=offset, chunk_numel=numel, rank_starts=starts))
            offset += numel
        return out

    def expose_sharded(self) -> None:
        """Register the sharded parameters, keeping the gathered buffer as it is (a unit holding
        its forward's all-gather for backward), once a CPU-offload staging copy still reading
        the host chunk has finished: from here on the host may write it (an optimizer step)."""
        self._wait_host_to_device()
        self.register(sharded=True)

    def reshard_post_forward(self, pf: PostForwardMesh) -> None:
        """Keep this rank's place of the gathered unit (``1/N`` of it, one copy) in
        :attr:`post_forward_shard`, then :meth:`reshard`; the next :meth:`unshard` all-gathers
        over ``pf.group`` from it (FSDP2's ``to_sharded_post_forward``). A unit that is not
        unsharded only reshards."""
        self.wait_unshard()
        if self.state is not UnitState.UNSHARDED or not self.slots:
            self.reshard()
            return
        if self.fp8 is not None:  # the gathered send buffers, rank-major: places are contiguous
            n = self.fp8.send_nbytes * pf.factor
            kept = self.unsharded[pf.rank * n : (pf.rank + 1) * n].clone()
        else:
            segments = self.post_forward_segments(pf)
            kept = torch.empty(
                sum(s.chunk_numel for s in segments), dtype=self.param_dtype, device=self.device
            )
            for seg in segments:
                lo, hi = seg.rank_range(pf.rank)
                kept[seg.chunk_offset : seg.chunk_offset + hi - lo].copy_(
                    self.unsharded[seg.buffer_offset + lo : seg.buffer_offset + hi]
                )
        self.reshard()
        self.post_forward_shard, self._post_forward = kept, pf

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
        self.hold_reduce(issue_reduce_scatter([self.prepare_reduce()], self.stats))

    def prepare_reduce(self) -> Reduction:
        """Everything of :meth:`reduce_grads` but the collective: release the unsharded
        gradients into the reduce-scatter inputs (cast to ``reduce_dtype``) and allocate its
        output; returns what to reduce-scatter. The caller issues it
        (:func:`issue_reduce_scatter`, possibly with other units') and passes the work to
        :meth:`hold_reduce`."""
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
        self._rs_input, self._rs_output = rs_in, out
        return Reduction(out, rs_in, self.plan.segments, self.world_size, self.group)

    def hold_reduce(self, work) -> None:
        """Take the work of the reduce-scatter issued for :meth:`prepare_reduce`'s request
        (shared with other units when coalesced with theirs); :meth:`finish_reduce` waits on it."""
        self._rs_work = work

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
        divisor = self.gradient_divide_factor or self.world_size * self.dp.replicate_size
        if scale == 1.0:  # a division: bitwise what FSDP2's averaging gives
            out.div_(divisor)
        else:
            out.mul_(scale / divisor)
        if out.dtype != self.orig_dtype:
            out = out.to(self.orig_dtype)
        self.release_dropped_grads()
        if self.offload_device is not None:
            out = self._copy_to_host(out, landing=self.sharded_grad is None)
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


def _recorded_event(device: torch.device) -> torch.Event:
    """An event recorded on ``device``'s current stream."""
    event = torch.Event(device=device)
    event.record()
    return event


def _checked_result(out: object, before: DTensor, fqn: str, what: str) -> DTensor:
    """``out`` (``fn(before)`` in :meth:`FSDPUnit.apply_`) if it keeps ``before``'s sharding."""
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


def build_unit(
    slots: list[ParamSlot],
    params: list[nn.Parameter],
    mesh: DeviceMesh,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    granularity,
    quant=None,
    split_by_submodule: bool = False,
    offload_policy=None,
) -> FSDPUnit | MultiDtypeUnit:
    """The unit of one ``fully_shard`` call (arguments as :class:`FSDPUnit`'s): an
    :class:`FSDPUnit`, or a :class:`MultiDtypeUnit` when the parameters have several dtypes."""
    args = (mesh, param_dtype, reduce_dtype, granularity, quant, split_by_submodule, offload_policy)
    if len({p.dtype for p in params}) <= 1:
        return FSDPUnit(slots, params, *args)
    if quant is not None:
        _unit_dtype(slots, params)  # FP8 units gather their other parameters in one dtype
    return MultiDtypeUnit(slots, params, *args)


class _SummedStats:
    """The :class:`CommStats` of a :class:`MultiDtypeUnit`: the unit's own counters (the
    all-gathers and reduce-scatters it issues for all parts at once: one each, bytes summed over
    the parts) plus its parts' (what each part issues alone: CPU-offload copies, HSDP
    all-reduces)."""

    def __init__(self, parts: list[FSDPUnit]) -> None:
        self._parts = parts
        self.own = CommStats()

    def __getattr__(self, name: str) -> int:
        if name.startswith("_") or name == "own":
            raise AttributeError(name)
        return getattr(self.own, name) + sum(getattr(p.stats, name) for p in self._parts)

    def reset(self) -> None:
        self.own.reset()
        for p in self._parts:
            p.stats.reset()


class MultiDtypeUnit:
    """A ``fully_shard`` unit whose parameters have several dtypes (fp32 norms next to bf16
    matrices): one :class:`FSDPUnit` per dtype (the parts, in order of first appearance), each
    with its own plan and flat buffers, driven together with the interface of one unit.

    Every part stays zero-copy in its own dtype: sharded parameters view the part's sharded
    chunk, unsharded ones its all-gather output, gradients its flat gradient buffers. The unit
    issues one all-gather per pass and one reduce-scatter per backward for all parts, as a
    one-dtype unit does: each part prepares its share (:meth:`FSDPUnit.prepare_unshard`,
    :meth:`FSDPUnit.prepare_reduce`, in its ``param_dtype`` / ``reduce_dtype``, which default
    to the part's dtype) and the shares run as one coalesced collective (one NCCL group, one
    gloo coalesced op) whose work every part holds; uneven segments are separate calls, as in
    a one-dtype unit. :attr:`stats` counts each coalesced collective once (bytes summed over
    the parts). What a part does alone stays per part: CPU-offload copies and, with HSDP, one
    all-reduce over the replicas per part.
    """

    def __init__(self, slots, params, mesh, param_dtype, reduce_dtype, granularity, quant,
                 split_by_submodule, offload_policy=None) -> None:
        groups: dict[torch.dtype, list[int]] = {}
        for i, p in enumerate(params):
            groups.setdefault(p.dtype, []).append(i)
        self.slots = slots
        self.parts = [
            FSDPUnit(
                [slots[i] for i in idx], [params[i] for i in idx], mesh, param_dtype,
                reduce_dtype, granularity, quant, split_by_submodule, offload_policy,
            )
            for idx in groups.values()
        ]
        self._where = [(0, 0)] * len(slots)  # slot index -> (part, index in the part)
        for k, idx in enumerate(groups.values()):
            for j, i in enumerate(idx):
                self._where[i] = (k, j)
        self.stats = _SummedStats(self.parts)

    def _in_slot_order(self, attr: str) -> list:
        return [getattr(self.parts[k], attr)[j] for k, j in self._where]

    # what a unit exposes to the hooks, the API and the checkpoint code
    dp = property(lambda self: self.parts[0].dp)
    mesh = property(lambda self: self.parts[0].mesh)
    rank = property(lambda self: self.parts[0].rank)
    world_size = property(lambda self: self.parts[0].world_size)
    device = property(lambda self: self.parts[0].device)
    sharded_params = property(lambda self: self._in_slot_order("sharded_params"))
    unsharded_params = property(lambda self: self._in_slot_order("unsharded_params"))
    layouts = property(lambda self: self._in_slot_order("layouts"))
    specs = property(lambda self: self._in_slot_order("specs"))

    @property
    def has_unsharded_grads(self) -> bool:
        return any(p.has_unsharded_grads for p in self.parts)

    def __setattr__(self, name: str, value) -> None:
        # settings a caller gives the unit (e.g. a gradient divide factor) reach every part
        if name in ("slots", "parts", "_where", "stats"):
            object.__setattr__(self, name, value)
        else:
            for p in self.parts:
                setattr(p, name, value)

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "parts":
            raise AttributeError(name)
        values = [getattr(p, name) for p in self.parts]
        try:
            same = all(v is values[0] or bool(v == values[0]) for v in values[1:])
        except (RuntimeError, TypeError, ValueError):  # tensors, or values with no equality
            same = False
        if not same:
            raise AttributeError(
                f"the parts of a unit with several dtypes differ in {name!r}: "
                f"use unit.parts[k].{name}"
            )
        return values[0]

    def register(self, *, sharded: bool) -> None:
        for p in self.parts:
            p.register(sharded=sharded)

    def unshard(self, *, async_op: bool) -> None:
        """Issue one coalesced all-gather for every part that is sharded; each holds its work."""
        ready = [(p, g) for p in self.parts if (g := p.prepare_unshard()) is not None]
        if ready:
            work = issue_all_gather([g for _, g in ready], self.stats.own)
            for p, _ in ready:
                p.hold_unshard(work)
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        for p in self.parts:
            p.wait_unshard()

    def reshard(self) -> None:
        for p in self.parts:
            p.reshard()

    def expose_sharded(self) -> None:
        for p in self.parts:
            p.expose_sharded()

    def reshard_post_forward(self, pf: PostForwardMesh) -> None:
        for p in self.parts:
            p.reshard_post_forward(pf)

    def release_dropped_grads(self) -> None:
        for p in self.parts:
            p.release_dropped_grads()

    def prepare_grads(self, index: int) -> None:
        k, j = self._where[index]
        self.parts[k].prepare_grads(j)

    def reduce_grads(self) -> None:
        """Issue one coalesced reduce-scatter for every part with gradients; each holds its work."""
        ready = [(p, p.prepare_reduce()) for p in self.parts if p.has_unsharded_grads]
        if ready:
            work = issue_reduce_scatter([r for _, r in ready], self.stats.own)
            for p, _ in ready:
                p.hold_reduce(work)

    def finish_reduce(self, scale: float = 1.0) -> None:
        for p in self.parts:
            p.finish_reduce(scale)

    def wait_offload_copies(self) -> None:
        for p in self.parts:
            p.wait_offload_copies()

    @contextlib.contextmanager
    def unregistered(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for p in self.parts:
                stack.enter_context(p.unregistered())
            yield

    def apply_(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for p in self.parts:
            p.apply_(fn)
