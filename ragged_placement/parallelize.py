"""Parallelizing a model: the recipes that apply expert parallelism, tensor parallelism and FSDP to
the models of :mod:`ragged_placement.models` and to ``transformers``' mixtures of experts
(torchtitan keeps them in each model's ``parallelize.py``, apart from the model).

* :func:`parallelize_moe`: expert parallelism over an ``ep`` mesh dim, then FSDP beside it and
  over every data-parallel rank (torchtitan's ``apply_moe_ep_tp`` then ``apply_fsdp``), for
  :class:`~ragged_placement.models.moe.MoETransformer`; :func:`parallelize_hf_moe`, the same on a
  ``transformers`` mixture of experts; :func:`parallelize_experts`, the recipe on any model.
* :func:`parallelize_llama`: torchtitan's tensor-parallel plan for
  :class:`~ragged_placement.models.llama.Llama`.

Every argument check, and every feature combination of
:data:`ragged_placement.combinations.REFUSED`, runs before the first module is parallelized.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from ragged_placement.combinations import Feature, Given, check_combinations
from ragged_placement.expert_parallel import (
    ExpertParallel,
    HFExpertParallel,
    check_expert_parallel,
    hf_experts,
    split_state_sharding,
)

if TYPE_CHECKING:
    from ragged_placement.quant import BlockFP8Config

__all__ = ["parallelize_experts", "parallelize_hf_moe", "parallelize_llama", "parallelize_moe"]


def parallelize_moe(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    ep_dim: str = "ep",
    shard_fn: Callable[..., nn.Module] | None = None,
    state_sharding: Any = None,
    expert_state_sharding: Any = None,
    **fsdp_kwargs: Any,
) -> nn.Module:
    """Expert parallelism over ``mesh[ep_dim]`` and FSDP over the data-parallel ranks, in place:
    torchtitan's recipe (``apply_moe_ep_tp`` then ``apply_fsdp``).

    ``mesh`` is a 2-D ``(dp_mod_ep, ep_dim)`` device mesh over every data-parallel rank (its
    other dim the data-parallel ranks outside each ep group; size 1 for EP over the whole
    world). Every MoE block's ``moe.experts`` gets :class:`~ragged_placement.expert_parallel.
    ExpertParallel` on ``mesh[ep_dim]`` (each ep rank owns ``E/ep`` whole experts), then
    ``shard_fn(experts, mesh=mesh[dp_mod_ep])`` with its gradients divided by the whole
    data-parallel world (their sum covers the tokens of every rank of the ep group); every
    block and the root are then ``shard_fn(..., mesh=<mesh flattened>)``: dense parameters
    sharded over all data-parallel ranks (with a ``state_sharding``, ``shard_fn(...,
    mesh=mesh, state_sharding=state_sharding)``).

    Args:
        model: a :class:`~ragged_placement.models.moe.MoETransformer`, its weights the same on every rank (or on meta).
        mesh: the 2-D mesh, one of its dims named ``ep_dim``.
        ep_dim: the name of the expert-parallel dim.
        shard_fn: ``ragged_placement.fsdp.fully_shard`` (the default) or torch's
            ``torch.distributed.fsdp.fully_shard`` (FSDP2 + EP, torchtitan's pattern).
        state_sharding: a :class:`~ragged_placement.fsdp.StateSharding` over both dims of
            ``mesh`` for the dense units, which are then sharded on ``mesh`` itself (e.g. AMSP
            on ``(inter, intra)`` with EP over ``intra``); ours only.
        expert_state_sharding: the expert units' ``StateSharding`` over ``mesh[dp_mod_ep]``;
            by default ``state_sharding`` with ``ep_dim`` dropped from each state
            (:func:`~ragged_placement.expert_parallel.split_state_sharding`).
        fsdp_kwargs: passed to every ``shard_fn`` call (``reshard_after_forward``,
            ``mp_policy``, ...), and ``quant``: block-wise FP8
            (:class:`~ragged_placement.quant.BlockFP8Config`, ours only): the dense units'
            ``nn.Linear`` weights and the expert units' stacks are gathered as FP8 blocks and
            scales (each rank quantizes its own whole blocks; a block never holds rows of two
            experts, each expert's matrix has its own scales) and computed in FP8
            (``GroupedExperts.quant``, per expert matrix).

    Raises:
        ValueError: before any collective, if ``mesh`` is not 2-D with an ``ep_dim`` dim, or
            its size does not divide ``num_experts`` (an expert is never cut between ep ranks);
            if a ``StateSharding`` does not fit its mesh (:func:`~ragged_placement.
            expert_parallel.split_state_sharding`, :func:`~ragged_placement.fsdp.nested.
            check_state_sharding`), or the arguments combine features of
            :data:`ragged_placement.combinations.REFUSED` (a ``StateSharding`` or ``quant`` with
            torch's ``fully_shard``, a ``StateSharding`` with an int ``reshard_after_forward``,
            ...).
    """
    from ragged_placement.fsdp.fp8 import check_quant

    quant = check_quant(fsdp_kwargs.pop("quant", None))
    _check_fp8_configs(model, quant)
    experts = {block: block.moe.experts for block in model.layers.values() if block.moe_enabled}
    return parallelize_experts(
        model, mesh, model.layers.values(), experts, ExpertParallel(), ep_dim=ep_dim,
        shard_fn=shard_fn, state_sharding=state_sharding,
        expert_state_sharding=expert_state_sharding, quant=quant, **fsdp_kwargs)


def parallelize_experts(
    model: nn.Module,
    mesh: DeviceMesh,
    blocks: Iterable[nn.Module],
    experts: dict[nn.Module, nn.Module],
    style: ParallelStyle,
    *,
    ep_dim: str = "ep",
    shard_fn: Callable[..., nn.Module] | None = None,
    state_sharding: Any = None,
    expert_state_sharding: Any = None,
    quant: BlockFP8Config | None = None,
    features: Mapping[Feature, Given] | None = None,
    **fsdp_kwargs: Any,
) -> nn.Module:
    """:func:`parallelize_moe`'s recipe on any model: ``style`` (an expert-parallel
    ``ParallelStyle``) on each experts module of ``experts`` (keyed by the block holding it) over
    ``mesh[ep_dim]``, ``shard_fn`` on it over the dim beside ``ep_dim``, then on every block of
    ``blocks`` and on ``model`` over all data-parallel ranks. Every check runs before any unit is
    built; ``quant`` (checked by the caller) goes to ``shard_fn`` for every unit. The arguments'
    combinations are checked against :data:`ragged_placement.combinations.REFUSED`, with
    ``features``: those the caller's model turns on (``parallelize_hf_moe``: the transformers
    experts)."""
    from ragged_placement.fsdp import fully_shard
    from ragged_placement.fsdp.nested import check_state_sharding

    names = mesh.mesh_dim_names if isinstance(mesh, DeviceMesh) else None
    if names is None or mesh.ndim != 2 or ep_dim not in names:
        raise ValueError(
            f"mesh must be a 2-D DeviceMesh (dp_mod_ep, {ep_dim!r}) with named dims, got {mesh!r}"
        )
    dp_mod_ep = names[1 - names.index(ep_dim)]
    ours = shard_fn is None or shard_fn is fully_shard
    passed = {name: value for name, value in (("state_sharding", state_sharding),
                                              ("expert_state_sharding", expert_state_sharding))
              if value is not None}
    if ours:  # torch's fully_shard takes neither, whatever their values
        state_sharding, expert_state_sharding = split_state_sharding(
            mesh, ep_dim, state_sharding, expert_state_sharding
        )
        if (check_state_sharding(state_sharding, mesh) is None
                and check_state_sharding(expert_state_sharding, mesh[dp_mod_ep]) is None):
            passed = {}  # the defaults of their meshes: the runtime without nesting
    check_combinations({
        **_features(None if ours else shard_fn, passed, quant, ep_dim, mesh[ep_dim].size(),
                    fsdp_kwargs),
        **(features or {}),
    })
    shard_fn = fully_shard if ours else shard_fn
    ep_size = mesh[ep_dim].size()
    for module in experts.values():
        check_expert_parallel(module, ep_size)
    dense, expert_unit = _unit_arguments(mesh, ep_dim, state_sharding, expert_state_sharding,
                                         quant)
    gloo = dist.get_backend(mesh.get_group(ep_dim)) == "gloo"
    for module in experts.values():
        parallelize_module(module, mesh[ep_dim], style)
    for block in blocks:
        if block in experts:
            module = experts[block]
            shard_fn(module, **expert_unit, **fsdp_kwargs)
            module.set_gradient_divide_factor(mesh.size())
            if gloo and mesh[dp_mod_ep].size() > 1:
                # FSDP2 divides by a factor with PREMUL_SUM, which gloo lacks. (Not on one
                # rank: there FSDP2 2.13 would divide twice, in its copy and after it.)
                module.set_force_sum_reduction_for_comms(True)
        shard_fn(block, **dense, **fsdp_kwargs)
    shard_fn(model, **dense, **fsdp_kwargs)
    return model


def _unit_arguments(
    mesh: DeviceMesh, ep_dim: str, state_sharding: Any, expert_state_sharding: Any, quant: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``shard_fn``'s mesh and options for the dense units (all data-parallel ranks: ``mesh``
    flattened, or ``mesh`` itself with a ``state_sharding``; ``quant``) and for the expert units
    (the dim beside ``ep_dim``; ``expert_state_sharding``; ``quant``)."""
    dp_mod_ep = next(d for d in mesh.mesh_dim_names if d != ep_dim)
    if state_sharding is None:
        dense = {"mesh": mesh._flatten(f"{dp_mod_ep}_{ep_dim}")}
    else:
        dense = {"mesh": mesh, "state_sharding": state_sharding}
    experts = {"mesh": mesh[dp_mod_ep]}
    if quant is not None:
        dense["quant"] = experts["quant"] = quant
    # on a 1-rank dp_mod_ep (EP over every rank) every sharding of the experts is the same:
    # nothing to shard, nothing sent; the nested runtime needs >= 2 ranks
    if expert_state_sharding is not None and mesh[dp_mod_ep].size() > 1:
        experts["state_sharding"] = expert_state_sharding
    return dense, experts


def _check_fp8_configs(model: nn.Module, quant: Any) -> None:
    """``ValueError`` (before any unit is built) if a module of ``model`` already computes in
    FP8 with another config than ``quant`` (``fully_shard`` would refuse it unit by unit,
    after the units before it)."""
    from ragged_placement.fsdp.fp8 import fp8_config

    if quant is None:
        return
    for name, m in model.named_modules():
        config = fp8_config(m)
        if config is not None and config != quant:
            raise ValueError(
                f"quant={quant}, but {name} ({type(m).__name__}) already computes in FP8 with "
                f"{config}: pass that config as quant, or reset the module's"
            )


def _features(
    torch_shard_fn: Callable[..., nn.Module] | None, state_shardings: dict[str, Any], quant: Any,
    ep_dim: str, ep_size: int, fsdp_kwargs: dict[str, Any],
) -> dict[Feature, Given]:
    """The features of :data:`ragged_placement.combinations.REFUSED` a
    :func:`parallelize_experts` call turns on, in its arguments' words: ``torch_shard_fn`` a
    ``shard_fn`` other than ours, ``state_shardings`` the given ones that shard a state."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    reshard = fsdp_kwargs.get("reshard_after_forward")
    name = getattr(torch_shard_fn, "__qualname__", None)
    shard_fn = f"{torch_shard_fn.__module__}.{name}" if name else repr(torch_shard_fn)
    given = state_shardings
    features = (
        (Feature.TORCH_FSDP2, torch_shard_fn is not None, f"shard_fn={shard_fn}",
         "drop shard_fn (ragged_placement.fsdp.fully_shard is the default)"),
        (Feature.STATE_SHARDING, given, " and ".join(f"{k}={v}" for k, v in given.items()),
         " and ".join(f"drop {k}" for k in given)),
        (Feature.QUANT, quant is not None, f"quant={quant!r}", "drop quant"),
        (Feature.EXPERT_PARALLEL, ep_size > 1, f"expert parallelism over mesh[{ep_dim!r}] "
         f"({ep_size} ranks)", f"pass a mesh whose {ep_dim!r} dim has one rank"),
        (Feature.CPU_OFFLOAD, isinstance(fsdp_kwargs.get("offload_policy"), CPUOffloadPolicy),
         f"offload_policy={fsdp_kwargs.get('offload_policy')!r}",
         "pass offload_policy=OffloadPolicy()"),
        (Feature.INT_RESHARD, isinstance(reshard, int) and not isinstance(reshard, bool),
         f"reshard_after_forward={reshard!r}", "pass reshard_after_forward as a bool or None"),
        (Feature.DP_MESH_DIMS, fsdp_kwargs.get("dp_mesh_dims") is not None,
         f"dp_mesh_dims={fsdp_kwargs.get('dp_mesh_dims')!r}", "drop dp_mesh_dims"),
        (Feature.GRANULARITY, fsdp_kwargs.get("granularity") is not None,
         f"granularity={fsdp_kwargs.get('granularity')!r}", "drop granularity"),
    )
    return {f: Given(spelling, fix) for f, on, spelling, fix in features if on}


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
    all data-parallel ranks: :func:`parallelize_moe`'s recipe on a ``transformers`` causal LM,
    in place.

    Raises:
        ValueError: before any collective, for a layer whose experts are not in the layout the
            forward computes (:func:`hf_experts`), a mesh that is not 2-D with an ``ep_dim``
            dim, an ``ep`` size that does not divide the number of experts, or a combination
            of :data:`ragged_placement.combinations.REFUSED` (``quant``; a ``state_sharding``
            under expert parallelism).
    """
    blocks = list(blocks)
    experts = {block: module for block in blocks if (module := hf_experts(block)) is not None}
    if not experts:
        raise ValueError(f"{type(model).__name__} has no experts module to shard by expert")
    hf = Given(f"model={type(model).__name__} (transformers experts)",
               "pass a ragged_placement.models.moe.MoETransformer as model")
    return parallelize_experts(model, mesh, blocks, experts, HFExpertParallel(),
                               ep_dim=ep_dim, shard_fn=shard_fn,
                               features={Feature.HF_EXPERTS: hf}, **fsdp_kwargs)


def parallelize_llama(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Apply torchtitan's tensor-parallel plan (no sequence parallel) to a
    :class:`~ragged_placement.models.llama.Llama` on ``tp_mesh``, in place."""
    if not isinstance(tp_mesh, DeviceMesh) or tp_mesh.ndim != 1:
        raise ValueError(f"tp_mesh must be a 1-D DeviceMesh, got {tp_mesh!r}")
    top = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate())
    if model.output is not None:
        top["output"] = ColwiseParallel(output_layouts=Replicate())
    if top:
        parallelize_module(model, tp_mesh, top)
    block_plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
    }
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan)
    return model
