"""Forward/backward hooks of FSDP units and the per-root state that orders them.

Each ``fully_shard`` call owns one :class:`FSDPState`, whose :class:`TrainingState` says where
its unit is in the iteration (as torch FSDP2's ``TrainingState``)::

    IDLE --pre-forward--> FORWARD --post-forward--> IDLE --------pre-backward--> PRE_BACKWARD
      ^                          |                                                 ^   |
      |                          +--post-forward--> POST_FORWARD --pre-backward----+   |
      |                             (keeps the gather)                                 |
      +---- root's final callback <---- POST_BACKWARD <---------post-backward----------+

``POST_FORWARD``: the unit kept its forward's all-gather (or, with an ``int``
``reshard_after_forward``, its post-forward shard) for backward. If no backward follows, the
root's next pre-forward reshards it (POST_FORWARD -> IDLE). The unit's own
:class:`~ragged_placement.fsdp.common.UnitState` says where its parameters are.

Per iteration, for a unit ``u`` (root = the outermost unit, whose forward runs first):

* pre-forward (IDLE -> FORWARD): (root only) reshard units still holding the all-gather of a
  forward that no backward followed (an optimizer may have stepped since), and free the flat
  sharded gradients ``zero_grad()`` dropped; wait for ``u``'s all-gather (issue it if no
  prefetch did), register the unsharded parameters, prefetch the next unit's all-gather (order
  recorded in the previous forward), and wrap the floating inputs that require grad in
  :class:`_PostBackward` so that ``u``'s post-backward runs when autograd has produced the
  gradients of ``u``'s inputs (by then its parameter gradients are accumulated: AccumulateGrad
  nodes run first).
* post-forward (FORWARD -> IDLE, or POST_FORWARD where it keeps the gather): reshard (free the unsharded buffer) unless
  ``reshard_after_forward`` is off or ``u`` is the root (whose parameters backward needs
  first); with a :class:`~ragged_placement.fsdp.mesh.PostForwardMesh` (an ``int``
  ``reshard_after_forward``) keep this rank's ``1/N`` of the gathered buffer first, which
  backward all-gathers over the ``N``-rank group. Registered after forward: the sharded
  parameters (``model.parameters()``, so that an optimizer built now steps them); a unit that
  keeps its gathered buffer (``reshard_after_forward=False``, and the root whatever the
  setting, as FSDP2's) shows its unsharded ones to attribute reads until its backward, for a
  loss computed after forward from them
  (:attr:`~ragged_placement.fsdp.common.Registration.SHARDED_UNSHARDED_ATTRIBUTES`). Hook the
  outputs.
* pre-backward (a hook on ``u``'s outputs; -> PRE_BACKWARD, once per backward of ``u``):
  re-gather, register the unsharded parameters (a recomputed forward reads them from the module)
  and prefetch the all-gather of the unit whose backward runs next (on GPUs). The first gradient
  reaching a parameter of one of ``u``'s plan segments (a hook on each parameter) allocates the
  segment's zeroed flat gradient buffer and presets its parameters' ``.grad`` to views of it, so
  AccumulateGrad adds into it in place.
* post-backward (-> POST_BACKWARD): issue the reduce-scatter (async on GPUs, where the previous
  unit's is finished first, so at most one is in flight; finished at once on CPU), reshard.
* the root queues a callback that runs when autograd finishes: post-backward for units whose
  inputs did not require grad (e.g. the root, fed token ids) and for units a recomputation left
  unsharded, then it waits for the last reduce-scatter; every unit is IDLE and sharded again.

A ``fully_shard([a, b])`` unit has these hooks on each of its modules: the first module of a
pass gathers the unit, records its place in the forward order and wraps its inputs for the
post-backward; the others only make sure the unit is gathered (and cast); the last one to finish
runs the post-forward (as FSDP2's group hooks).

Activation checkpointing (``torch.utils.checkpoint``, selective or not, ``checkpoint_wrapper``
inside or outside ``fully_shard``) re-runs a forward during backward. A forward that runs while
autograd executes a backward (``torch._C._current_graph_task_id() != -1``, FSDP2's ``is_bw()``)
is such a *recomputation*: its pre-forward only makes sure the unit is unsharded and registered
(gathering it if no pre-backward did yet, e.g. a block recomputed as part of a later block's
checkpointed region), and its post-forward reshards nothing (backward is about to use the
parameters; post-backward reshards), records no forward order and prefetches nothing. So a
recomputed unit is gathered once per backward, as without checkpointing. Before the unit's
pre-backward (reentrant checkpointing runs a backward of its own through the recomputed graph)
the recomputation hooks inputs and outputs as a forward does; after it they are in place.

With a checkpointed region around a unit's hooks (``checkpoint(fsdp_block, x, context_fn=...)``)
the hooks' own ops (all-gathers, views of the flat buffers) run outside the region's
selective-checkpointing dispatch modes, which replay ops by per-op call index: the forward
gathers there, the recomputation does not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.distributed.utils import _apply_to_tensors
from torch.utils._pytree import tree_flatten, tree_unflatten

from ragged_placement._compat import outside_selective_checkpoint
from ragged_placement._install import install_pipelining
from ragged_placement.fsdp._dynamo import dynamo_disable, dynamo_skip_frame
from ragged_placement.fsdp._validation import check_no_all_gather_extension, unmatched_patterns
from ragged_placement.fsdp.common import Registration, TrainingState
from ragged_placement.fsdp.grads import FlatGrads
from ragged_placement.fsdp.mesh import PostForwardMesh, any_rank
from ragged_placement.fsdp.nested_refresh import agree_on_refreshes
from ragged_placement.fsdp.unit import FSDPUnit

__all__ = ["FSDPState", "RootContext", "drop_unused_grads"]


def _in_backward() -> bool:
    """Whether autograd is executing a backward on this thread (a forward now recomputes)."""
    return torch._C._current_graph_task_id() != -1


_NO_MODES = contextlib.nullcontext()


def _hook_ops():
    """The context of the hooks' own tensor ops: outside selective checkpointing's dispatch
    modes (:func:`~ragged_placement._compat.outside_selective_checkpoint`) where any dispatch
    mode is active, else nothing to leave."""
    return outside_selective_checkpoint() if torch._C._len_torch_dispatch_stack() else _NO_MODES


class RootContext:
    """What the root unit shares with the units below it during one iteration."""

    def __init__(self, states: list[FSDPState]) -> None:
        self.states = states  # root first, then the others in module order
        self.forward_order: list[FSDPState] = []  # non-root units, last forward's order
        self._position: dict[int, int] = {}  # id(state) -> its index in forward_order
        self._recording: list[FSDPState] = []
        self.pending_reduce: FSDPUnit | None = None
        self.callback_queued = False
        self.post_optim_event: torch.Event | None = None  # FSDPModule.set_post_optim_event

    def prefetch_after(self, state: FSDPState, *, backward: bool) -> None:
        """Prefetch what follows ``state``'s unshard: the units its
        ``set_modules_to_{forward,backward}_prefetch`` named, in that order (on every device,
        as FSDP2), else the next unit of the recorded order."""
        explicit = state.backward_prefetch if backward else state.forward_prefetch
        if explicit is not None:
            for target in explicit:
                target.unit.unshard(async_op=True)
        elif backward:
            self.prefetch(self.next_in_backward(state), backward=True)
        else:
            self.prefetch(self.next_in_forward(state))

    @staticmethod
    def prefetch(state: FSDPState | None, *, backward: bool = False) -> None:
        """Issue ``state``'s all-gather (asynchronously) ahead of its use.

        Not in backward on CPU: there gloo would stage an asynchronous all-gather through an
        extra output-sized buffer alive until ``wait()``, on top of the gradient buffer at the
        backward peak, and a synchronous gather issued early overlaps nothing while holding the
        unit's parameters through the previous unit's backward. The unit gathers in its own
        pre-backward instead, at the same cost in time. NCCL has no staging buffer: GPUs
        prefetch in both passes.
        """
        if state is None:
            return
        unit = state.unit
        if backward and unit.device.type == "cpu":
            return
        unit.unshard(async_op=True)

    def start_forward(self) -> None:
        """The root's forward begins: record the order of the units' forwards afresh."""
        self.finish_pending_reduce()
        self._recording = []

    def record_forward(self, state: FSDPState) -> None:
        self._recording.append(state)

    def end_forward(self) -> None:
        """The root's forward ended: its recording is the order used to prefetch."""
        self.forward_order = self._recording
        # a unit run twice in a forward (a head called per chunk) prefetches from its first run
        self._position = {id(s): i for i, s in reversed(list(enumerate(self.forward_order)))}
        self._recording = []  # a unit run on its own later must not extend forward_order

    def reset(self) -> None:
        """After an exception cut a forward or backward short: finish the reduce-scatter in
        flight (its gradients land), drop the gradients not reduced yet (or not all-reduced
        over HSDP's replicas), reshard every unit and clear the per-iteration state, so the
        next iteration runs as the first."""
        self.finish_pending_reduce()
        for s in self.states:
            for buffer in s.unit.buffers:
                buffer.grads.drop_unreduced()
            s.unit.unreplicated_grads = [None] * len(s.unit.buffers)
            s.unit.reshard()
            s.training_state = TrainingState.IDLE
            s._to_run.clear()
            s.got_grad, s.had_grad = set(), None
            s.unit.used_counts = None
        self._recording = []
        self.callback_queued = False

    def finish_pending_reduce(self) -> None:
        if self.pending_reduce is not None:
            self.pending_reduce.finish_reduce()
            self.pending_reduce = None

    def next_in_forward(self, state: FSDPState) -> FSDPState | None:
        if state.is_root:
            return self.forward_order[0] if self.forward_order else None
        i = self._position.get(id(state))  # its first place, as list.index would find
        order = self.forward_order
        return order[i + 1] if i is not None and i + 1 < len(order) else None

    def next_in_backward(self, state: FSDPState) -> FSDPState | None:
        # The root's pre-backward runs at the loss, when activations peak: prefetching there
        # would add a unit's parameters to the peak, so the last unit gathers on its own hook.
        i = self._position.get(id(state))
        return self.forward_order[i - 1] if i else None


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward triggers the unit's post-backward."""

    @staticmethod
    def forward(ctx, state: FSDPState, *inputs: torch.Tensor):
        ctx.state = state
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.state.post_backward()
        return (None, *grads)


def _grad_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors that require grad in a module's output: in lists, tuples (named too), dicts
    and dataclasses (a block returning a dataclass, which ``tree_flatten`` leaves whole), as
    FSDP2 finds them."""
    if torch.is_tensor(output):
        return [output] if output.requires_grad else []
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        items = [getattr(output, f.name) for f in dataclasses.fields(output)]
    elif isinstance(output, dict):
        items = list(output.values())
    elif isinstance(output, (list, tuple)):
        items = list(output)
    else:
        return []
    return [t for item in items for t in _grad_tensors(item)]


def _cast_float_tensors(dtype: torch.dtype, tree: Any) -> Any:
    """``tree`` with its floating-point tensors cast to ``dtype``, found as FSDP2 finds them
    (torch's ``_apply_to_tensors``: lists, tuples, named tuples, dicts, dataclasses, ...)."""

    def cast(x: torch.Tensor) -> torch.Tensor:
        return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x

    return _apply_to_tensors(cast, tree)


class FSDPState:
    """The hooks and the :class:`TrainingState` of one ``fully_shard`` call.

    ``reshard_after_forward``: ``True`` (free the unsharded parameters after forward),
    ``False`` (keep them until backward) or a :class:`PostForwardMesh` (keep a ``1/N`` shard of
    them over its ``N``-rank groups)."""

    def __init__(
        self,
        module: nn.Module | Sequence[nn.Module],
        unit: FSDPUnit,
        reshard_after_forward: bool | PostForwardMesh,
        mp_policy,
    ) -> None:
        # ``fully_shard([a, b])``: one unit, hooks on every module of the group (_first_in_pass)
        self.modules = list(module) if isinstance(module, (list, tuple)) else [module]
        self.module = self.modules[0]
        self._to_run: set[int] = set()  # ids of the group's modules yet to run in this pass
        self.unit = unit
        self.reshard_after_forward = reshard_after_forward
        self.mp_policy = mp_policy
        self.requires_gradient_sync = True
        # patterns of the ``granularity`` mapping that matched no parameter of this unit's tree
        # (checked against the root's tree at its lazy init)
        self.unmatched_granularity: set[str] = set()
        # slots that got a gradient since the last reduce-scatter, and whether each sharded
        # parameter had a ``.grad`` before it (see :func:`drop_unused_grads`)
        self.got_grad: set[int] = set()
        self.had_grad: list[bool] | None = None
        # FSDPModule.set_reduce_scatter_unused_params(True): unused parameters keep their zero
        # reduced gradients, as FSDP2's (no agreement needed)
        self.keep_unused_grads = False
        # FSDPModule.set_modules_to_{forward,backward}_prefetch; None: the recorded order
        self.reshard_after_backward = True  # FSDPModule.set_reshard_after_backward
        self.unshard_in_backward = True  # FSDPModule.set_unshard_in_backward
        self.forward_prefetch: list[FSDPState] | None = None
        self.backward_prefetch: list[FSDPState] | None = None
        self.root: RootContext | None = None
        self.is_root = False
        self.training_state = TrainingState.IDLE
        # what the hooks read at every call, decided once: the forward-input cast, the bound
        # pre-backward hook
        mp = mp_policy
        self._input_dtype = mp.param_dtype if mp.cast_forward_inputs else None
        self._pre_backward_hook = self._pre_backward
        # bound once: _on_grad (a frame Dynamo skips) calls them with no descriptor frame of
        # their own, which Dynamo would be handed where a compiled function runs the backward
        self._prepare_grads_bound = self._prepare_grads
        self._rank_grad_bound = self._rank_grad
        for m in self.modules:
            m.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
        # per slot: its buffer's gradients, its index there and its plan segment (_on_grad)
        self._grad_slots = []
        for i in range(len(unit.slots)):
            grads, j = unit.slot_grads(i)
            self._grad_slots.append((grads, j, grads.segment_of[j]))
        self._spmd = unit.buffers[0].spmd if unit.buffers else None
        self._grad_hooked: set[int] = set()  # slots whose unsharded parameter has _on_grad
        self._hook_grads([i for i, slot in enumerate(unit.slots) if slot.requires_grad])
        for m in self.modules:
            m.register_forward_hook(self._post_forward, prepend=False)
            m.register_state_dict_pre_hook(self.release_kept)

    def _hook_grads(self, indices: list[int]) -> None:
        """Register :meth:`_on_grad` on the unsharded parameters of the slots ``indices`` (at
        wrap time the trainable ones, later those unfrozen), once per slot."""
        params = self.unit.unsharded_params
        on_grad = type(self)._on_grad  # the disabled function itself, called with (self, i)
        for i in indices:
            if i not in self._grad_hooked:
                params[i].register_hook(functools.partial(on_grad, self, i))
                self._grad_hooked.add(i)

    # -- lazy root init ----------------------------------------------------------------------
    def _lazy_init(self) -> None:
        states = [self]
        for top in self.modules:
            for m in top.modules():
                s = getattr(m, "_fsdp_state", None)
                if s is not None and all(s is not t for t in states):
                    states.append(s)
        pending = set().union(*(s.unmatched_granularity for s in states))
        typos = unmatched_patterns(dict.fromkeys(pending), self.modules)
        if typos:
            raise ValueError(
                f"granularity: the pattern(s) {sorted(typos)} match no parameter of "
                f"{type(self.module).__name__} (names relative to any of its modules)"
            )
        for s in states:
            check_no_all_gather_extension(
                [slot.fqn for slot in s.unit.slots],
                [getattr(p, "_local_tensor", p) for p in s.unit.sharded_params],
                type(s.module).__name__,
            )
        ctx = RootContext(states)
        for s in states:
            s.root = ctx
            s.is_root = s is self

    # -- forward -------------------------------------------------------------------------------
    @dynamo_disable
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        if self.root is None:
            self._lazy_init()
        if _in_backward():
            return self._pre_forward_recompute(args, kwargs)
        ctx = self.root
        first = self._first_in_pass(module)
        with _hook_ops():
            if self.is_root and first:
                install_pipelining()  # a pipeline stage's split backward follows (_install)
                if ctx.post_optim_event is not None:  # the gathers below run on this stream
                    ctx.post_optim_event.wait()
                    ctx.post_optim_event = None
                ctx.start_forward()
                agree_on_refreshes([s.unit for s in ctx.states])
                for s in ctx.states:
                    s.drop_stale_gather()
                    s.unit.release_dropped_grads()
                    if s is not self:
                        s._to_run.clear()  # a pass an exception cut short must not gate this one
            elif first:
                ctx.record_forward(self)
            # after the root dropped stale gathers (its own POST_FORWARD included)
            self.training_state = TrainingState.FORWARD
            # requires_grad_ after fully_shard: what this forward records (FSDP2: each unshard)
            self._hook_grads(self.unit.sync_requires_grad())
            self._unshard_and_register()
            if first:
                ctx.prefetch_after(self, backward=False)
        args, kwargs = self._cast_inputs(args, kwargs)
        if torch.is_grad_enabled() and first:
            args, kwargs = self._wrap_inputs_for_post_backward(args, kwargs)
        return args, kwargs

    def _first_in_pass(self, module: nn.Module) -> bool:
        """Whether ``module``'s pre-forward starts a pass over the unit's modules (always, for
        one module). A group's first module to run records the unit's place in the forward
        order, prefetches the next unit and wraps its inputs for the post-backward (as FSDP2:
        when the group runs in sequence, its first module's input gradients come after all of
        the group's backwards); the last module to finish runs the post-forward. A module that
        already ran in the pass (a head called per chunk) starts a new one, which reduces its
        gradients on its own, as FSDP2 does."""
        if id(module) in self._to_run:
            return False
        self._to_run = {id(m) for m in self.modules}
        return True

    def _pre_forward_recompute(self, args: tuple, kwargs: dict):
        """Pre-forward of a forward recomputed in backward: unshard if needed, register."""
        with _hook_ops():
            self._unshard_and_register()  # a no-op after this unit's pre-backward
        args, kwargs = self._cast_inputs(args, kwargs)
        if self._expects_nested_backward():
            args, kwargs = self._wrap_inputs_for_post_backward(args, kwargs)
        return args, kwargs

    def _expects_nested_backward(self) -> bool:
        """Whether a recomputed forward's own graph may be backwarded (reentrant checkpointing
        runs backward through it; non-reentrant discards it): then it gets the pre- and
        post-backward hooks a forward gets. After this unit's pre-backward they are in place."""
        return torch.is_grad_enabled() and self.training_state is not TrainingState.PRE_BACKWARD

    def drop_stale_gather(self) -> None:
        """Reshard a unit still holding the all-gather (or the post-forward shard) of a forward
        no backward followed: an optimizer may have stepped its sharded parameters since
        (in-place updates of DTensor parameters leave no trace on the flat buffer's version
        counter)."""
        if self.training_state is TrainingState.POST_FORWARD:
            self.unit.reshard()
            self.training_state = TrainingState.IDLE

    def release_kept(self, *args) -> None:
        """Register the sharded parameters alone, outside the unit's own forward and backward:
        for a ``state_dict()`` (FSDP2's state-dict pre-hook reshards), and after an optimizer
        step on them (:mod:`~ragged_placement.fsdp.unsharded_guard`: unsharded ones registered
        by ``FSDPModule.unshard()`` are stale then). The gathered buffer is kept; the unit's
        next forward or backward registers the unsharded parameters again."""
        del args
        if (self.training_state not in (TrainingState.FORWARD, TrainingState.PRE_BACKWARD)
                and self.unit.registration is not Registration.SHARDED):
            self.unit.expose_sharded(Registration.SHARDED)

    def _unshard_and_register(self) -> None:
        self.unit.unshard(async_op=False)
        self.unit.wait_unshard()
        self.unit.register(Registration.UNSHARDED)

    def _cast_inputs(self, args: tuple, kwargs: dict):
        if self._input_dtype is not None:
            args, kwargs = _cast_float_tensors(self._input_dtype, (args, kwargs))
        return args, kwargs

    def _cast_output(self, output: Any) -> Any:
        if self.mp_policy.output_dtype is not None:
            output = _cast_float_tensors(self.mp_policy.output_dtype, output)
        return output

    def _wrap_inputs_for_post_backward(self, args: tuple, kwargs: dict):
        if not kwargs and all(type(a) is torch.Tensor for a in args):  # the common call
            idx = [i for i, a in enumerate(args) if a.requires_grad]
            if not idx:
                return args, kwargs
            with _hook_ops():
                wrapped = _PostBackward.apply(self, *(args[i] for i in idx))
            out = list(args)
            for i, t in zip(idx, wrapped):
                out[i] = t
            return tuple(out), kwargs
        leaves, spec = tree_flatten((args, kwargs))
        idx = [i for i, x in enumerate(leaves) if torch.is_tensor(x) and x.requires_grad]
        if not idx:
            return args, kwargs
        with _hook_ops():
            wrapped = _PostBackward.apply(self, *(leaves[i] for i in idx))
        for i, t in zip(idx, wrapped):
            leaves[i] = t
        return tree_unflatten(leaves, spec)

    @dynamo_disable
    def _post_forward(self, module: nn.Module, args: tuple, output: Any):
        if _in_backward():
            # A recomputation: backward is about to use the parameters; post-backward (or the
            # root's final callback) reshards.
            if self._expects_nested_backward():
                self._register_pre_backward(output)
            return self._cast_output(output)
        grad = torch.is_grad_enabled()
        self._to_run.discard(id(module))
        if self._to_run:  # more of the group's modules to run: keep the unit gathered
            if grad:
                self._register_pre_backward(output)
            return self._cast_output(output)
        if self.is_root:
            self.root.end_forward()
        raf = self.reshard_after_forward
        state = TrainingState.POST_FORWARD
        with _hook_ops():
            if grad and isinstance(raf, PostForwardMesh) and not self.is_root:
                self.unit.reshard_post_forward(raf)  # sharded parameters registered
            elif not grad or (raf and not self.is_root):
                self.unit.reshard()
                state = TrainingState.IDLE
            else:
                # Keep the gathered buffer for backward (reshard_after_forward=False, or the
                # root); parameters() gives the sharded parameters (an optimizer built now
                # steps them), attribute reads the unsharded ones (a loss computed from them
                # after forward); pre-backward registers the unsharded ones again.
                self.unit.expose_sharded(Registration.SHARDED_UNSHARDED_ATTRIBUTES)
        if grad:
            self._register_pre_backward(output)
        self.training_state = state
        return self._cast_output(output)

    def _register_pre_backward(self, output: Any) -> None:
        for t in _grad_tensors(output):
            t.register_hook(self._pre_backward_hook)

    # -- backward ------------------------------------------------------------------------------
    @dynamo_disable
    def _pre_backward(self, grad: torch.Tensor) -> None:
        if self.training_state is TrainingState.PRE_BACKWARD:
            return  # another output of this unit got its gradient first
        self.training_state = TrainingState.PRE_BACKWARD
        ctx = self.root
        if not ctx.callback_queued:
            ctx.callback_queued = True
            Variable._execution_engine.queue_callback(self._root_final_callback)
        if self.unshard_in_backward:
            self._unshard_and_register()
        ctx.prefetch_after(self, backward=True)

    @dynamo_skip_frame
    def _on_grad(self, index: int, grad: torch.Tensor) -> torch.Tensor | None:
        # Runs before AccumulateGrad of unsharded parameter ``index``. A segment's gradient
        # buffer is allocated at its first gradient, not at pre-backward, where it would sit on
        # the activation peak; the segment's other parameters find it allocated. (A skipped
        # frame: its Python calls go through methods under dynamo_disable.)
        self.got_grad.add(index)
        grads, j, segment = self._grad_slots[index]
        if grads.unsharded[segment] is None:
            self._prepare_grads_bound(grads, j)
        return None if self._spmd is None else self._rank_grad_bound(grad)

    @dynamo_disable
    def _prepare_grads(self, grads: FlatGrads, index: int) -> None:
        grads.prepare(index)

    @dynamo_disable
    def _rank_grad(self, grad: torch.Tensor) -> torch.Tensor | None:
        return self._spmd.rank_grad(grad)  # fully_shard(dp_mesh_dims=...): every buffer's

    def _used(self) -> list[bool]:
        """Per slot, whether this rank's backwards since the last agreement reached it (what
        the reduce-scatter carries for :func:`drop_unused_grads`)."""
        got = self.got_grad
        return [i in got for i in range(len(self.unit.slots))]

    def note_reduce(self) -> None:
        """Called before the unit's reduce-scatter: which sharded parameters had a ``.grad``."""
        if self.had_grad is None:
            self.had_grad = [p.grad is not None for p in self.unit.sharded_params]

    @dynamo_disable
    def post_backward(self) -> None:
        """Reduce-scatter this unit's gradients (unless gradient sync is off) and reshard.

        Runs for every backward through the unit's inputs, so schedules that run several
        forwards before their backwards (pipeline parallel micro-batches) reduce every
        micro-batch's gradients; a second call without new gradients only reshards."""
        unit = self.unit
        if unit.has_unsharded_grads and self.requires_gradient_sync:
            self.root.finish_pending_reduce()
            self.note_reduce()
            unit.reduce_grads(None if self.keep_unused_grads else self._used())
            if unit.device.type != "cpu":
                self.root.pending_reduce = unit
            elif unit.start_rest():
                # a state_sharding's reductions beyond `params` (across nodes, where `params`
                # is a node) are in flight: the next unit's backward overlaps them
                self.root.pending_reduce = unit
            else:
                # gloo stages the reduce-scatter in buffers of its own, alive with the input
                # until wait(): on CPU, where the overlap buys little, finishing it here frees
                # them before the next unit's backward (FSDP2 is synchronous on CPU too)
                unit.finish_reduce()
        elif unit.has_unsharded_grads:  # micro-batches accumulate in reduce_dtype, as FSDP2
            unit.accumulate_unreduced_grads()
        if self.reshard_after_backward:
            unit.reshard()
        else:  # FSDPModule.set_reshard_after_backward(False): the next forward reuses it
            unit.expose_sharded(Registration.SHARDED_UNSHARDED_ATTRIBUTES)
        self.training_state = TrainingState.POST_BACKWARD

    @dynamo_disable
    def _root_final_callback(self) -> None:
        ctx = self.root
        for s in reversed(ctx.states):
            s.post_backward()
            s.training_state = TrainingState.IDLE
        ctx.finish_pending_reduce()
        for s in ctx.states:  # CPU offload: the optimizer reads the host gradients next
            s.unit.wait_offload_copies()
        drop_unused_grads(ctx.states)
        ctx.callback_queued = False


def drop_unused_grads(states: Sequence[FSDPState]) -> None:
    """After the reduce-scatters: ``.grad = None`` for the parameters that no rank's backward
    reached since the previous reduce-scatter and that had no ``.grad`` before it, as FSDP2
    (and one process) leave them, so that the optimizer skips them (AdamW's weight decay does
    not move them). A parameter some rank used (rank-dependent routing) keeps its reduced
    gradient on every rank.

    A rank cannot know that no other rank used a parameter without hearing from each of them,
    and the reduce-scatter delivers a parameter's sum only to the ranks holding part of it
    (ragged shards leave others with none). The unit's reduce-scatter carries each rank's
    flags (:meth:`~ragged_placement.fsdp.unit.FSDPUnit.reduce_grads`: ``W`` times one element
    per parameter, in the same coalesced collective, and HSDP's all-reduce over the replicas
    sums them too), so the ranks agree with no collective of their own; the host reads the
    counts of all units at the end of backward, at once (on GPUs: a device sync there). Where
    the reduce-scatter cannot carry them (gloo, whose reduce-scatter runs each part as an
    all-to-all; a ``state_sharding``; a custom reduce-scatter; ``reduce_gradients()``), ranks
    agree by one all-reduce (max) of one byte per parameter of those units, per distinct
    data-parallel group, per synchronizing backward, at its end.
    ``FSDPModule.set_reduce_scatter_unused_params(True)`` keeps the zero gradients, as FSDP2
    does with it, and needs no agreement."""
    by_group: dict[tuple, list[FSDPState]] = {}
    carried: list[FSDPState] = []
    for s in states:
        if (s.had_grad is not None and not s.unit.requires_all_reduce
                and s.unit.dp.replicas_group is not None):
            continue  # nothing landed: decided at the backward whose all-reduce lands it
        if s.had_grad is not None and s.keep_unused_grads:
            s.got_grad, s.had_grad = set(), None
        elif s.had_grad is not None and s.unit.used_counts is not None:
            carried.append(s)
        elif s.had_grad is not None:
            by_group.setdefault(s.unit.dp.agreement_groups, []).append(s)
    if carried:
        counts = iter(torch.cat([s.unit.used_counts for s in carried]).tolist())
        for s in carried:
            _drop_unused(s, (c > 0 for c in counts))
    for groups, group_states in by_group.items():
        used = [i in s.got_grad for s in group_states for i in range(len(s.unit.slots))]
        flags = iter(any_rank(used, group_states[0].unit.device, groups))
        for s in group_states:
            _drop_unused(s, flags)


def _drop_unused(state: FSDPState, anywhere) -> None:
    """``.grad = None`` for ``state``'s trainable parameters that had none before this
    reduction and that no rank used (``anywhere``: per slot, in order, whether some rank
    did); then the agreement starts afresh."""
    unit = state.unit
    for slot, p, had, used in zip(unit.slots, unit.sharded_params, state.had_grad, anywhere):
        if slot.requires_grad and not had and not used:
            p.grad = None
    unit.release_dropped_grads()
    unit.used_counts = None
    state.got_grad, state.had_grad = set(), None
