"""torchtitan's ``parallelize_fn`` with this package's ``fully_shard`` where it applies FSDP.

torchtitan 0.3.0 applies FSDP inside each model's ``parallelize_fn`` (``ModelSpec.
parallelize_fn``: ``parallelize_llama``, ``parallelize_qwen3``, ``parallelize_deepseekv3``...),
after tensor and context parallelism, activation checkpointing and ``torch.compile``, through
helpers (``apply_fsdp_to_decoder``, ``apply_fsdp_to_mtp_decoder``) that call
``torch.distributed.fsdp.fully_shard``, a name each helper's module imported. No option selects
another FSDP implementation.

:class:`Parallelize` is a ``parallelize_fn`` that runs torchtitan's own, the same code on the
same arguments, so everything but FSDP is torchtitan's (pipeline parallelism too: its
``pipelining_fn`` calls the spec's ``parallelize_fn`` on each stage). Only the ``fully_shard``
its FSDP calls reach differs: :func:`with_fully_shard` copies the functions on the call path
from the ``parallelize_fn`` to torch's ``fully_shard`` (each function object, with its own code,
defaults and closure, over a copy of its module's namespace) with that name bound to
:class:`FullyShard` in the copies. torchtitan's modules and functions are left as they are:
every other caller, and a torch FSDP2 run in the same process, still reaches torch's.
"""

from __future__ import annotations

import dis
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import CodeType, FunctionType
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from ragged_placement.fsdp import FSDPModule, StateSharding, fully_shard
from ragged_placement.planner import StateShardingPlan, plan_state_sharding
from ragged_placement.quant import BlockFP8Config
from ragged_placement.trainer.build import NAMED_STATE_SHARDINGS, default_memory_budget

__all__ = ["FullyShard", "Options", "Parallelize", "fsdp_call_path", "with_fully_shard"]


@dataclass(frozen=True)
class Options:
    """What :func:`~ragged_placement.integrations.torchtitan.configure` chose (its arguments,
    checked), held by the config's :class:`Parallelize`."""

    state_sharding: str | StateSharding | None = None
    optimizer: str | None = None
    fp8: BlockFP8Config | None = None
    bandwidth: Mapping[str, float] | str = "profile"
    memory_budget: float | None = None


_PARAM_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _global_names(code: CodeType) -> set[str]:
    """The names ``code`` and the functions defined in it may load as globals (a superset:
    ``co_names`` also lists attribute names)."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, CodeType):
            names |= _global_names(const)
    return names


def _stores_globals(code: CodeType) -> bool:
    if any(i.opname in ("STORE_GLOBAL", "DELETE_GLOBAL") for i in dis.get_instructions(code)):
        return True
    return any(_stores_globals(c) for c in code.co_consts if isinstance(c, CodeType))


def fsdp_call_path(fn: Callable, target: Callable = torch_fully_shard) -> list[FunctionType]:
    """The functions through which ``fn`` calls ``target`` by a global name, ``fn`` first: the
    Python functions reachable from ``fn`` through the globals of its own module and of
    torchtitan's modules that reach ``target``. Empty when ``fn`` does not reach it."""
    if not isinstance(fn, FunctionType):
        return []
    scope = (fn.__module__, "torchtitan.")
    callees: dict[int, list[FunctionType]] = {}
    direct: set[int] = set()
    by_id: dict[int, FunctionType] = {}
    stack = [fn]
    while stack:
        f = stack.pop()
        if id(f) in by_id:
            continue
        by_id[id(f)] = f
        names = _global_names(f.__code__)
        values = [f.__globals__[n] for n in names if n in f.__globals__]
        if any(v is target for v in values):
            direct.add(id(f))
        callees[id(f)] = [v for v in values if isinstance(v, FunctionType)
                          and (v.__module__ or "").startswith(scope)]
        stack.extend(callees[id(f)])
    reaches = set(direct)
    grew = True
    while grew:
        grew = False
        for i, fs in callees.items():
            if i not in reaches and any(id(c) in reaches for c in fs):
                reaches.add(i)
                grew = True
    if id(fn) not in reaches:
        return []
    return [fn] + [f for i, f in by_id.items() if i in reaches and f is not fn]


def with_fully_shard(fn: Callable, replacement: Callable,
                     target: Callable = torch_fully_shard) -> FunctionType:
    """A copy of ``fn`` whose calls of ``target`` (torch's ``fully_shard``), made directly or
    through the functions of :func:`fsdp_call_path`, call ``replacement``; ``fn`` and its
    modules are not modified.

    Raises:
        ValueError: ``fn`` does not reach ``target`` through global names, or a function on the
            path assigns a global (a copy of its namespace would not see the assignment).
    """
    path = fsdp_call_path(fn, target)
    if not path:
        raise ValueError(
            f"{getattr(fn, '__qualname__', fn)!r} does not call torch's fully_shard through its "
            f"module's globals (or torchtitan's): there is no FSDP call to run on ours")
    for f in path:
        if _stores_globals(f.__code__):
            raise ValueError(f"{f.__module__}.{f.__qualname__} assigns a global: its FSDP calls "
                             f"cannot be redirected without changing its module")
    namespaces: dict[int, dict[str, Any]] = {}
    copies: dict[int, FunctionType] = {}
    for f in path:
        namespace = namespaces.setdefault(id(f.__globals__), dict(f.__globals__))
        copy = FunctionType(f.__code__, namespace, f.__name__, f.__defaults__, f.__closure__)
        copy.__kwdefaults__ = None if f.__kwdefaults__ is None else dict(f.__kwdefaults__)
        copies[id(f)] = functools.update_wrapper(copy, f)
    for f in path:
        namespace = copies[id(f)].__globals__
        for name in _global_names(f.__code__):
            value = f.__globals__.get(name)
            if value is target:
                namespace[name] = replacement
            elif id(value) in copies and value is not None:
                namespace[name] = copies[id(value)]
    return copies[id(fn)]


class FullyShard:
    """What torchtitan's FSDP calls reach through :class:`Parallelize`: this package's
    ``fully_shard`` with torchtitan's arguments, plus the configured ``state_sharding`` (the
    partitioner's plan, made at the first call from the model and the mesh torchtitan passes,
    for ``"auto"``) and block-wise FP8 ``quant``.

    One instance serves one ``parallelize_fn`` call (one model part)."""

    options: Options
    model: nn.Module
    param_dtype: torch.dtype | None
    blocks: set[int]
    sharding: StateSharding | None
    plan: StateShardingPlan | None
    calls: int

    def __init__(self, options: Options, model: nn.Module, param_dtype: torch.dtype | None
                 ) -> None:
        self.options = options
        self.model = model
        self.param_dtype = param_dtype
        layers = getattr(model, "layers", None)
        self.blocks = {id(b) for b in layers.values()} if isinstance(layers, nn.ModuleDict) else set()
        self.sharding = None
        self.plan = None
        self.calls = 0

    def _resolve(self, mesh: DeviceMesh) -> None:
        """The state sharding of every unit, on torchtitan's data-parallel ``mesh``."""
        choice = self.options.state_sharding
        if choice is None:
            return
        if isinstance(choice, StateSharding):
            self.sharding = choice
        elif choice != "auto":
            self.sharding = NAMED_STATE_SHARDINGS[choice](mesh)
        else:
            self.plan = self._plan(mesh)
            self.sharding = self.plan.sharding
        if self.sharding.is_default(mesh):
            self.sharding = None  # fully_shard's own default: no argument, the same runtime

    def _plan(self, mesh: DeviceMesh) -> StateShardingPlan:
        from torchtitan.tools.logging import logger

        opts = self.options
        budget = opts.memory_budget or default_memory_budget(torch.device(mesh.device_type))
        units = [m for m in self.model.modules() if id(m) in self.blocks]
        plan = plan_state_sharding(self.model, mesh, memory_budget=budget,
                                   bandwidth=opts.bandwidth, optimizer=opts.optimizer or "adamw",
                                   param_dtype=self.param_dtype, units=units)
        if torch.distributed.get_rank() == 0:
            logger.info(f"ragged_placement: state_sharding='auto' chose {plan.sharding}, "
                        f"reshard_after_forward={plan.reshard_after_forward} on {plan.mesh}; "
                        f"predicted communication {sum(plan.comm_seconds.values()):.4g} s/step:\n"
                        f"{plan.table()}")
        return plan

    def __call__(self, module: nn.Module | list[nn.Module], **kwargs: Any):
        if self.calls == 0:
            self._resolve(kwargs.get("mesh"))
        self.calls += 1
        if self.sharding is not None:
            kwargs["state_sharding"] = self.sharding
        if self.plan is not None and id(module) in self.blocks:
            kwargs["reshard_after_forward"] = self.plan.reshard_after_forward
        if self.options.fp8 is not None:
            kwargs["quant"] = self.options.fp8
        return fully_shard(module, **kwargs)


class Parallelize:
    """A torchtitan ``parallelize_fn``: the model spec's own, with this package's ``fully_shard``
    (:class:`FullyShard`) where it applies FSDP (module doc). Built by
    :func:`~ragged_placement.integrations.torchtitan.configure`.

    Args:
        parallelize_fn: the stock ``ModelSpec.parallelize_fn``.
        options: the checked choices of ``configure``.
    """

    parallelize_fn: Callable[..., nn.Module]
    options: Options

    def __init__(self, parallelize_fn: Callable[..., nn.Module], options: Options) -> None:
        self.parallelize_fn = parallelize_fn
        self.options = options

    def __call__(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        from torchtitan.tools.logging import logger

        training = kwargs.get("training")
        param_dtype = _PARAM_DTYPES.get(getattr(training, "mixed_precision_param", None))
        shard = FullyShard(self.options, model, param_dtype)
        model = with_fully_shard(self.parallelize_fn, shard)(model, **kwargs)
        torch_units = [name for name, m in model.named_modules()
                       if isinstance(m, TorchFSDPModule) and not isinstance(m, FSDPModule)]
        if torch_units or shard.calls == 0:
            raise RuntimeError(
                f"{self.parallelize_fn.__qualname__} applied torch FSDP2 to {torch_units} "
                f"(not through a name configure redirects) or no FSDP at all "
                f"({shard.calls} calls of ours): the model is not on ragged_placement's runtime")
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            logger.info(f"ragged_placement: fully_shard on {shard.calls} units, state_sharding="
                        f"{shard.sharding or 'the mesh default'}, quant={self.options.fp8}")
        return model

    def __repr__(self) -> str:
        return f"Parallelize({self.parallelize_fn.__module__}.{self.parallelize_fn.__qualname__})"
