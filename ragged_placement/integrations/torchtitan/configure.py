"""``configure``: a stock torchtitan ``Trainer.Config`` that trains on this package's runtime.

torchtitan 0.3.0 selects a run with ``--module M --config C``: ``C`` is a function of module
``M`` returning a ``Trainer.Config``. A user's own module wraps a stock config::

    from torchtitan.models.llama3.config_registry import llama3_8b
    from ragged_placement.integrations.torchtitan import configure

    def llama3_8b_amsp():
        return configure(llama3_8b(), state_sharding="auto", optimizer="muon")

and launches ``torchrun ... -m torchtitan.train --module my_cfg --config llama3_8b_amsp``.
What ``configure`` changes, each through an extension point torchtitan has (nothing of
torchtitan is modified or rebound):

* ``model_spec.parallelize_fn``: torchtitan's own, with our ``fully_shard`` where it applies
  FSDP (:class:`~ragged_placement.integrations.torchtitan.parallelize.Parallelize`), given the
  ``state_sharding`` and ``quant`` chosen here;
* ``optimizer``: for ``optimizer="muon"`` / ``"shampoo"``, the same param groups in a
  container that builds our optimizers (:mod:`.optimizer`); torchtitan's LR scheduler wraps them
  as it wraps AdamW;
* ``model_spec.model``: for ``fp8``, the model converter :class:`~ragged_placement.
  integrations.torchtitan.fp8.BlockFP8LinearConverter`;
* ``parallelism.spmd_backend``: torchtitan's default ``"spmd_types"`` annotates plain tensors,
  ours shards DTensors: ``"partial_dtensor"`` (DTensor for the model-parallel axes), the backend
  whose ``fully_shard`` call this runtime serves; ``"full_dtensor"`` is kept;
* the config's class: :class:`TrainerConfig`, ``Trainer.Config`` whose ``__post_init__`` (run
  again on the final config, after torchtitan's command-line overrides, before any process
  group exists) checks the combination (:func:`check`).
"""

from __future__ import annotations

import contextvars
import copy
import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torchtitan.components.quantization.utils import has_quantization
from torchtitan.trainer import Trainer

from ragged_placement.fsdp import StateSharding
from ragged_placement.integrations.torchtitan.fp8 import BlockFP8LinearConverter, fp8_configs
from ragged_placement.integrations.torchtitan.optimizer import OPTIMIZERS, from_adamw
from ragged_placement.integrations.torchtitan.parallelize import Options, Parallelize, fsdp_call_path
from ragged_placement.quant import BlockFP8Config

__all__ = ["OPTIMIZERS", "STATE_SHARDINGS", "Options", "TrainerConfig", "check", "configure"]

STATE_SHARDINGS = ("zero1", "zero2", "zero3", "hsdp", "amsp", "auto")
# torchtitan's data-parallel mesh (ParallelDims): replicate over dp_replicate (when its degree
# is above 1), shard over fsdp (dp_shard x cp, flattened).
DP_DIMS = ("dp_replicate", "fsdp")


# Set while configure builds its result: torchtitan's command line may still change every field,
# so the combination is checked when the final config is built (tyro, then Trainer.Config.build).
_CONFIGURING = contextvars.ContextVar("ragged_placement_torchtitan_configuring", default=False)


@dataclass(kw_only=True, slots=True)
class TrainerConfig(Trainer.Config):
    """torchtitan's ``Trainer.Config`` as :func:`configure` returns it: the same fields (and
    command-line options), checked by :func:`check` whenever it is built but by ``configure``
    itself (torchtitan builds it again from its command line, and ``build()`` once more)."""

    def __post_init__(self) -> None:
        Trainer.Config.__post_init__(self)
        fn = None if self.model_spec is None else self.model_spec.parallelize_fn
        if not isinstance(fn, Parallelize):
            raise ValueError("TrainerConfig.model_spec.parallelize_fn is not configure's: build "
                             "the config with ragged_placement.integrations.torchtitan.configure")
        if not _CONFIGURING.get():
            check(fn.options, self)


def _mesh_dims(parallelism) -> tuple[str, ...]:
    return DP_DIMS if parallelism.data_parallel_replicate_degree > 1 else DP_DIMS[1:]


def _is_default_sharding(choice: str | StateSharding, dims: tuple[str, ...]) -> bool:
    """Whether ``choice`` is what ``fully_shard`` does on torchtitan's mesh without one."""
    if isinstance(choice, StateSharding):
        return choice.is_default(dict.fromkeys(dims, 2))
    return choice == ("hsdp" if len(dims) == 2 else "zero3")


def check(options: Options, config: Trainer.Config) -> None:
    """Raise ``ValueError`` naming the argument (of :func:`configure`, or the torchtitan option)
    and the fix for a combination ``config`` cannot train on our runtime with ``options``."""
    par, training = config.parallelism, config.training
    if par.spmd_backend == "spmd_types":
        raise ValueError(
            "parallelism.spmd_backend='spmd_types' annotates plain tensors; ragged_placement's "
            "fully_shard shards DTensors: pass --parallelism.spmd_backend partial_dtensor "
            "(configure's choice) or full_dtensor")
    if par.enable_fsdp_symm_mem:
        raise ValueError(
            "parallelism.enable_fsdp_symm_mem: ragged_placement's all-gather writes into the "
            "parameters' own storage, which is not symmetric memory: drop "
            "--parallelism.enable_fsdp_symm_mem")
    if options.fp8 is not None and par.tensor_parallel_degree > 1:
        raise ValueError(
            f"fp8 with parallelism.tensor_parallel_degree={par.tensor_parallel_degree}: block-"
            f"wise FP8 and tensor-parallel weights do not compose in one unit yet: drop fp8 or "
            f"tensor parallelism")
    choice = options.state_sharding
    if choice is None:
        return
    dims = _mesh_dims(par)
    if choice in ("hsdp", "amsp") and len(dims) == 1:
        raise ValueError(
            f"state_sharding={choice!r} replicates the parameters over torchtitan's dp_replicate "
            f"dim, which parallelism.data_parallel_replicate_degree=1 leaves out: set it to the "
            f"number of nodes (e.g. --parallelism.data_parallel_replicate_degree 2) or pass "
            f"state_sharding='zero3'")
    if isinstance(choice, StateSharding):
        try:
            choice.validate(dict.fromkeys(dims, 2))
        except ValueError as e:
            raise ValueError(f"state_sharding={choice}: {e} (torchtitan's data-parallel mesh "
                             f"here has dims {dims})") from None
    if choice == "auto" and par.fsdp_reshard_after_forward != "default":
        raise ValueError(
            f"state_sharding='auto' chooses the blocks' reshard_after_forward, which "
            f"parallelism.fsdp_reshard_after_forward={par.fsdp_reshard_after_forward!r} fixes: "
            f"leave it 'default', or name a point (state_sharding='amsp', ...)")
    if choice == "auto" and isinstance(options.bandwidth, Mapping) \
            and sorted(options.bandwidth) != sorted(dims):
        raise ValueError(f"bandwidth must give one bytes/s per data-parallel mesh dim {dims}, "
                         f"got {dict(options.bandwidth)}")
    if _is_default_sharding(choice, dims) and choice != "auto":
        return
    shown = choice if isinstance(choice, StateSharding) else repr(choice)
    for arg, value, refused, fix in (
        ("parallelism.spmd_backend", par.spmd_backend, par.spmd_backend != "partial_dtensor",
         "--parallelism.spmd_backend partial_dtensor (its full SPMD mesh does not compose with "
         "per-state sharding yet)"),
        ("training.enable_cpu_offload", training.enable_cpu_offload,
         training.enable_cpu_offload, "no --training.enable_cpu_offload (CPU offload is not "
         "implemented for per-state sharding)"),
        ("parallelism.expert_parallel_degree", par.expert_parallel_degree,
         par.expert_parallel_degree > 1, "--parallelism.expert_parallel_degree 1 (the experts' "
         "own mesh has no per-state sharding yet)"),
        ("parallelism.pipeline_parallel_degree", par.pipeline_parallel_degree,
         par.pipeline_parallel_degree > 1, "--parallelism.pipeline_parallel_degree 1 "
         "(per-state sharding under pipeline schedules is not tested)"),
        ("parallelism.tensor_parallel_degree", par.tensor_parallel_degree,
         par.tensor_parallel_degree > 1 and choice not in ("zero1", "zero2"),
         "state_sharding='zero1' or 'zero2' (the points tested with tensor-parallel "
         "parameters), or --parallelism.tensor_parallel_degree 1"),
    ):
        if refused:
            raise ValueError(f"state_sharding={shown} with {arg}={value!r}: pass {fix}, or "
                             f"state_sharding=None")


def _check_arguments(state_sharding, optimizer, optimizer_kwargs, bandwidth, memory_budget) -> None:
    if state_sharding is not None and not isinstance(state_sharding, StateSharding) \
            and state_sharding not in STATE_SHARDINGS:
        raise ValueError(f"state_sharding must be None, one of {STATE_SHARDINGS} or a "
                         f"StateSharding of the dims {DP_DIMS}, got {state_sharding!r}")
    if optimizer is not None and optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be None (the config's own) or one of "
                         f"{tuple(OPTIMIZERS)}, got {optimizer!r}")
    if optimizer_kwargs and optimizer is None:
        raise ValueError("optimizer_kwargs are the hyper-parameters of optimizer='muon' or "
                         "'shampoo': pass optimizer too, or drop optimizer_kwargs")
    auto_only = [n for n, v in (("bandwidth", bandwidth), ("memory_budget", memory_budget))
                 if v is not None]
    if auto_only and state_sharding != "auto":
        raise ValueError(f"{auto_only[0]} is the partitioner's input: it needs "
                         f"state_sharding='auto', got {state_sharding!r}")
    if memory_budget is not None and not (isinstance(memory_budget, (int, float))
                                          and math.isfinite(memory_budget) and memory_budget > 0):
        raise ValueError(f"memory_budget must be a positive number of bytes per rank, got "
                         f"{memory_budget!r}")
    if bandwidth is not None and bandwidth != "profile" and not (
            isinstance(bandwidth, Mapping) and bandwidth
            and all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0
                    for v in bandwidth.values())):
        raise ValueError(f"bandwidth must be 'profile' or {{mesh dim: bytes/s}} (dims "
                         f"{DP_DIMS}), got {bandwidth!r}")


def _fp8_converter(fp8) -> BlockFP8LinearConverter.Config | None:
    if fp8 is None or fp8 is False:
        return None
    if fp8 is True:
        return BlockFP8LinearConverter.Config()
    if isinstance(fp8, BlockFP8Config):
        return BlockFP8LinearConverter.Config(block=fp8.block, activation_tile=fp8.activation_tile,
                                              kernel=fp8.kernel)
    if isinstance(fp8, BlockFP8LinearConverter.Config):
        return fp8
    raise ValueError(f"fp8 must be None, True, a BlockFP8Config or a BlockFP8LinearConverter."
                     f"Config, got {fp8!r}")


def configure(
    config: Trainer.Config,
    *,
    state_sharding: str | StateSharding | None = None,
    optimizer: str | None = None,
    optimizer_kwargs: Mapping[str, Any] | None = None,
    fp8: bool | BlockFP8Config | BlockFP8LinearConverter.Config | None = None,
    bandwidth: Mapping[str, float] | str | None = None,
    memory_budget: float | None = None,
) -> TrainerConfig:
    """``config`` (a stock torchtitan ``Trainer.Config``, e.g. ``llama3_8b()``), trained on
    ragged_placement's FSDP runtime; ``config`` itself is not modified.

    With no option: FSDP (HSDP with ``parallelism.data_parallel_replicate_degree`` > 1) as
    torchtitan applies it, on our ``fully_shard``; tensor, context and pipeline parallelism,
    activation checkpointing, compile, checkpoints and the training loop are torchtitan's.

    Args:
        config: the result of a torchtitan ``config_registry`` function (llama3, qwen3,
            deepseek_v3, ...: any model spec whose ``parallelize_fn`` calls torch's
            ``fully_shard`` through torchtitan's FSDP helpers).
        state_sharding: per-state sharding over torchtitan's data-parallel mesh (dims
            ``("dp_replicate", "fsdp")``, or ``("fsdp",)`` when the replicate degree is 1):
            ``"zero1"`` (optimizer state sharded), ``"zero2"`` (gradients too), ``"zero3"``
            (everything, over every dim), ``"hsdp"`` (everything over ``fsdp``, replicated
            over ``dp_replicate``), ``"amsp"`` (parameters over ``fsdp``, gradients and optimizer
            state over both), ``"auto"`` (the partitioner, :func:`~ragged_placement.planner.
            plan_state_sharding`, on the model's shapes and the mesh, as ``python -m
            ragged_placement.train --state-sharding auto`` does; it also sets the blocks'
            ``reshard_after_forward``), or a :class:`~ragged_placement.fsdp.StateSharding`
            naming those dims. ``None``: FSDP or HSDP as torchtitan's mesh says.
        optimizer: ``"muon"`` or ``"shampoo"`` (:mod:`ragged_placement.optim`, stepping on the
            shards) in place of the config's AdamW groups, with their patterns, ``lr`` and
            ``weight_decay``; Muon steps the blocks' matrices and expert stacks and runs AdamW
            (the groups' ``betas`` and ``eps``) on the rest. ``None``: the config's optimizer.
        optimizer_kwargs: more hyper-parameters of that optimizer (Muon: ``momentum``,
            ``nesterov``, ``ns_steps``, ``adjust_lr`` (default ``"match_rms_adamw"``),
            ``ns_dtype`` (``"bfloat16"`` or ``"float32"``), ...; Shampoo: ``precondition_frequency``,
            ``max_preconditioner_dim``, ``grafting``, ...).
        fp8: block-wise FP8 all-gathers and GEMMs of the Linear layers (DeepSeek-V3's recipe):
            ``True`` (128 x 128 weight blocks), a :class:`~ragged_placement.quant.BlockFP8Config`,
            or a :class:`~ragged_placement.integrations.torchtitan.fp8.BlockFP8LinearConverter.
            Config` (its ``filter_fqns`` too). A model already converted by that converter
            gathers in FP8 with its recipe without this argument.
        bandwidth: ``state_sharding="auto"`` only: ``"profile"`` (default: measured on the mesh
            at the start) or ``{mesh dim: bytes/s per rank}``.
        memory_budget: ``state_sharding="auto"`` only: bytes per rank for parameters, gradients,
            optimizer state and gathered buffers (default: the GPU's memory, or on CPU the
            machine's over the local ranks).

    Returns:
        A :class:`TrainerConfig`: torchtitan's ``Trainer.Config`` whose combination with the
        options (and torchtitan's command-line overrides) is checked when torchtitan builds the
        final config (:func:`check`), before any process group exists.

    Raises:
        TypeError: ``config`` is not a ``Trainer.Config``.
        ValueError: a bad argument (naming it and the fix), here; a combination our runtime
            does not train, when the final config is built (:func:`check`).
    """
    if isinstance(config, TrainerConfig):
        raise ValueError("config is already configure's result: call configure once, on the stock "
                         "config, with every option")
    if type(config) is not Trainer.Config:
        raise TypeError(f"config must be torchtitan's Trainer.Config (what its config_registry "
                        f"functions return), got {type(config).__name__}")
    if config.model_spec is None:
        raise ValueError("config.model_spec is None: configure needs the model spec a torchtitan "
                         "config_registry function sets (e.g. llama3_8b())")
    _check_arguments(state_sharding, optimizer, optimizer_kwargs, bandwidth, memory_budget)
    converter = _fp8_converter(fp8)
    spec = config.model_spec
    if not fsdp_call_path(spec.parallelize_fn):
        raise ValueError(f"config.model_spec.parallelize_fn {spec.parallelize_fn!r} applies no "
                         f"FSDP through torch's fully_shard that configure can run on ours")
    config = copy.deepcopy(config)
    spec = config.model_spec
    model = spec.model
    recipes = fp8_configs(model)
    if converter is not None:
        if recipes or has_quantization(model):
            raise ValueError("fp8: the model's Linear layers are already converted (by "
                             "BlockFP8LinearConverter or torchao's Float8/MXFP8/NVFP4 "
                             "converters): drop fp8, or build the model without them")
        model = converter.build().convert(model)
        recipes = fp8_configs(model)
    if len(recipes) > 1:
        raise ValueError(f"the model's BlockFP8Linear layers use {len(recipes)} recipes: one "
                         f"fully_shard quant config serves them all; convert with one")
    options = Options(state_sharding=state_sharding, optimizer=optimizer,
                      fp8=next(iter(recipes), None),
                      bandwidth="profile" if bandwidth is None else (
                          bandwidth if isinstance(bandwidth, str) else dict(bandwidth)),
                      memory_budget=None if memory_budget is None else float(memory_budget))
    if config.parallelism.spmd_backend == "spmd_types":
        config.parallelism.spmd_backend = "partial_dtensor"
    if optimizer is not None:
        config.optimizer = from_adamw(config.optimizer, optimizer, optimizer_kwargs)
    config.model_spec = dataclasses.replace(
        spec, model=model, parallelize_fn=Parallelize(spec.parallelize_fn, options))
    token = _CONFIGURING.set(True)
    try:
        return TrainerConfig(**{f.name: getattr(config, f.name)
                                for f in dataclasses.fields(Trainer.Config) if f.init})
    finally:
        _CONFIGURING.reset(token)
