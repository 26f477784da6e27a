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
from ragged_placement.planner.sharding import mesh_dims
from ragged_placement.trainer.config import MOE_DIMS, VOCAB, TrainConfig, bandwidths, dim_names
from ragged_placement.trainer.hf import hf_model

__all__ = ["NAMED_STATE_SHARDINGS", "TokenData", "build_mesh", "build_model", "build_optimizer",
           "build_scheduler", "default_memory_budget", "is_muon_matrix", "loss_fn", "moe_config",
           "muon", "new_model"]


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


def default_memory_budget(device: torch.device) -> float:
    """This rank's share of the device's memory (the partitioner's default budget): the GPU's,
    or on CPU the machine's divided by the ranks on it (``LOCAL_WORLD_SIZE``)."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / ranks


def amsp(mesh: DeviceMesh | dict[str, int]) -> StateSharding:
    """AMSP on a ``(inter, intra)`` mesh: parameters sharded over the last dim, gradients and
    optimizer state over every dim."""
    dims = tuple(mesh_dims(mesh))
    return StateSharding(params=dims[-1:], grads=dims, optim=dims)


def hsdp(mesh: DeviceMesh | dict[str, int]) -> StateSharding:
    """HSDP: every state sharded over the last dim, replicated over the others."""
    return StateSharding.hsdp(mesh, tuple(mesh_dims(mesh))[-1])


# The named points of --state-sharding (but auto) on a mesh: a DeviceMesh or {dim name: size}.
NAMED_STATE_SHARDINGS: dict[str, Callable[[Any], StateSharding]] = {
    "zero1": StateSharding.zero1, "zero2": StateSharding.zero2, "zero3": StateSharding.zero3,
    "hsdp": hsdp, "amsp": amsp,
}


def state_sharding(cfg: TrainConfig, mesh: DeviceMesh, model: nn.Module, device: torch.device
                   ) -> tuple[dict[str, Any], StateShardingPlan | None]:
    """``fully_shard``'s ``state_sharding`` (and ``reshard_after_forward``) for
    ``--state-sharding``, and the partitioner's plan for ``auto`` (collective with
    ``--bandwidth profile``). Empty for zero3 and hsdp, which are ``fully_shard``'s default on
    the mesh of :func:`build_mesh`."""
    if cfg.state_sharding in ("zero1", "zero2", "amsp"):
        return {"state_sharding": NAMED_STATE_SHARDINGS[cfg.state_sharding](mesh)}, None
    if cfg.state_sharding != "auto":
        return {}, None
    plan = plan_state_sharding(
        model, mesh, memory_budget=cfg.memory_budget or default_memory_budget(device),
        bandwidth=bandwidths(cfg),
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
    in_blocks = {id(p) for p in _blocks(model).parameters()}
    matrices = [p for p in params if is_muon_matrix(p, id(p) in in_blocks)]
    others = [p for p in params if not is_muon_matrix(p, id(p) in in_blocks)]
    return muon([{"params": matrices}, {"params": others, "algorithm": "adamw"}],
                lr=cfg.lr, weight_decay=cfg.weight_decay)


def is_muon_matrix(param: torch.Tensor, in_blocks: bool) -> bool:
    """Whether Muon steps ``param`` (else the AdamW group of :func:`muon`): the 2-D matrices and
    the 3-D stacks of expert matrices (each expert its own Newton-Schulz) of the transformer
    blocks; the embeddings, the output head, norms and biases step with AdamW."""
    return in_blocks and param.ndim in (2, 3)


def muon(param_groups: list[dict[str, Any]], *, lr: float, weight_decay: float, **kwargs: Any):
    """The trainer's :class:`~ragged_placement.optim.Muon` over ``param_groups`` (those with
    ``"algorithm": "adamw"`` hold what :func:`is_muon_matrix` leaves out): one learning rate
    for both algorithms (a group's own ``"lr"`` wins), Muon's update scaled to AdamW's RMS (``adjust_lr="match_rms_adamw"``)
    unless ``kwargs`` say otherwise; the other ``kwargs`` are Muon's."""
    from ragged_placement.optim import Muon

    return Muon(param_groups, lr=lr, weight_decay=weight_decay,
                **{"adjust_lr": "match_rms_adamw", **kwargs})


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
