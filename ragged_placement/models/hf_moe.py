"""Expert parallelism for Hugging Face ``transformers`` mixtures of experts (Mixtral, Qwen3-MoE,
DeepSeek-V3), their router and weights unchanged.

``transformers`` 5 stores a MoE layer's routed experts as one module of stacked tensors,
``gate_up_proj`` ``[E, 2 x ffn, dim]`` (gate rows, then up rows) and ``down_proj`` ``[E, dim,
ffn]``, whose ``forward(hidden_states, top_k_index, top_k_weights)`` takes every token with the
router's choices and weights and returns the weighted sum of its experts' outputs (``Experts``
classes decorated with ``use_experts_implementation``). :class:`HFExpertParallel` shards such a
module by expert over an ``ep`` mesh dim with :func:`~ragged_placement.expert_parallel.
shard_experts` and replaces its forward by one that sorts the (token, choice) pairs by expert,
dispatches them to the ranks owning their experts (all-to-alls of uneven splits,
:class:`~ragged_placement.expert_parallel.ExpertRouting`), runs each local expert on its rows
(``linear``, the module's own ``_apply_gate``, ``linear``), sends the rows back and sums them per
token with the router's weights, as the module's own forward does. The router runs on each
rank's own tokens, unchanged, so a token picks the experts it picks in one process.
:func:`parallelize_hf_moe` composes it with FSDP (:func:`~ragged_placement.models.moe.
parallelize_experts`, torchtitan's recipe).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["HFExpertParallel", "hf_experts", "parallelize_hf_moe"]

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
        from ragged_placement.expert_parallel import shard_experts

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


def parallelize_hf_moe(
    model: nn.Module,
    mesh: DeviceMesh,
    blocks: Iterable[nn.Module],
    *,
    ep_dim: str = "ep",
    shard_fn: Callable[..., nn.Module] | None = None,
    **fsdp_kwargs: Any,
) -> nn.Module:
    """Expert parallelism over ``mesh[ep_dim]`` for the experts of every decoder layer of
    ``blocks`` (:class:`HFExpertParallel`), FSDP beside it, and the dense parameters sharded over
    all data-parallel ranks: :func:`~ragged_placement.models.moe.parallelize_moe`'s recipe on a
    ``transformers`` causal LM, in place.

    Raises:
        ValueError: before any collective, for a layer whose experts are not in the layout the
            forward computes (:func:`hf_experts`), a mesh that is not 2-D with an ``ep_dim``
            dim, an ``ep`` size that does not divide the number of experts, or a combination
            of :data:`ragged_placement.combinations.REFUSED` (``quant``; a ``state_sharding``
            under expert parallelism).
    """
    from ragged_placement.combinations import Feature, Given
    from ragged_placement.models.moe import parallelize_experts

    blocks = list(blocks)
    experts = {block: module for block in blocks if (module := hf_experts(block)) is not None}
    if not experts:
        raise ValueError(f"{type(model).__name__} has no experts module to shard by expert")
    hf = Given(f"model={type(model).__name__} (transformers experts)",
               "pass a ragged_placement.models.moe.MoETransformer as model")
    return parallelize_experts(model, mesh, blocks, experts, HFExpertParallel(),
                               ep_dim=ep_dim, shard_fn=shard_fn,
                               features={Feature.HF_EXPERTS: hf}, **fsdp_kwargs)
