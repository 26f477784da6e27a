"""This package's Muon and Shampoo in torchtitan's optimizer container.

torchtitan 0.3.0 builds optimizers from ``OptimizersContainer.Config.param_groups``: each
``ParamGroupConfig`` names an optimizer (``"Adam"``, ``"AdamW"``, ``"DistMuon"``, resolved by
``OptimizersContainer._resolve_optimizer_factory``) and its keyword arguments; the groups of one
name become one optimizer per model part, and torchtitan's LR scheduler wraps each in a
``LambdaLR``. The class's doc invites subclasses: :class:`ShardedOptimizersContainer` adds
``"Muon"`` and ``"Shampoo"``, which step on the sharded parameters of either runtime (ours,
torch FSDP2) as :mod:`ragged_placement.optim` does, and leaves the rest (checkpointing, the
scheduler, MoE hooks) to the container.

A ``"Muon"`` group is split as ``python -m ragged_placement.train --optimizer muon`` splits a
model (:func:`~ragged_placement.trainer.build.is_muon_matrix`): the 2-D matrices and 3-D expert
stacks under the decoder's ``layers`` step with Muon, everything else (embeddings, the output
head, norms) with the AdamW of the same group's ``lr``, ``weight_decay``, ``betas`` and
``adamw_eps``. A ``"Shampoo"`` group steps every parameter, as the trainer's does.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

from ragged_placement.optim import Muon, Shampoo
from ragged_placement.trainer.build import is_muon_matrix, muon

__all__ = ["MUON_GROUP_KEYS", "OPTIMIZERS", "SHAMPOO_GROUP_KEYS", "ShardedOptimizersContainer",
           "build_muon", "build_shampoo", "from_adamw"]

OPTIMIZERS = {"muon": "Muon", "shampoo": "Shampoo"}
# torch.optim.AdamW's defaults, for the keys a torchtitan AdamW group may leave out.
_ADAMW = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}
# torchtitan adds these to every group (its ``implementation``): not options of ours.
_IMPLEMENTATION_KEYS = ("fused", "foreach")
# The names of torchtitan's decoder blocks' container (Decoder.layers): Muon's matrices live there.
_BLOCKS = "layers."
NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _group_keys(cls: type) -> tuple[str, ...]:
    return tuple(n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "params"))


# Every keyword a group of ours may carry (Muon's ``ns_dtype`` is the optimizer's: see build_muon).
MUON_GROUP_KEYS = tuple(k for k in _group_keys(Muon) if k != "ns_dtype")
SHAMPOO_GROUP_KEYS = _group_keys(Shampoo)


def _torchtitan_groups(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k not in _IMPLEMENTATION_KEYS} for g in param_groups]


def build_muon(param_groups: list[dict[str, Any]], *, ns_dtype: str = "bfloat16") -> Muon:
    """torchtitan's factory signature for ``"Muon"``: the container's groups (``params``,
    ``param_names``, the ``ParamGroupConfig``'s kwargs), each split into its Muon matrices and
    an AdamW group (module doc). ``ns_dtype``, from the container's
    ``optimizer_factory_kwargs_by_name["Muon"]``: ``"bfloat16"`` (Muon's) or ``"float32"``."""
    if ns_dtype not in NS_DTYPES:
        raise ValueError(f"Muon ns_dtype must be one of {tuple(NS_DTYPES)}, got {ns_dtype!r}")
    groups = []
    for group in _torchtitan_groups(param_groups):
        params, names = group.pop("params"), group.pop("param_names")
        for adamw in (False, True):
            part = [(p, n) for p, n in zip(params, names)
                    if is_muon_matrix(p, n.startswith(_BLOCKS)) != adamw]
            if part:
                groups.append({**group, "params": [p for p, _ in part],
                               "param_names": [n for _, n in part],
                               **({"algorithm": "adamw"} if adamw else {})})
    first = groups[0]
    return muon(groups, lr=first["lr"], weight_decay=first.get("weight_decay", 0.0),
                ns_dtype=NS_DTYPES[ns_dtype])


def build_shampoo(param_groups: list[dict[str, Any]]) -> Shampoo:
    """torchtitan's factory signature for ``"Shampoo"``: the container's groups, every
    parameter stepped by Shampoo with the group's kwargs."""
    return Shampoo(_torchtitan_groups(param_groups))


class ShardedOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` that also builds ``"Muon"`` (:func:`build_muon`)
    and ``"Shampoo"`` (:func:`build_shampoo`) param groups; torchtitan's own names as before."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        """``OptimizersContainer.Config``, whose ``param_groups`` may name ``"Muon"`` and
        ``"Shampoo"``."""

    @staticmethod
    def _resolve_optimizer_factory(name: str):
        ours = {"Muon": build_muon, "Shampoo": build_shampoo}
        if name in ours:
            return ours[name]
        return OptimizersContainer._resolve_optimizer_factory(name)


def from_adamw(stock: OptimizersContainer.Config, name: str,
               kwargs: Mapping[str, Any] | None = None) -> ShardedOptimizersContainer.Config:
    """An optimizer config of ours in place of ``stock``'s AdamW (torchtitan's ``default_adamw``):
    each param group as a group of ``name`` (``"muon"`` or ``"shampoo"``) with its pattern,
    ``lr`` and ``weight_decay`` (Muon's AdamW part also takes its ``betas`` and ``eps``), and
    ``kwargs`` (our optimizer's hyper-parameters) on top. Used by ``configure(optimizer=...)``;
    on its own, our optimizer steps torch FSDP2's shards.

    Raises:
        ValueError: ``name`` is not ours, ``kwargs`` are not the optimizer's, or a group is not
            AdamW (or sets more than ``lr``, ``betas``, ``eps``, ``weight_decay``).
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {tuple(OPTIMIZERS)}, got {name!r}")
    kwargs = dict(kwargs or {})
    factory = {}
    if name == "muon" and "ns_dtype" in kwargs:
        dtype = kwargs.pop("ns_dtype")
        dtype = {v: k for k, v in NS_DTYPES.items()}.get(dtype, dtype)
        if dtype not in NS_DTYPES:
            raise ValueError(f"optimizer_kwargs['ns_dtype'] must be one of {tuple(NS_DTYPES)} "
                             f"(or the torch dtype), got {dtype!r}")
        factory = {"Muon": {"ns_dtype": dtype}}
    keys = MUON_GROUP_KEYS if name == "muon" else SHAMPOO_GROUP_KEYS
    unknown = sorted(set(kwargs) - set(keys))
    if unknown:
        raise ValueError(f"optimizer_kwargs {unknown} are not {OPTIMIZERS[name]}'s: it takes "
                         f"{sorted(keys) + (['ns_dtype'] if name == 'muon' else [])}")
    groups = []
    for group in stock.param_groups:
        given = group.optimizer_kwargs
        if group.optimizer_name != "AdamW" or set(given) - set(_ADAMW):
            raise ValueError(
                f"optimizer={name!r} takes over torchtitan's AdamW param groups (lr, betas, "
                f"eps, weight_decay); the group {group.pattern!r} is {group.optimizer_name} with "
                f"{sorted(given)}: pass optimizer=None, or give that group AdamW's settings")
        adamw = {**_ADAMW, **given}
        ours: dict[str, Any] = {"lr": adamw["lr"], "weight_decay": adamw["weight_decay"]}
        if name == "muon":
            ours.update(betas=tuple(adamw["betas"]), adamw_eps=adamw["eps"])
        groups.append(ParamGroupConfig(pattern=group.pattern, optimizer_name=OPTIMIZERS[name],
                                       optimizer_kwargs={**ours, **kwargs}))
    return ShardedOptimizersContainer.Config(param_groups=groups,
                                             implementation=stock.implementation,
                                             optimizer_factory_kwargs_by_name=factory)
