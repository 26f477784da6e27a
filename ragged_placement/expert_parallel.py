"""Expert parallelism: a module of stacked experts sharded by expert over one mesh dim, its
tokens dispatched to the ranks that own their experts and combined back (torchtitan's
``ExpertParallel``).

:class:`ExpertParallel` is a tensor-parallel style (``parallelize_module(experts, ep_mesh,
ExpertParallel())``) for a module whose parameters stack ``E`` experts on dim 0 and whose
``forward(x, counts)`` takes tokens sorted by expert with ``counts[e]`` rows for expert ``e``
(:class:`ragged_placement.models.moe.GroupedExperts`). It

* makes every parameter a ``Shard(0)`` DTensor on the 1-D ``ep`` mesh, from the full tensor each
  rank holds (no communication: all ranks must hold the same full weights, as after seeding or
  on the meta device): rank ``r`` owns experts ``[r E/P, (r+1) E/P)``, whole (``P`` must divide
  ``E``);
* before the forward, exchanges the per-expert token counts (one all-to-all of ``E`` ints), then
  sends each rank the tokens of its experts (an all-to-all of uneven splits, which change every
  step) and reorders them by local expert;
* after the forward, restores the received order and sends the outputs back (the reverse
  all-to-all), so the caller sees its own tokens in its own order.

Both all-to-alls are differentiable (backward runs the reverse exchange). ``fully_shard`` on the
module with the data-parallel mesh beside ``ep`` then shards each rank's experts further (see
:func:`ragged_placement.parallelize.parallelize_moe`).

``transformers`` 5 stores a MoE layer's routed experts as one module of stacked tensors,
``gate_up_proj`` ``[E, 2 x ffn, dim]`` (gate rows, then up rows) and ``down_proj`` ``[E, dim,
ffn]``, whose ``forward(hidden_states, top_k_index, top_k_weights)`` takes every token with the
router's choices and weights and returns the weighted sum of its experts' outputs (``Experts``
classes decorated with ``use_experts_implementation``). :class:`HFExpertParallel` shards such a
module by expert with :func:`shard_experts` and replaces its forward by one that sorts the
(token, choice) pairs by expert, dispatches them to the ranks owning their experts
(:class:`ExpertRouting`), runs each local expert on its rows (``linear``, the module's own
``_apply_gate``, ``linear``), sends the rows back and sums them per token with the router's
weights, as the module's own forward does. The router runs on each rank's own tokens,
unchanged, so a token picks the experts it picks in one process
(:func:`ragged_placement.parallelize.parallelize_hf_moe` composes it with FSDP).
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from ragged_placement.planner.sharding import StateSharding

__all__ = ["ExpertParallel", "ExpertRouting", "HFExpertParallel", "check_expert_parallel",
           "drop_dim", "hf_experts", "shard_experts", "split_state_sharding"]


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of dim-0 rows with uneven splits; backward sends the gradients
    back along the reverse splits."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group), None, None, None


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def check_expert_parallel(module: nn.Module, ep_size: int) -> int:
    """The number of experts of ``module`` (dim 0 of each of its parameters), after checking
    that ``ep_size`` ranks can each own a whole, equal share: ``ValueError`` naming ``ep``
    otherwise. No communication."""
    sizes = {name: p.shape[0] if p.dim() else None for name, p in module.named_parameters()}
    if not sizes or len(set(sizes.values())) != 1 or None in sizes.values():
        raise ValueError(
            f"ExpertParallel needs a module whose parameters stack the same number of experts on "
            f"dim 0; {type(module).__name__} has {sizes}"
        )
    num_experts = next(iter(sizes.values()))
    if num_experts % ep_size:
        raise ValueError(
            f"ep={ep_size} does not divide num_experts={num_experts}: expert parallelism gives "
            f"each ep rank whole experts, an equal number each; pick ep among the divisors of "
            f"{num_experts}"
        )
    return num_experts


def split_state_sharding(
    mesh: DeviceMesh,
    ep_dim: str,
    state_sharding: StateSharding | None,
    expert_state_sharding: StateSharding | None,
) -> tuple[StateSharding | None, StateSharding | None]:
    """The ``StateSharding`` of the dense units (over both dims of the 2-D ``mesh``) and of the
    expert units (over the dim beside ``ep_dim``), checked. No communication.

    The expert units' parameters are already sharded by expert over ``ep_dim``; their states
    can be sharded further over the other dim only. ``expert_state_sharding`` names it; by
    default it is ``state_sharding`` with ``ep_dim`` dropped from each state (as the planner's
    EP search applies a sharding to the experts: ``plan_state_sharding``), e.g. AMSP
    ``P(intra) G(inter,intra) OS(inter,intra)`` with EP over ``intra`` shards the experts'
    gradients and optimizer state over ``inter`` (ZeRO-2 there).

    Raises:
        TypeError: either is not a ``StateSharding``.
        ValueError: ``state_sharding`` does not fit ``mesh``; ``expert_state_sharding`` names
            ``ep_dim`` or a dim not in ``mesh``; or ``state_sharding`` shards the optimizer
            state over ``ep_dim`` only, so that the experts' would be replicated (DDP), which
            the runtime does not do.
    """
    names = mesh.mesh_dim_names
    dp_mod_ep = names[1 - names.index(ep_dim)]
    for arg, value in (("state_sharding", state_sharding),
                       ("expert_state_sharding", expert_state_sharding)):
        if value is not None and not isinstance(value, StateSharding):
            raise TypeError(
                f"{arg} must be a ragged_placement.fsdp.StateSharding, got {type(value).__name__}"
            )
    if state_sharding is not None:
        state_sharding.validate(mesh)
    if expert_state_sharding is None and state_sharding is not None:
        expert_state_sharding = drop_dim(state_sharding, ep_dim)
        if not expert_state_sharding.optim:
            raise ValueError(
                f"state_sharding={state_sharding} shards the optimizer state over the ep dim "
                f"{ep_dim!r} only: the expert units, already sharded by expert over "
                f"{ep_dim!r}, would be replicated over {dp_mod_ep!r} (DDP), which the runtime "
                f"does not do; name {dp_mod_ep!r} in its optim, or pass expert_state_sharding="
                f"StateSharding(params=(), grads=(), optim=({dp_mod_ep!r},)) (or another over "
                f"{dp_mod_ep!r})"
            )
    elif expert_state_sharding is not None:
        named = {d for dims in (expert_state_sharding.params, expert_state_sharding.grads,
                                expert_state_sharding.optim) for d in dims}
        if ep_dim in named:
            raise ValueError(
                f"expert_state_sharding={expert_state_sharding} names the ep dim {ep_dim!r}: "
                f"the expert units' parameters are sharded by expert over {ep_dim!r} "
                f"(ExpertParallel), so their states can be sharded over {dp_mod_ep!r} only; "
                f"drop {ep_dim!r}, e.g. expert_state_sharding="
                f"{drop_dim(expert_state_sharding, ep_dim)!r}"
            )
        expert_state_sharding.validate({dp_mod_ep: mesh[dp_mod_ep].size()})
    return state_sharding, expert_state_sharding


def drop_dim(sharding: StateSharding, dim: str) -> StateSharding:
    """``sharding`` with ``dim`` dropped from each state: the experts' sharding that
    :func:`split_state_sharding` derives from a ``state_sharding`` with EP over ``dim``."""
    return StateSharding(*(tuple(d for d in dims if d != dim)
                           for dims in (sharding.params, sharding.grads, sharding.optim)))


class ExpertParallel(ParallelStyle):
    """Shard a stacked-experts module by expert over a 1-D mesh and route its tokens (see the
    module docstring). Apply with ``parallelize_module(module, ep_mesh, ExpertParallel())``."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module._ep = shard_experts(module, device_mesh)
        module.register_forward_pre_hook(_dispatch_hook)
        module.register_forward_hook(_combine_hook)
        return module


def shard_experts(module: nn.Module, device_mesh: DeviceMesh) -> ExpertRouting:
    """Make each parameter of ``module`` (``E`` experts stacked on dim 0) a ``Shard(0)`` DTensor
    on the 1-D ``device_mesh`` from the full tensor this rank holds (no communication), and
    return the :class:`ExpertRouting` that sends tokens to the ranks owning their experts.

    Raises:
        ValueError: ``device_mesh`` is not 1-D, its size does not divide ``E`` or a parameter
            is already a DTensor (:func:`check_expert_parallel`).
    """
    if not isinstance(device_mesh, DeviceMesh) or device_mesh.ndim != 1:
        raise ValueError(f"ExpertParallel needs a 1-D ep mesh, got {device_mesh!r}")
    num_experts = check_expert_parallel(module, device_mesh.size())
    rank, size = device_mesh.get_local_rank(), device_mesh.size()
    per = num_experts // size
    for name, p in list(module.named_parameters(recurse=False)):
        if isinstance(p, DTensor):
            raise ValueError(f"ExpertParallel: parameter {name} is already a DTensor")
        local = p.detach().narrow(0, rank * per, per).clone()
        shard = DTensor.from_local(local, device_mesh, [Shard(0)], run_check=False)
        module.register_parameter(name, nn.Parameter(shard, requires_grad=p.requires_grad))
    return ExpertRouting(device_mesh, num_experts)


class ExpertRouting:
    """One experts module's ep group and the exchanges of its forwards in flight: :meth:`dispatch`
    before its experts, :meth:`combine` after (in the same order as the forwards)."""

    def __init__(self, mesh: DeviceMesh, num_experts: int) -> None:
        self.group = mesh.get_group()
        self.size = mesh.size()
        self.local_experts = num_experts // self.size
        self.pending: list[tuple[torch.Tensor, list[int], list[int]]] = []

    def dispatch(self, x: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Send rows of ``x`` (sorted by global expert, ``counts[e]`` each) to their owners;
        return the received rows sorted by local expert and the count of each local expert."""
        counts = torch.as_tensor(counts, dtype=torch.int64, device=x.device)
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=self.group)
        received_counts = received_counts.view(self.size, self.local_experts)
        in_splits = counts.view(self.size, -1).sum(1).tolist()
        out_splits = received_counts.sum(1).tolist()
        received = _AllToAll.apply(x, out_splits, in_splits, self.group)
        # Rows arrive by (source rank, local expert); the experts want them by local expert.
        expert_of_row = torch.arange(self.local_experts, device=x.device).repeat(self.size)
        expert_of_row = expert_of_row.repeat_interleave(received_counts.flatten())
        order = torch.argsort(expert_of_row, stable=True)
        self.pending.append((order, in_splits, out_splits))
        return received[order], received_counts.sum(0)

    def combine(self, out: torch.Tensor) -> torch.Tensor:
        """Undo :meth:`dispatch` on the experts' output ``out``."""
        order, in_splits, out_splits = self.pending.pop()
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return _AllToAll.apply(out[inverse], in_splits, out_splits, self.group)


def _dispatch_hook(module: nn.Module, args: tuple) -> tuple:
    x, counts = args
    return module._ep.dispatch(x, counts)


def _combine_hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    return module._ep.combine(out)


# The layout the expert-parallel forward computes: what use_experts_implementation records.
_LAYOUT = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
           "has_post_expert_norm": False}


def _is_hf_experts(module: nn.Module) -> bool:
    p = getattr(module, "gate_up_proj", None)
    return isinstance(p, nn.Parameter) and p.dim() == 3 and hasattr(module, "num_experts")


def hf_experts(block: nn.Module) -> nn.Module | None:
    """The routed-experts module of a decoder layer (``None`` in a dense layer), checked to be in
    the layout :class:`HFExpertParallel` computes: ``ValueError`` otherwise."""
    found = [m for m in block.modules() if _is_hf_experts(m)]
    if not found:
        return None
    if len(found) > 1:
        raise ValueError(f"{type(block).__name__} holds {len(found)} experts modules; expert "
                         "parallelism takes one per decoder layer")
    module = found[0]
    layout = {k: getattr(module, k, None) for k in _LAYOUT}
    if layout != _LAYOUT or set(dict(module.named_parameters(recurse=False))) != {
            "gate_up_proj", "down_proj"}:
        raise ValueError(
            f"{type(module).__name__}: expert parallelism takes experts with stacked "
            f"gate_up_proj [E, 2 x ffn, dim] and down_proj [E, dim, ffn], no bias, no "
            f"post-expert norm ({_LAYOUT}); this one has {layout} and parameters "
            f"{sorted(dict(module.named_parameters(recurse=False)))}"
        )
    return module


class HFExpertParallel(ParallelStyle):
    """Shard a ``transformers`` experts module (:func:`hf_experts`) by expert over a 1-D mesh
    and route its tokens there (the module docstring). Apply with ``parallelize_module(experts,
    ep_mesh, HFExpertParallel())``."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module._ep = shard_experts(module, device_mesh)
        module.forward = types.MethodType(_expert_parallel_forward, module)
        return module


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _expert_parallel_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts module's forward under expert parallelism: the same sum per token of its
    experts' outputs times the router's weights."""
    top_k = top_k_index.shape[-1]
    chosen = top_k_index.reshape(-1)
    order = torch.argsort(chosen, stable=True)
    token = order // top_k
    counts = torch.bincount(chosen, minlength=self.num_experts)
    rows, local_counts = self._ep.dispatch(hidden_states[token], counts)
    gate_up, down = _local(self.gate_up_proj), _local(self.down_proj)
    outs = [F.linear(self._apply_gate(F.linear(x, gate_up[e])), down[e])
            for e, x in enumerate(torch.split(rows, local_counts.tolist()))]
    out = torch.cat(outs) if outs else rows.new_zeros(0, down.shape[1])
    out = self._ep.combine(out)
    out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
    return torch.zeros_like(hidden_states).index_add(0, token, out.to(hidden_states.dtype))
