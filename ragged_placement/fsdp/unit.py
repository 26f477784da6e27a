"""One FSDP unit: the flat buffers of the parameters one ``fully_shard`` call owns, driven
together (torch FSDP2's ``_fsdp_param_group.py``).

A unit is a group of :class:`~ragged_placement.fsdp.buffer.FlatBuffer` objects, one per
parameter dtype (fp32 norms next to bf16 matrices; FSDP2 refuses such a unit at its first
forward), each zero-copy in its own dtype (layout and buffers:
:mod:`ragged_placement.fsdp.buffer`). The unit issues one all-gather per pass and one
reduce-scatter per backward for all its buffers: each buffer prepares its share
(:meth:`FlatBuffer.prepare_unshard`, :meth:`FlatBuffer.grads.prepare_reduce`, in its
``param_dtype`` / ``reduce_dtype``, which default to the buffer's dtype) and the shares run as
one coalesced collective (:mod:`ragged_placement.fsdp.collectives`; one NCCL group, one gloo
coalesced op); uneven segments are separate calls. :attr:`FSDPUnit.stats` counts each
collective once (bytes summed over the buffers); with HSDP each buffer's reduction is then
all-reduced over the replicas.

Meta-device initialization and moves (FSDP2's recipe)::

    with torch.device("meta"):
        model = Transformer(cfg)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cuda")   # each rank allocates its chunk of each unit, nothing else
    model.init_weights()            # nn.init / copy_ on the sharded parameters

A unit built from meta parameters keeps ``sharded`` on the meta device and allocates nothing
(its unsharded parameters are one-element placeholders on the mesh's device until
``to_empty``). ``nn.Module._apply`` (``to_empty``, ``to``, ``float``, ``bfloat16``, ...;
``FSDPModule._apply``) maps the unit's sharded parameters one at a time into a newly
allocated ``sharded`` chunk (:meth:`FSDPUnit.apply_`), so a rank holds at most its chunk plus
one parameter's result per unit, and re-points the same parameter
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
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from ragged_placement.fsdp.buffer import FlatBuffer
from ragged_placement.fsdp import collectives
from ragged_placement.fsdp.collectives import (
    FixedAllGather,
    FixedReduceScatter,
    Gather,
    Reduction,
    Works,
    coalesces_requests,
    issue_all_gather,
    issue_reduce_scatter,
)
from ragged_placement.fsdp.common import CommStats, Registration, UnitOptions, UnitState
from ragged_placement.fsdp.grads import FlatGrads
from ragged_placement.fsdp.mesh import ParamRefresh, PostForwardMesh, UnitMesh
from ragged_placement.fsdp.param import ParamLayout, ParamSlot
from ragged_placement.planner.plan import Segment

__all__ = ["FSDPUnit"]


def _by_dtype(params: list[torch.Tensor]) -> list[list[int]]:
    """The parameters' indices grouped by dtype, in order of first appearance."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault(p.dtype, []).append(i)
    return list(groups.values())


def _out_bytes(gathers: list[Gather]) -> int:
    return sum(g.output.numel() * g.output.element_size() for g in gathers)


class FSDPUnit:
    """One ``fully_shard`` unit: a :class:`~ragged_placement.fsdp.buffer.FlatBuffer` per
    parameter dtype, one coalesced all-gather per pass and one reduce-scatter per backward for
    all of them, the unit's :class:`~ragged_placement.fsdp.common.UnitState` and its
    :class:`~ragged_placement.fsdp.common.CommStats`.

    The buffers are in order of the dtypes' first appearance; a unit whose parameters all
    belong to inner units (a root container) has none and issues no collectives.

    Args:
        slots: the parameters this unit owns, in module order (deduplicated by identity).
        params: the original parameters, parallel to ``slots``. On the meta device they are
            not copied (the unit stays on the meta device until ``to_empty``).
        dp: the unit's mesh (:class:`~ragged_placement.fsdp.mesh.UnitMesh`: FSDP or HSDP, or a
            ``state_sharding``'s), which the buffers plan over and communicate on. Parameters
            may be DTensors on a tensor-parallel sibling mesh, see
            :mod:`ragged_placement.fsdp.param`.
        options: the unit's settings (dtypes, granularity, FP8, CPU offload).
    """

    slots: list[ParamSlot]
    mesh: DeviceMesh  # the user's data-parallel mesh
    dp: UnitMesh
    rank: int
    world_size: int
    buffers: list[FlatBuffer]
    stats: CommStats
    state: UnitState
    # FSDPModule.set_gradient_divide_factor; None: the data-parallel world size
    gradient_divide_factor: float | None
    # FSDPModule.set_all_reduce_hook: called on each buffer's reduced (summed) gradient shard
    all_reduce_hook: Callable[[torch.Tensor], None] | None
    all_reduce_hook_stream: torch.Stream | None  # the stream it runs on (None: the current one)
    # FSDPModule.set_custom_all_gather / set_custom_reduce_scatter: run in place of c10d's
    custom_all_gather: Callable | None
    custom_reduce_scatter: Callable | None
    # FSDPModule.set_requires_all_reduce(False) (HSDP): the reduce-scatter outputs summed per
    # buffer without the all-reduce over the replicas, added before the next one that runs
    requires_all_reduce: bool
    unreplicated_grads: list[torch.Tensor | None]
    _where: list[tuple[int, int]]  # slot index -> (buffer, index in the buffer)
    _empty_device: torch.device  # the device of a unit without buffers
    _post_forward: PostForwardMesh | None  # set in SHARDED_POST_FORWARD
    _ag_work: object | None  # the all-gather in flight (UNSHARDING)
    _ag_sends: list[torch.Tensor] | None  # its cast send buffers, alive until it is waited on
    # the all-gather of the common path with its views built once (FixedAllGather), decided at
    # the first unshard (None: the unit does not take it) and again after a move or cast
    _fixed_gather: FixedAllGather | None
    _fixed_decided: bool
    # the reduce-scatter of the steady state with its views built once (FixedReduceScatter),
    # from the last reduction issued through c10d's (None: none yet, or not coalesced)
    _fixed_reduce: FixedReduceScatter | None
    _rs_work: object | None  # the reduce-scatter in flight, until start_rest
    # per buffer index, what finishes its reduction once start_rest issued the rest of it
    _rest: list[tuple[int, Callable[[], torch.Tensor | None]]]
    refresh: ParamRefresh  # what runs before each unshard (the mesh's: UnitMesh.param_refresh)
    # the parameters in slot order (the buffers keep the same objects through moves and casts)
    _sharded_params: list[nn.Parameter]
    _requires_grad: list[bool]  # the slots' requires_grad, as sync_requires_grad last took it
    _unsharded_params: list[nn.Parameter]
    # the ranks' agreement on unused gradients, carried by the reduce-scatter (see
    # reduce_grads): per slot, how many data-parallel ranks used it since the last agreement
    # (None: not carried, or not over every data-parallel rank yet)
    used_counts: torch.Tensor | None
    _counts_pending: torch.Tensor | None  # summed over the shard ranks, not the replicas yet
    # (group, dtype, device) -> the agreement's reduce-scatter part where every slot was used
    _agreement: tuple[tuple, Reduction] | None

    def __init__(self, slots: list[ParamSlot], params: list[nn.Parameter], dp: UnitMesh,
                 options: UnitOptions) -> None:
        self.slots = slots
        self.dp, self.mesh = dp, dp.source
        self.refresh = dp.param_refresh(self)
        self.rank = self.dp.shard_rank
        self.world_size = self.dp.shard_size
        self.stats = CommStats()
        self.state = UnitState.SHARDED
        self.gradient_divide_factor = None
        self.all_reduce_hook = None
        self.all_reduce_hook_stream = None
        self.custom_all_gather = self.custom_reduce_scatter = None
        self.requires_all_reduce = True
        self._empty_device = torch.device(self.mesh.device_type)
        self._post_forward = None
        self._ag_work = self._ag_sends = None
        self._fixed_gather, self._fixed_decided = None, False
        self._fixed_reduce = None
        self._rs_work = None
        self._rest = []
        options.gathers.check_unit(slots, params)
        groups = _by_dtype(params)
        self.buffers = [
            FlatBuffer(
                [slots[i] for i in idx], [params[i] for i in idx], self.dp, options, self.stats
            )
            for idx in groups
        ]
        self.unreplicated_grads = [None] * len(self.buffers)
        self._where = [(0, 0)] * len(slots)
        for k, idx in enumerate(groups):
            for j, i in enumerate(idx):
                self._where[i] = (k, j)
        self.used_counts = self._counts_pending = None
        self._agreement = None
        self._sharded_params = self._in_slot_order("sharded_params")
        self._unsharded_params = self._in_slot_order("unsharded_params")
        self._requires_grad = [slot.requires_grad for slot in slots]

    # -- what the hooks, the API and the checkpoint code read, in slot order ------------------
    def _in_slot_order(self, attr: str) -> list:
        return [getattr(self.buffers[k], attr)[j] for k, j in self._where]

    @property
    def sharded_params(self) -> list[nn.Parameter]:
        """The sharded parameters in slot order (the same objects for the unit's life)."""
        return self._sharded_params

    @property
    def unsharded_params(self) -> list[nn.Parameter]:
        """The unsharded parameters in slot order (the same objects for the unit's life)."""
        return self._unsharded_params

    def slot_grads(self, index: int) -> tuple[FlatGrads, int]:
        """The gradients of slot ``index``'s buffer and the slot's index in that buffer."""
        k, j = self._where[index]
        return self.buffers[k].grads, j

    @property
    def layouts(self) -> list[ParamLayout]:
        return self._in_slot_order("layouts")

    @property
    def specs(self) -> list[DTensorSpec]:
        return self._in_slot_order("specs")

    @property
    def device(self) -> torch.device:
        """The compute device (the mesh's under CPU offload; meta before ``to_empty``)."""
        return self.buffers[0].device if self.buffers else self._empty_device

    @property
    def has_unsharded_grads(self) -> bool:
        """Whether backward has produced gradients that are not reduced yet."""
        return any(b.grads.pending for b in self.buffers)

    # -- parameters ----------------------------------------------------------------------------
    def register(self, how: Registration) -> None:
        """Point every owning module at the sharded or the unsharded parameters, as ``how``
        says (:class:`~ragged_placement.fsdp.common.Registration`; a no-op where ``how`` is
        registered already: a unit registers at every pass boundary)."""
        if self.registration is how:
            return
        for b in self.buffers:
            b.register(how)

    @property
    def registration(self) -> Registration | None:
        """What the owning modules give for the parameters now (``None`` while
        :meth:`unregistered` hides them)."""
        return self.buffers[0].registration if self.buffers else Registration.SHARDED

    @contextlib.contextmanager
    def unregistered(self) -> Iterator[None]:
        """Hide the unit's parameters from their modules (so that ``nn.Module._apply`` does not
        map them one by one); the sharded ones are registered again on exit."""
        self.reshard()
        for b in self.buffers:
            b.unregister()
        try:
            yield
        finally:
            self.register(Registration.SHARDED)

    def apply_(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Map the sharded parameters (and their gradients) through ``fn`` buffer by buffer
        (:meth:`FlatBuffer.apply_`), after resharding.

        Raises ``ValueError`` as :meth:`FlatBuffer.apply_` does, or if gradients accumulated
        without sync are pending."""
        self.reshard()
        self.refresh.wait()
        for b in self.buffers:
            if b.grads.pending or b.grads.reducing:
                raise ValueError(
                    f"cannot move or cast the unit holding {b.slots[0].fqn} while gradients "
                    f"accumulated with set_requires_gradient_sync(False) are pending: call "
                    f"reduce_gradients() or run a backward with sync on first"
                )
            b.apply_(fn)
        self._fixed_gather, self._fixed_decided = None, False  # new chunks and gathers
        self._fixed_reduce = None  # new gradient buffers
        self.refresh.mark_stale()

    # -- all-gather ------------------------------------------------------------------------------
    def unshard(self, *, async_op: bool) -> None:
        """Issue one coalesced all-gather for every buffer (no-op unless sharded): from the
        sharded chunks, or over the post-forward group from the post-forward shards."""
        if self.state not in (UnitState.SHARDED, UnitState.SHARDED_POST_FORWARD):
            return
        if self.buffers and self.refresh.before_unshard():
            self.state = UnitState.UNSHARDED  # the refresh filled the buffers
        elif self.buffers:
            pf = self._post_forward if self.state is UnitState.SHARDED_POST_FORWARD else None
            plain = pf is None and self.custom_all_gather is None
            if plain and self._fixed_gather is not None:
                self._ag_work, self._ag_sends = self._fixed_gather.issue(self.stats)
            else:
                gathers = [b.prepare_unshard(pf) for b in self.buffers]
                self._ag_work = issue_all_gather(gathers, self.stats, self.custom_all_gather)
                self.dp.count(self.stats, "all_gather", "params", _out_bytes(gathers))
                if plain and not self._fixed_decided:
                    self._fixed_gather = self.dp.fixed_all_gather(self.buffers, gathers)
                    self._fixed_decided = True
            self.state = UnitState.UNSHARDING
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        """Wait for an issued all-gather; afterwards the unsharded parameters hold the full
        values."""
        if self.state is UnitState.UNSHARDING:
            self._ag_work.wait()
            self._ag_work = self._ag_sends = None
            for b in self.buffers:
                b.finish_unshard()
            self._post_forward = None
            self.state = UnitState.UNSHARDED

    def expose_sharded(self, how: Registration) -> None:
        """Register the sharded parameters (``how``: alone, or showing the unsharded ones to
        attribute reads), keeping the gathered buffers as they are (a unit holding its
        all-gather between its forward and its backward), once CPU-offload staging copies
        still reading the host chunks have finished."""
        for b in self.buffers:
            b.staging.wait_to_device()
        self.register(how)

    def reshard(self) -> None:
        """Register the sharded parameters and free the unsharded buffers' storage (or the
        post-forward shards)."""
        if self.state is UnitState.SHARDED and self.registration is Registration.SHARDED:
            return  # nothing gathered since the last reshard, so no staging copy in flight
        self.wait_unshard()
        self.expose_sharded(Registration.SHARDED)
        if self.state is UnitState.UNSHARDED:
            for b in self.buffers:
                b.free_unsharded()
        elif self.state is UnitState.SHARDED_POST_FORWARD:
            for b in self.buffers:
                b.post_forward_shard = None
            self._post_forward = None
        self.state = UnitState.SHARDED

    def reshard_post_forward(self, pf: PostForwardMesh) -> None:
        """Keep this rank's place of each gathered buffer (``1/N`` of it, one copy), then
        :meth:`reshard` into ``SHARDED_POST_FORWARD``: the next :meth:`unshard` all-gathers over
        ``pf.group`` from it (FSDP2's ``to_sharded_post_forward``). A unit that is not unsharded
        only reshards."""
        self.wait_unshard()
        if self.state is not UnitState.UNSHARDED or not self.buffers:
            self.reshard()
            return
        kept = [b.post_forward_copy(pf) for b in self.buffers]
        self.reshard()
        for b, shard in zip(self.buffers, kept):
            b.post_forward_shard = shard
        self._post_forward = pf
        self.state = UnitState.SHARDED_POST_FORWARD

    def sync_requires_grad(self) -> list[int]:
        """Take each sharded parameter's ``requires_grad`` (the parameter the user holds, which
        a ``requires_grad_`` after ``fully_shard`` changes) onto its slot and its unsharded
        parameter, as FSDP2 does at every unshard: a frozen parameter gets no gradient (and
        no ``.grad``, so the optimizer leaves it), an unfrozen one trains again. Called at
        every forward; returns the slots that became trainable."""
        now = [p.requires_grad for p in self._sharded_params]
        if now == self._requires_grad:
            return []
        self._requires_grad = now
        trainable = []
        for i, (slot, sharded, unsharded) in enumerate(
            zip(self.slots, self._sharded_params, self._unsharded_params)
        ):
            if sharded.requires_grad != slot.requires_grad:
                slot.requires_grad = sharded.requires_grad
                unsharded.requires_grad_(slot.requires_grad)
                if slot.requires_grad:
                    trainable.append(i)
        return trainable

    # -- gradients -------------------------------------------------------------------------------
    def release_dropped_grads(self) -> None:
        """Free each flat sharded gradient once ``zero_grad()`` dropped every ``.grad`` on it."""
        for b in self.buffers:
            b.grads.release_dropped()

    def accumulate_unreduced_grads(self) -> None:
        """After a backward without gradient sync: accumulate in ``reduce_dtype`` (see
        :meth:`~ragged_placement.fsdp.grads.FlatGrads.accumulate_unreduced`)."""
        for b in self.buffers:
            b.grads.accumulate_unreduced()

    def reduce_grads(self, used: list[bool] | None = None) -> None:
        """Issue one coalesced reduce-scatter (a sum, async) of every buffer with gradients;
        :meth:`finish_reduce` completes it. The unsharded gradient buffers are released here.

        ``used`` (per slot, whether this rank's backwards since the last agreement reached it):
        where :meth:`carries_agreement`, the reduce-scatter carries it as one more part, every
        rank's flags in every rank's chunk (``W x len(slots)`` elements in, ``len(slots)`` out),
        so that each rank receives how many ranks used each parameter (summed over the
        replicas with HSDP's all-reduce) in :attr:`used_counts`: the agreement on unused
        gradients (:func:`~ragged_placement.fsdp.state.drop_unused_grads`) without a
        collective of its own."""
        ready = [b.grads.prepare_reduce() for b in self.buffers if b.grads.pending]
        issued = [r for r in ready if r.output is not None]  # params=(): reduced later
        if issued:
            self.used_counts = self._counts_pending = None
            if used is not None and self.carries_agreement(issued):
                issued.append(self._agreement_part(issued[0], used))
            fixed = self._fixed_reduce
            if fixed is not None and self.custom_reduce_scatter is None and fixed.matches(issued):
                self._rs_work = fixed.issue(self.stats)
            else:
                self._rs_work = issue_reduce_scatter(issued, self.stats,
                                                     self.custom_reduce_scatter)
                fixed = self._fixed_reduce = (FixedReduceScatter.of(issued)
                                              if self._reissued(issued) else None)
            nbytes = fixed.nbytes if fixed is not None else sum(
                g.numel() * g.element_size() for r in issued for g in r.inputs)
            self.dp.count(self.stats, "reduce_scatter", "params", nbytes)
        elif ready:
            self._rs_work = Works([])

    def _reissued(self, issued: list[Reduction]) -> bool:
        """Whether the next backward hands over the same ``issued`` objects again (so that a
        :class:`FixedReduceScatter` of them pays): c10d's reduce-scatter, and each reduction
        either a buffer's steady one or the agreement's part where every slot was used."""
        if self.custom_reduce_scatter is not None:
            return False
        again = [b.grads.steady for b in self.buffers]
        if self._agreement is not None:
            again.append(self._agreement[1])
        return all(any(r is x for x in again) for r in issued)

    def carries_agreement(self, issued: list[Reduction]) -> bool:
        """Whether this unit's reduce-scatter of ``issued`` carries the agreement on unused
        gradients: where the mesh :attr:`~UnitMesh.reduces_over_all_ranks` (FSDP and HSDP of
        more than one shard rank; not a ``state_sharding``'s), with c10d's reduce-scatter (not
        a custom one), and the backend runs the unit's parts as one coalesced collective (not
        gloo's sums, which run each part as an all-to-all)."""
        return (self.dp.reduces_over_all_ranks and self.custom_reduce_scatter is None
                and coalesces_requests(issued, issued[0].group, all_gathers=False))

    def _agreement_part(self, first: Reduction, used: list[bool]) -> Reduction:
        """The reduce-scatter part carrying ``used``: ``[W, len(slots)]`` rows of this rank's
        flags in, this rank's ``len(slots)`` sums out, in ``first``'s dtype (exact: sums of
        zeros and ones stay zero only where every rank gave zero). Built once per group, dtype
        and device: the output (read once per backward, written by each reduce-scatter) and
        the part where every parameter was used (a dense model's every step)."""
        out, world_size, group = first.output, first.world_size, first.group
        key = (world_size, group, out.dtype, out.device)
        if self._agreement is None or self._agreement[0] != key:
            n = len(used)
            ones = torch.ones(world_size * n, dtype=out.dtype, device=out.device)
            part = Reduction(out.new_empty(n), [ones], [Segment(0, 0, n)], world_size, group)
            self._agreement = (key, part)
        part = self._agreement[1]
        self._counts_pending = part.output
        if all(used):
            return part
        flags = torch.tensor(used, dtype=out.dtype, device=out.device)
        return Reduction(part.output, [flags.expand(world_size, len(used)).reshape(-1)],
                         part.segments, world_size, group)

    def start_rest(self) -> bool:
        """Wait for the reduce-scatter and issue what follows it in each buffer's
        communication (:meth:`~ragged_placement.fsdp.mesh.BufferComm.start_rest`: under a
        ``state_sharding`` the reductions over the dims beyond ``params``, asynchronously);
        :meth:`finish_reduce` completes them. Returns whether any collective is in flight (else
        nothing is left to overlap)."""
        if self._rs_work is not None:
            self._rs_work.wait()
            self._rs_work = None
            for k, b in enumerate(self.buffers):
                reduction = b.grads.take_reduced()
                if reduction is not None:
                    self._rest.append((k, b.comm.start_rest(reduction, self.stats)))
        return any(self.buffers[k].comm.overlaps for k, _ in self._rest)

    def finish_reduce(self, scale: float = 1.0) -> None:
        """Wait for the reduce-scatter (and what :meth:`start_rest` issued after it), sum each
        buffer's over the replicas (HSDP), average (times ``scale``), and land it in the
        sharded gradients."""
        self.start_rest()
        rest, self._rest = self._rest, []
        divisor = self.gradient_divide_factor or self.world_size * self.dp.replicate_size
        for k, finish in rest:
            out = self._sum_replicas(k, finish())
            if out is None:
                continue
            if self.all_reduce_hook is not None:
                self._run_all_reduce_hook(out)
            self.buffers[k].grads.land(out, scale, divisor,
                                       shared=self.all_reduce_hook is not None)

    def _run_all_reduce_hook(self, out: torch.Tensor) -> None:
        """:meth:`FSDPModule.set_all_reduce_hook`'s hook on ``out``, on its stream if one was
        set (ordered after the current stream's work on ``out``, and before what follows)."""
        stream = self.all_reduce_hook_stream
        if stream is None:
            self.all_reduce_hook(out)
            return
        device_module = torch.get_device_module(out.device.type)
        current = device_module.current_stream()
        stream.wait_stream(current)
        with device_module.stream(stream):
            self.all_reduce_hook(out)
        current.wait_stream(stream)

    def _sum_replicas(self, k: int, out: torch.Tensor) -> torch.Tensor | None:
        """HSDP: buffer ``k``'s reduce-scatter output summed over the replicas (``None``: kept
        for a later all-reduce, ``set_requires_all_reduce(False)``); else (no replicas, or the
        mesh summed over them already: :attr:`UnitMesh.replicas_group`) ``out`` itself."""
        group = self.dp.replicas_group
        counts, self._counts_pending = self._counts_pending, None
        if group is None:
            self.used_counts = counts if counts is not None else self.used_counts
            return out
        if self.unreplicated_grads[k] is not None:
            out += self.unreplicated_grads[k]
            self.unreplicated_grads[k] = None
        if not self.requires_all_reduce:
            self.unreplicated_grads[k] = out  # lands after a later all-reduce
            return None  # (the agreement waits for it too: drop_unused_grads)
        tensors = [out] if counts is None else [out, counts]  # one coalesced all-reduce
        collectives._coalesced([lambda a, t=t: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group,
                                                   async_op=a) for t in tensors],
                   group, async_op=False)
        if counts is not None:
            self.used_counts = counts
        self.stats.all_reduces += 1
        self.stats.all_reduce_bytes += sum(t.numel() * t.element_size() for t in tensors)
        return out

    def wait_offload_copies(self) -> None:
        """Block the host until the CPU-offload staging copies are complete."""
        for b in self.buffers:
            b.wait_offload_copies()
