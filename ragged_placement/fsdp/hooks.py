"""Forward/backward hooks of FSDP units and the per-root state that orders them.

Per iteration, for a unit ``u`` (root = the outermost unit, whose forward runs first):

* forward pre-hook: (root only) free the flat sharded gradients ``zero_grad()`` dropped; wait
  for ``u``'s all-gather (issue it if no prefetch did), register the unsharded parameters,
  prefetch the next unit's all-gather (order recorded in the previous forward), and wrap the
  floating inputs that require grad in :class:`_PostBackward` so that ``u``'s post-backward runs
  when autograd has produced the gradients of ``u``'s inputs (by then its parameter gradients
  are accumulated: AccumulateGrad nodes run first).
* forward post-hook: reshard (free the unsharded buffer) unless ``reshard_after_forward`` is off
  or ``u`` is the root (whose parameters backward needs first), and hook the outputs.
* pre-backward (a hook on ``u``'s outputs): re-gather and prefetch the all-gather of the unit
  whose backward runs next (on GPUs). The first gradient reaching a parameter of one of ``u``'s
  plan segments (a hook on each parameter) allocates the segment's zeroed flat gradient buffer
  and presets its parameters' ``.grad`` to views of it, so AccumulateGrad adds into it in place.
* post-backward: issue the reduce-scatter (async on GPUs, where the previous unit's is finished
  first, so at most one is in flight; finished at once on CPU), reshard.
* the root queues a callback that runs when autograd finishes: post-backward for units whose
  inputs did not require grad (e.g. the root, fed token ids), then it waits for the last
  reduce-scatter.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_unflatten

from ragged_placement.fsdp._dynamo import dynamo_disable
from ragged_placement.fsdp.unit import FSDPUnit

__all__ = ["FSDPState", "RootContext"]


class RootContext:
    """What the root unit shares with the units below it during one iteration."""

    def __init__(self, states: list[FSDPState]) -> None:
        self.states = states  # root first, then the others in module order
        self.forward_order: list[FSDPState] = []  # non-root units, last forward's order
        self._recording: list[FSDPState] = []
        self.pending_reduce: FSDPUnit | None = None
        self.callback_queued = False

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

    def finish_pending_reduce(self) -> None:
        if self.pending_reduce is not None:
            self.pending_reduce.finish_reduce()
            self.pending_reduce = None

    def next_in_forward(self, state: FSDPState) -> FSDPState | None:
        if state.is_root:
            return self.forward_order[0] if self.forward_order else None
        order = self.forward_order
        if state in order:
            i = order.index(state)
            return order[i + 1] if i + 1 < len(order) else None
        return None

    def next_in_backward(self, state: FSDPState) -> FSDPState | None:
        # The root's pre-backward runs at the loss, when activations peak: prefetching there
        # would add a unit's parameters to the peak, so the last unit gathers on its own hook.
        order = self.forward_order
        if state in order:
            i = order.index(state)
            return order[i - 1] if i > 0 else None
        return None


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


def _map_float_tensors(fn, tree: Any) -> Any:
    leaves, spec = tree_flatten(tree)
    return tree_unflatten(
        [fn(x) if torch.is_tensor(x) and x.is_floating_point() else x for x in leaves], spec
    )


class FSDPState:
    """The hooks and flags of one ``fully_shard`` call."""

    def __init__(
        self, module: nn.Module, unit: FSDPUnit, reshard_after_forward: bool, mp_policy
    ) -> None:
        self.module = module
        self.unit = unit
        self.reshard_after_forward = reshard_after_forward
        self.mp_policy = mp_policy
        self.requires_gradient_sync = True
        self.root: RootContext | None = None
        self.is_root = False
        self._needs_post_backward = False
        self._backward_started = False
        module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
        for i, (slot, param) in enumerate(zip(unit.slots, unit.unsharded_params)):
            if slot.requires_grad:
                param.register_hook(lambda grad, i=i: self._on_grad(i))
        module.register_forward_hook(self._post_forward, prepend=False)

    # -- lazy root init ----------------------------------------------------------------------
    def _lazy_init(self) -> None:
        states = [self] + [
            m._fsdp_state
            for m in self.module.modules()
            if m is not self.module and getattr(m, "_fsdp_state", None) is not None
        ]
        ctx = RootContext(states)
        for s in states:
            s.root = ctx
            s.is_root = s is self

    # -- forward -------------------------------------------------------------------------------
    @dynamo_disable
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        if self.root is None:
            self._lazy_init()
        ctx = self.root
        if self.is_root:
            ctx.finish_pending_reduce()
            ctx._recording = []
            for s in ctx.states:
                s.unit.release_dropped_grads()
        else:
            ctx._recording.append(self)
        self.unit.unshard(async_op=False)
        self.unit.wait_unshard()
        self.unit.register(sharded=False)
        ctx.prefetch(ctx.next_in_forward(self))
        mp = self.mp_policy
        if mp.cast_forward_inputs and mp.param_dtype is not None:
            args, kwargs = _map_float_tensors(lambda t: t.to(mp.param_dtype), (args, kwargs))
        if torch.is_grad_enabled():
            args, kwargs = self._wrap_inputs_for_post_backward(args, kwargs)
        return args, kwargs

    def _wrap_inputs_for_post_backward(self, args: tuple, kwargs: dict):
        leaves, spec = tree_flatten((args, kwargs))
        idx = [i for i, x in enumerate(leaves) if torch.is_tensor(x) and x.requires_grad]
        if not idx:
            return args, kwargs
        wrapped = _PostBackward.apply(self, *(leaves[i] for i in idx))
        for i, t in zip(idx, wrapped):
            leaves[i] = t
        return tree_unflatten(leaves, spec)

    @dynamo_disable
    def _post_forward(self, module: nn.Module, args: tuple, output: Any):
        ctx = self.root
        grad = torch.is_grad_enabled()
        if self.is_root:
            ctx.forward_order = ctx._recording
        if (self.reshard_after_forward and not self.is_root) or not grad:
            self.unit.reshard()
        if grad:
            self._needs_post_backward = True
            self._backward_started = False
            leaves, _ = tree_flatten(output)
            for t in leaves:
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(self._pre_backward)
        if self.mp_policy.output_dtype is not None:
            output = _map_float_tensors(lambda t: t.to(self.mp_policy.output_dtype), output)
        return output

    # -- backward ------------------------------------------------------------------------------
    @dynamo_disable
    def _pre_backward(self, grad: torch.Tensor) -> None:
        if self._backward_started:
            return
        self._backward_started = True
        ctx = self.root
        if not ctx.callback_queued:
            ctx.callback_queued = True
            Variable._execution_engine.queue_callback(self._root_final_callback)
        self.unit.unshard(async_op=False)
        self.unit.wait_unshard()
        ctx.prefetch(ctx.next_in_backward(self), backward=True)

    @dynamo_disable
    def _on_grad(self, index: int) -> None:
        # Runs before AccumulateGrad of unsharded parameter ``index``. A segment's gradient
        # buffer is allocated at its first gradient, not at pre-backward, where it would sit on
        # the activation peak.
        self.unit.prepare_grads(index)

    @dynamo_disable
    def post_backward(self) -> None:
        """Reduce-scatter this unit's gradients (unless gradient sync is off) and reshard.

        Runs once per backward that accumulated gradients into the unit, so schedules that run
        several forwards before their backwards (pipeline parallel micro-batches) reduce every
        micro-batch's gradients."""
        unit = self.unit
        if not self._needs_post_backward and not unit.has_unsharded_grads:
            return
        self._needs_post_backward = False
        if unit.has_unsharded_grads and self.requires_gradient_sync:
            self.root.finish_pending_reduce()
            unit.reduce_grads()
            if unit.device.type == "cpu":
                # gloo stages the reduce-scatter in buffers of its own, alive with the input
                # until wait(): on CPU, where the overlap buys little, finishing it here frees
                # them before the next unit's backward (FSDP2 is synchronous on CPU too)
                unit.finish_reduce()
            else:
                self.root.pending_reduce = unit
        unit.reshard()

    @dynamo_disable
    def _root_final_callback(self) -> None:
        ctx = self.root
        for s in reversed(ctx.states):
            s.post_backward()
            s._backward_started = False
        ctx.finish_pending_reduce()
        ctx.callback_queued = False
