"""What the trainer trains: the model (torchtitan's recipe), the data, the optimizer and schedule.

The model is built on the meta device; each transformer block is (optionally) activation
checkpointed, ``fully_shard``-ed (ours or torch's) and (optionally) compiled, then the root;
``to_empty`` materializes each rank's shards and the initial weights, drawn on CPU from
``--seed`` the same way on every rank, are loaded from a full state dict. The parameters'
values therefore do not depend on the runtime, the mesh or the world size.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_PREFIX,
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ragged_placement.fsdp import StateSharding
from ragged_placement.models import GPT, GPTConfig, StdlibCorpus
from ragged_placement.models.llama import Llama, LlamaConfig
from ragged_placement.models.moe import MoEConfig, MoETransformer
from ragged_placement.parallelize import parallelize_hf_moe, parallelize_moe
from ragged_placement.planner import StateShardingPlan, plan_state_sharding
from ragged_placement.trainer.config import MOE_DIMS, VOCAB, TrainConfig, bandwidths, dim_names
from ragged_placement.trainer.hf import hf_model

__all__ = ["TokenData", "build_mesh", "build_model", "build_optimizer", "build_scheduler",
           "loss_fn", "moe_config", "new_model"]


def moe_config(cfg: TrainConfig) -> MoEConfig:
    """The :class:`MoEConfig` of ``--model moe``: ``--layers`` blocks, the last
    ``--moe-layers`` of them MoE blocks of ``--experts`` routed experts (``--top-k`` per token)
    and one shared expert, each expert a SwiGLU of hidden size ``--width``; the dense blocks'
    SwiGLU has ``4 x --width``, as ``--model llama``'s."""
    return MoEConfig(vocab_size=VOCAB, dim=cfg.width, n_layers=cfg.layers,
                     n_dense_layers=cfg.layers - cfg.moe_layers, n_heads=cfg.heads,
                     hidden_dim=4 * cfg.width, moe_hidden_dim=cfg.width,
                     num_experts=cfg.experts, top_k=cfg.top_k)


def new_model(cfg: TrainConfig) -> nn.Module:
    """The unsharded model of ``--model``: ``gpt``, ``llama``, ``moe`` or a Hugging Face causal
    LM (``hf:TYPE`` or a ``config.json``, :mod:`ragged_placement.trainer.hf`)."""
    if cfg.model == "gpt":
        return GPT(GPTConfig(vocab_size=VOCAB, block_size=cfg.seq, n_layer=cfg.layers,
                             n_head=cfg.heads, n_embd=cfg.width))
    if cfg.model == "llama":
        return Llama(LlamaConfig(vocab_size=VOCAB, dim=cfg.width, n_layers=cfg.layers,
                                 n_heads=cfg.heads, hidden_dim=4 * cfg.width))
    if cfg.model == "moe":
        return MoETransformer(moe_config(cfg))
    return hf_model(cfg, VOCAB)


def _blocks(model: nn.Module) -> nn.Module:
    """The container of the transformer blocks: ``model.layers`` (GPT, Llama),
    ``model.model.layers`` (Hugging Face Llama-like models) or ``model.transformer.h`` (GPT-2)."""
    for owner in (model, getattr(model, "model", None), getattr(model, "transformer", None)):
        for attr in ("layers", "h"):
            blocks = getattr(owner, attr, None)
            if isinstance(blocks, (nn.ModuleList, nn.ModuleDict)):
                return blocks
    raise ValueError(f"--model: cannot find the transformer blocks of {type(model).__name__}")


def build_mesh(cfg: TrainConfig, device: torch.device, world_size: int) -> DeviceMesh:
    """The data-parallel mesh: ``--mesh`` (default: all ranks in one dim); ``zero3`` shards over
    every rank (a 2-D mesh is flattened), ``hsdp`` replicates over the first dim. ``--model moe``
    and ``--ep`` > 1: ``(ranks / ep, ep)``, dims ``dp_mod_ep`` and ``ep`` (each ep group
    consecutive ranks)."""
    if cfg.model == "moe" or cfg.ep > 1:  # --ep > 1: also a Hugging Face mixture of experts
        return init_device_mesh(device.type, (world_size // cfg.ep, cfg.ep),
                                mesh_dim_names=MOE_DIMS)
    shape, names = cfg.mesh or (world_size,), dim_names(cfg)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    if cfg.state_sharding == "zero3" and len(shape) == 2:
        return mesh._flatten("_".join(names))
    return mesh


def _shard_fn(cfg: TrainConfig) -> tuple[Callable, dict]:
    """``fully_shard`` of ``--runtime`` and its keyword arguments from the options."""
    param_dtype = torch.bfloat16 if cfg.precision == "bf16" else None
    if cfg.runtime == "ours":
        from ragged_placement.fsdp import MixedPrecisionPolicy, fully_shard
        kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype, torch.float32)}
        if cfg.fp8:
            from ragged_placement.quant import BlockFP8Config
            kwargs["quant"] = BlockFP8Config()
        return fully_shard, kwargs
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    return fully_shard, {"mp_policy": MixedPrecisionPolicy(param_dtype, torch.float32)}


def _memory_budget(cfg: TrainConfig, device: torch.device) -> float:
    """``--memory-budget``, or (0) this rank's share of the device's memory: the GPU's, or on
    CPU the machine's divided by the ranks on it."""
    if cfg.memory_budget:
        return cfg.memory_budget
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / ranks


def state_sharding(cfg: TrainConfig, mesh: DeviceMesh, model: nn.Module, device: torch.device
                   ) -> tuple[dict[str, Any], StateShardingPlan | None]:
    """``fully_shard``'s ``state_sharding`` (and ``reshard_after_forward``) for
    ``--state-sharding``, and the partitioner's plan for ``auto`` (collective with
    ``--bandwidth profile``). Empty for zero3 and hsdp, which are ``fully_shard``'s default on
    the mesh of :func:`build_mesh`."""
    names = tuple(mesh.mesh_dim_names)
    if cfg.state_sharding == "zero1":
        return {"state_sharding": StateSharding.zero1(mesh)}, None
    if cfg.state_sharding == "zero2":
        return {"state_sharding": StateSharding.zero2(mesh)}, None
    if cfg.state_sharding == "amsp":
        return {"state_sharding": StateSharding(params=names[-1:], grads=names, optim=names)}, None
    if cfg.state_sharding != "auto":
        return {}, None
    plan = plan_state_sharding(
        model, mesh, memory_budget=_memory_budget(cfg, device), bandwidth=bandwidths(cfg),
        optimizer=cfg.optimizer, param_dtype=torch.bfloat16 if cfg.precision == "bf16" else None,
        **_routing(cfg))
    return {"state_sharding": plan.sharding,
            "reshard_after_forward": plan.reshard_after_forward}, plan


def _routing(cfg: TrainConfig) -> dict[str, int]:
    """The partitioner's expert-parallel inputs for ``--model moe``: the mesh's ``ep`` dim (of
    size ``--ep``, which the EP group fills: the innermost dim), the tokens each rank routes
    per step and ``--top-k``; nothing for a dense model."""
    if cfg.model != "moe":
        return {}
    return {"ep": cfg.ep, "tokens_per_rank": cfg.batch * cfg.seq, "top_k": cfg.top_k}


def build_model(cfg: TrainConfig, mesh: DeviceMesh, device: torch.device
                ) -> tuple[nn.Module, StateShardingPlan | None]:
    """The sharded model with the initial weights of ``--seed`` (torchtitan's recipe), and the
    partitioner's plan (``--state-sharding auto``) or ``None``."""
    shard, kwargs = _shard_fn(cfg)
    with torch.device("meta"):
        model = new_model(cfg)
    extra, plan = state_sharding(cfg, mesh, model, device)
    kwargs.update(extra)
    blocks = _blocks(model)
    for name, block in list(blocks.named_children()):
        if cfg.activation_checkpointing:
            block = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
            blocks.register_module(name, block)
        if cfg.model != "moe" and cfg.ep == 1:
            shard(block, mesh=mesh, **kwargs)
    # experts by expert over ep, FSDP beside it; the rest over all ranks
    if cfg.model == "moe":
        parallelize_moe(model, mesh, ep_dim=MOE_DIMS[1], shard_fn=shard, **kwargs)
    elif cfg.ep > 1:  # a Hugging Face mixture of experts
        parallelize_hf_moe(model, mesh, blocks.children(), ep_dim=MOE_DIMS[1], shard_fn=shard,
                           **kwargs)
    else:
        shard(model, mesh=mesh, **kwargs)
    for block in blocks.values() if cfg.compile else ():
        block.compile()
    model.to_empty(device=device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        init = new_model(cfg)
    set_model_state_dict(model, init.state_dict(), options=StateDictOptions(full_state_dict=True))
    _copy_non_persistent_buffers(init, model)
    return model, plan


def _copy_non_persistent_buffers(source: nn.Module, target: nn.Module) -> None:
    """Buffers outside the state dict (a rotary embedding's ``inv_freq``), which ``to_empty``
    left uninitialised, from the model built on CPU."""
    unwrapped = {name.replace(_CHECKPOINT_PREFIX, ""): module
                 for name, module in target.named_modules()}
    for name, module in source.named_modules():
        for buf in module._non_persistent_buffers_set:
            if getattr(module, buf) is not None:
                getattr(unwrapped[name], buf).copy_(getattr(module, buf))


def build_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    """``--optimizer``: AdamW; Muon on the blocks' matrices (AdamW for the rest); Shampoo."""
    params = list(model.parameters())
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=True)
    if cfg.optimizer == "shampoo":
        from ragged_placement.optim import Shampoo
        return Shampoo(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    from ragged_placement.optim import Muon
    in_blocks = {id(p) for p in _blocks(model).parameters()}
    # 2-D matrices, and 3-D stacks of expert matrices (each expert its own Newton-Schulz)
    is_matrix = [p.ndim in (2, 3) and id(p) in in_blocks for p in params]
    matrices = [p for p, m in zip(params, is_matrix) if m]
    others = [p for p, m in zip(params, is_matrix) if not m]
    return Muon([{"params": matrices},
                 {"params": others, "algorithm": "adamw", "lr": cfg.lr}],
                lr=cfg.lr, weight_decay=cfg.weight_decay, adjust_lr="match_rms_adamw")


def build_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over ``--warmup`` steps, then cosine decay to ``--min-lr-ratio`` of the
    learning rate at ``--steps``."""
    def factor(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class TokenData:
    """Batches of ``--data``: the stdlib corpus (bytes) or a token file (a ``torch.save``-d 1-D
    integer tensor, or raw ``uint16`` tokens in a ``.bin`` file as nanoGPT writes them). The
    global batch of a step is drawn from ``(seed, step)``, so the data position is the step."""

    corpus: StdlibCorpus
    cfg: TrainConfig

    def __init__(self, cfg: TrainConfig) -> None:
        stdlib = cfg.data == "stdlib"
        self.corpus = StdlibCorpus(max_bytes=cfg.data_bytes if stdlib else 1)
        if not stdlib:
            tokens = _read_tokens(cfg.data)
            n_val = max(1, len(tokens) // 10)
            self.corpus.train, self.corpus.val = tokens[:-n_val], tokens[-n_val:]
        self.cfg = cfg

    def batch(self, step: int, rank: int, world: int, split: str = "train"
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of the global batch of ``step``."""
        per = self.cfg.batch
        x, y = self.corpus.batch(step, per * world, self.cfg.seq, split=split, seed=self.cfg.seed)
        return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def _read_tokens(path: str) -> torch.Tensor:
    if path.endswith(".bin"):
        with open(path, "rb") as f:
            tokens = torch.frombuffer(bytearray(f.read()), dtype=torch.uint16)
    else:
        tokens = torch.load(path, weights_only=True)
    if not isinstance(tokens, torch.Tensor) or tokens.ndim != 1 or tokens.is_floating_point():
        raise ValueError(f"--data {path}: expected a 1-D integer tensor of token ids")
    if tokens.numel() and int(tokens.max()) >= VOCAB:
        raise ValueError(f"--data {path}: token id {int(tokens.max())} >= vocabulary {VOCAB}")
    return tokens.long()


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy (fp32 logits)."""
    out = model(x)
    logits = getattr(out, "logits", out)  # Hugging Face models return an output object
    return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
