"""The trainer's options: one dataclass, filled from a TOML file and/or command-line flags.

Every option has a flag (``--checkpoint-every``) and a TOML key (``checkpoint_every``, at the top
level or in any table: ``[training]``, ``[model]``... are only grouping). Flags override the file.
Every value is checked here, before any process-group work, and a bad one raises ``ValueError``
naming the flag and the value.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from dataclasses import dataclass
from typing import Any

from ragged_placement.combinations import Feature, Given, check_combinations
from ragged_placement.trainer.hf import SIZE_FLAGS, hf_config, hf_moe_type, is_hf

__all__ = ["RUNTIMES", "STATE_SHARDINGS", "TrainConfig", "bandwidths", "check_world",
           "dim_names", "features", "parse_config"]

RUNTIMES = ("ours", "fsdp2")
STATE_SHARDINGS = ("zero3", "hsdp", "zero1", "zero2", "amsp", "auto")
# Per-state sharding: a StateSharding other than the mesh's default (--runtime ours only).
PER_STATE = ("zero1", "zero2", "amsp", "auto")
# The partitioner's inputs: only --state-sharding auto uses them.
_AUTO_ONLY = ("memory_budget", "bandwidth")
# The mixture of experts' options: only --model moe uses them.
# The mesh of --model moe: the data-parallel ranks outside each ep group, and the ep group.
MOE_DIMS = ("dp_mod_ep", "ep")
_MOE_ONLY = ("experts", "top_k", "moe_layers", "ep")
OPTIMIZERS = ("adamw", "muon", "shampoo")
PRECISIONS = ("fp32", "bf16")
DEVICES = ("auto", "cpu", "cuda")
VOCAB = 256  # byte-level data
_VAL_FRACTION = 0.1  # StdlibCorpus's validation split
_MAX_SEED = 2**40


@dataclass
class TrainConfig:
    """Every option of ``python -m ragged_placement.train`` (flag ``--x-y`` is field ``x_y``)."""

    # run
    steps: int = 100
    seed: int = 0
    log_every: int = 10
    output: str | None = None
    metrics: str | None = None
    val_batches: int = 0
    device: str = "auto"
    collective_timeout: float = 60.0
    # checkpoints
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    # parallelism
    runtime: str = "ours"
    state_sharding: str = "zero3"
    mesh: tuple[int, ...] | None = None
    mesh_dim_names: tuple[str, ...] | None = None
    memory_budget: float = 0.0
    bandwidth: str = "profile"
    # model
    model: str = "gpt"
    layers: int = 2
    width: int = 64
    heads: int = 2
    seq: int = 64
    # mixture of experts (--model moe)
    experts: int = 8
    top_k: int = 2
    moe_layers: int = 1
    ep: int = 1
    # data
    data: str = "stdlib"
    data_bytes: int = 1 << 20
    batch: int = 4
    # optimization
    optimizer: str = "adamw"
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 0
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    precision: str = "fp32"
    activation_checkpointing: bool = False
    compile: bool = False
    fp8: bool = False

    def fingerprint(self) -> dict[str, Any]:
        """The options a checkpoint must agree with to be resumed (the model, the data, the
        optimizer and the schedule); the others (logging, outputs, runtime) may change."""
        keys = ("seed", "model", "layers", "width", "heads", "seq", "data", "data_bytes", "batch",
                "optimizer", "lr", "min_lr_ratio", "warmup", "weight_decay", "grad_clip",
                "precision", "steps")
        if self.model == "moe" or self.model.startswith("hf:") and hf_moe_type(self.model):
            keys += ("experts", "top_k", "moe_layers")  # the experts' shape; --ep is the layout
        return {k: getattr(self, k) for k in keys}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _mesh(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--mesh must look like 4 or 2x2, got {text!r}") from None
    if not dims or any(d <= 0 for d in dims):
        raise ValueError(f"--mesh sizes must be positive, got {text!r}")
    return dims


def _names(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(","))


# --help: one line per option (docs/train.md has the long form).
_HELP = {
    "steps": "training steps",
    "seed": "seed of the initial weights and of the batches",
    "log_every": "log a line every N steps (loss, tokens/s, memory, bytes sent)",
    "output": "rank 0 torch.saves the final full model state dict to FILE",
    "metrics": "rank 0 writes the run's measurements to FILE (JSON)",
    "val_batches": "validation batches after training (0: none)",
    "device": "auto | cpu | cuda (auto: cuda:LOCAL_RANK and NCCL when CUDA is available)",
    "collective_timeout": "seconds a collective may wait for a dead or frozen rank",
    "checkpoint_dir": "save DCP checkpoints here, resume from the newest complete one",
    "checkpoint_every": "save every K steps (needs --checkpoint-dir)",
    "runtime": "ours | fsdp2 (ragged_placement's fully_shard or torch's)",
    "state_sharding": "zero3 | hsdp | zero1 | zero2 | amsp | auto (the partitioner's choice)",
    "mesh": "data-parallel mesh shape, e.g. 4 or 2x2 (none: all ranks, 1-D)",
    "mesh_dim_names": "comma separated, e.g. inter,intra",
    "memory_budget": "--state-sharding auto: bytes per rank (0: the device's memory)",
    "bandwidth": "--state-sharding auto: profile, or bytes/s per mesh dim: inter=1.25e8,intra=1e10",
    "model": "gpt | llama | moe | hf:TYPE | a Hugging Face config.json",
    "layers": "transformer blocks",
    "width": "hidden size",
    "heads": "attention heads",
    "seq": "sequence length",
    "experts": "--model moe: routed experts per MoE layer",
    "top_k": "--model moe: experts per token",
    "moe_layers": "--model moe: MoE blocks, the last ones (the first --layers minus this are dense)",
    "ep": "--model moe: expert-parallel degree (ranks per ep group; divides --experts and the ranks)",
    "data": "stdlib (the Python standard library's .py sources as bytes) or a token file",
    "data_bytes": "bytes of the stdlib corpus",
    "batch": "sequences per rank per step",
    "optimizer": "adamw | muon | shampoo",
    "lr": "peak learning rate",
    "min_lr_ratio": "the cosine schedule ends at lr x this",
    "warmup": "linear warmup steps",
    "weight_decay": "decoupled weight decay",
    "grad_clip": "clip the gradients' global norm to this (0: off)",
    "precision": "fp32 | bf16 (bf16 parameters, fp32 gradient reduction)",
    "activation_checkpointing": "checkpoint each block's activations",
    "compile": "torch.compile each block",
    "fp8": "block-wise FP8 linears and all-gathers (--runtime ours)",
}

_METAVARS = {"steps": "N", "seed": "N", "log_every": "N", "output": "FILE", "metrics": "FILE",
             "val_batches": "N", "collective_timeout": "SECONDS", "checkpoint_every": "K",
             "memory_budget": "BYTES", "data_bytes": "N", "experts": "E", "top_k": "K",
             "moe_layers": "N", "ep": "N"}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m ragged_placement.train",
        description="Train a model under torchrun with ragged_placement's FSDP or torch FSDP2.",
        argument_default=argparse.SUPPRESS,
        epilog="Every option is also a key of the --config TOML file. See docs/train.md.",
    )
    ap.add_argument("--config", metavar="FILE",
                    help="a TOML file of options (keys: the flags' names with _)")
    for f in dataclasses.fields(TrainConfig):
        default = "none" if f.default is None else f.default
        text = f"{_HELP[f.name]} (default: {default})"
        if f.type == "bool":
            ap.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, help=text)
        else:
            metavar = _METAVARS.get(f.name, f.name.split("_")[-1].upper())
            ap.add_argument(_flag(f.name), type=str, metavar=metavar, help=text)
    return ap


def _load_toml(path: str) -> dict[str, Any]:
    if sys.version_info < (3, 11):
        raise ValueError(f"--config {path}: TOML files need Python 3.11 (tomllib); pass flags instead")
    import tomllib

    if not os.path.isfile(path):
        raise ValueError(f"--config {path}: no such file")
    with open(path, "rb") as f:
        try:
            doc = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"--config {path}: not valid TOML: {e}") from None
    flat: dict[str, Any] = {}
    for key, value in doc.items():
        items = value.items() if isinstance(value, dict) else [(key, value)]
        for k, v in items:
            if k in flat:
                raise ValueError(f"--config {path}: option {k!r} is given twice")
            flat[k] = v
    return flat


def _convert(name: str, value: Any, kind: type) -> Any:
    """``value`` (a TOML value or a flag's string) as the field's type, or a ValueError."""
    if name == "mesh":
        return _mesh(str(value))
    if name == "mesh_dim_names":
        return tuple(value) if isinstance(value, list) else _names(str(value))
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            raise TypeError
        if kind is int and isinstance(value, float) or isinstance(value, bool):
            raise TypeError
        return kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"{_flag(name)} must be {kind.__name__}, got {value!r}") from None


_TYPES = {"int": int, "float": float, "str": str, "bool": bool, "str | None": str}


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """The options of ``argv`` (and of its ``--config`` file), checked."""
    args = vars(_parser().parse_args(argv))
    values: dict[str, Any] = _load_toml(args.pop("config")) if "config" in args else {}
    values.update(args)
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    kwargs = {}
    for name, value in values.items():
        if name not in fields:
            raise ValueError(f"--config: unknown option {name!r} (flag {_flag(name)} does not exist)")
        kwargs[name] = _convert(name, value, _TYPES.get(str(fields[name].type), str))
    cfg = TrainConfig(**kwargs)
    auto_only = [n for n in _AUTO_ONLY if n in kwargs]
    if auto_only and cfg.state_sharding != "auto":
        raise ValueError(f"{_flag(auto_only[0])} is the partitioner's input: it needs "
                         f"--state-sharding auto, got {cfg.state_sharding!r}")
    _check_moe_flags_given(cfg, [n for n in _MOE_ONLY if n in kwargs])
    sizes = [n for n in SIZE_FLAGS if n in kwargs]
    if cfg.model.endswith(".json") and sizes:
        raise ValueError(f"{_flag(sizes[0])}: --model {cfg.model!r} takes its sizes from the file;"
                         f" drop {_flag(sizes[0])} or use --model hf:TYPE")
    check_config(cfg)
    return cfg


def _check_moe_flags_given(cfg: TrainConfig, given: list[str]) -> None:
    """The MoE flags go with --model moe or a Hugging Face mixture of experts (hf:TYPE takes
    them all but --moe-layers for Mixtral, whose layers are all MoE; a config.json takes --ep
    only: its experts are in the file)."""
    kind = hf_moe_type(cfg.model) if is_hf(cfg.model) else None
    if kind is None:
        allowed: tuple[str, ...] = _MOE_ONLY if cfg.model == "moe" else ()
    elif cfg.model.endswith(".json"):
        allowed = ("ep",)
    else:
        allowed = tuple(n for n in _MOE_ONLY if not (kind == "mixtral" and n == "moe_layers"))
    refused = [n for n in given if n not in allowed]
    if refused:
        flag = _flag(refused[0])
        raise ValueError(f"{flag} is an option of --model moe, got --model {cfg.model!r}: pass "
                         f"--model moe or a Hugging Face mixture of experts (hf:mixtral, "
                         f"hf:qwen3_moe, hf:deepseek_v3; a config.json takes --ep only, Mixtral no "
                         f"--moe-layers: its layers are all MoE), or drop {flag}")


def _choice(cfg: TrainConfig, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(cfg, name)
    if value not in choices:
        raise ValueError(f"{_flag(name)} must be one of {', '.join(choices)}, got {value!r}")


def _positive(cfg: TrainConfig, name: str, *, zero_ok: bool = False) -> None:
    """A finite number ``> 0`` (``>= 0`` with ``zero_ok``): ``nan`` and ``inf`` are refused."""
    value = getattr(cfg, name)
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        finite = "a finite number " if isinstance(value, float) else ""
        raise ValueError(f"{_flag(name)} must be {finite}{bound}, got {value!r}")


def _check_shapes(cfg: TrainConfig) -> None:
    """What the model and the data need of the sizes: heads dividing the width, and splits of
    the stdlib corpus longer than a sequence."""
    if not cfg.model.endswith(".json") and cfg.width % cfg.heads:  # a config.json has its own
        raise ValueError(f"--heads {cfg.heads} must divide --width {cfg.width} (each head gets "
                         f"width / heads features): pass e.g. --heads "
                         f"{max(d for d in range(1, cfg.heads) if cfg.width % d == 0)}")
    if cfg.data == "stdlib":
        n_val = max(1, int(cfg.data_bytes * _VAL_FRACTION))
        split = min(n_val, cfg.data_bytes - n_val) if cfg.val_batches else cfg.data_bytes - n_val
        if split <= cfg.seq + 1:
            raise ValueError(f"--data-bytes {cfg.data_bytes} is too small for --seq {cfg.seq}: "
                             f"each split must hold more than {cfg.seq + 1} bytes "
                             f"(validation gets {_VAL_FRACTION:g} of them)")


def check_config(cfg: TrainConfig) -> None:
    """Raise ``ValueError`` naming the flag of the first bad option of ``cfg``."""
    for name, choices in (("runtime", RUNTIMES), ("state_sharding", STATE_SHARDINGS),
                          ("optimizer", OPTIMIZERS), ("precision", PRECISIONS),
                          ("device", DEVICES)):
        _choice(cfg, name, choices)
    for name in ("steps", "log_every", "layers", "width", "heads", "seq", "batch", "lr",
                 "collective_timeout", "data_bytes", "experts", "top_k", "moe_layers", "ep"):
        _positive(cfg, name)
    for name in ("seed", "checkpoint_every", "warmup", "val_batches", "weight_decay", "grad_clip",
                 "min_lr_ratio", "memory_budget"):
        _positive(cfg, name, zero_ok=True)
    if cfg.seed >= _MAX_SEED:  # the batches' generator is seeded with seed * 1_000_003 + step
        raise ValueError(f"--seed must be < 2**40, got {cfg.seed}")
    _check_shapes(cfg)
    if cfg.min_lr_ratio > 1:
        raise ValueError(f"--min-lr-ratio must be in [0, 1], got {cfg.min_lr_ratio}")
    if cfg.checkpoint_every and not cfg.checkpoint_dir:
        raise ValueError("--checkpoint-every needs --checkpoint-dir")
    if cfg.model == "moe":  # first: its mesh is not --mesh
        _check_moe(cfg)
    elif cfg.model.startswith("hf:") and hf_moe_type(cfg.model):
        _check_moe_sizes(cfg)
    if cfg.model != "moe" and cfg.ep > 1:  # a Hugging Face mixture of experts (hf_config checks)
        _check_ep_mesh(cfg)
    _check_mesh(cfg)
    check_combinations(features(cfg))
    _check_state_sharding(cfg)
    if is_hf(cfg.model):
        hf_config(cfg, VOCAB)
    elif cfg.model not in ("gpt", "llama", "moe"):
        raise ValueError(f"--model must be gpt, llama, moe, hf:TYPE or a Hugging Face "
                         f"config.json, got {cfg.model!r}")
    if cfg.data != "stdlib" and not os.path.isfile(cfg.data):
        raise ValueError(f"--data must be 'stdlib' or a token file, got {cfg.data!r} (no such file)")


def check_world(cfg: TrainConfig, world_size: int) -> None:
    """Raise ``ValueError`` if ``--mesh`` does not cover the job's ``world_size`` ranks, or
    ``--ep`` does not divide them."""
    if cfg.mesh is not None and math.prod(cfg.mesh) != world_size:
        raise ValueError(f"--mesh {'x'.join(map(str, cfg.mesh))} needs {math.prod(cfg.mesh)} "
                         f"ranks, the job has {world_size}")
    if world_size % cfg.ep:
        raise ValueError(f"--ep {cfg.ep} must divide the job's {world_size} ranks (the mesh is "
                         f"ranks / ep x ep): pass --ep among the divisors of {world_size} that "
                         f"divide --experts {cfg.experts}")


def _check_moe(cfg: TrainConfig) -> None:
    """What ``--model moe`` needs: whole experts per ep rank, top-k within the experts, MoE
    blocks within the layers; and what does not compose with it yet (named, not ignored)."""
    _check_moe_sizes(cfg)
    if cfg.experts % cfg.ep:
        raise ValueError(f"--ep {cfg.ep} does not divide --experts {cfg.experts}: each ep rank "
                         f"owns whole experts, an equal number each; pick --ep among the divisors "
                         f"of {cfg.experts}")
    _check_ep_mesh(cfg)


def _check_moe_sizes(cfg: TrainConfig) -> None:
    """Top-k within the experts, MoE blocks within the layers (``--model moe``, and the
    Hugging Face mixtures of experts built from the flags)."""
    if cfg.top_k > cfg.experts:
        raise ValueError(f"--top-k {cfg.top_k} exceeds --experts {cfg.experts}: a token cannot be "
                         f"routed to more experts than exist; pass --top-k <= {cfg.experts}")
    if cfg.moe_layers > cfg.layers:
        raise ValueError(f"--moe-layers {cfg.moe_layers} exceeds --layers {cfg.layers}: pass "
                         f"--moe-layers <= {cfg.layers} (the first --layers minus it are dense)")


def _check_ep_mesh(cfg: TrainConfig) -> None:
    """The mesh of expert parallelism is (ranks / ep, ep): what does not fit it."""
    if cfg.mesh is not None:
        raise ValueError(f"--mesh {'x'.join(map(str, cfg.mesh))} with --model {cfg.model}: the mesh "
                         f"is (ranks / ep, ep), set by --ep; drop --mesh")
    if cfg.state_sharding == "hsdp":
        raise ValueError(f"--state-sharding hsdp with --model {cfg.model}: the mesh is (ranks / "
                         f"ep, ep) and the experts are sharded by expert over ep; replicate with "
                         f"--state-sharding zero1 or zero2, or shard the parameters inside ep "
                         f"groups with amsp")


def _check_mesh(cfg: TrainConfig) -> None:
    if cfg.mesh_dim_names is not None:
        if cfg.mesh is None:
            raise ValueError("--mesh-dim-names needs --mesh")
        if len(cfg.mesh_dim_names) != len(cfg.mesh) or len(set(cfg.mesh_dim_names)) != len(cfg.mesh):
            raise ValueError(
                f"--mesh-dim-names must give {len(cfg.mesh)} distinct names for --mesh "
                f"{'x'.join(map(str, cfg.mesh))}, got {','.join(cfg.mesh_dim_names)!r}"
            )
    ndim = 1 if cfg.mesh is None else len(cfg.mesh)
    if cfg.state_sharding == "hsdp" and ndim != 2:
        raise ValueError(
            "--state-sharding hsdp needs a 2-D --mesh (replicate over the first dim, shard over "
            f"the second), got {'none' if cfg.mesh is None else 'x'.join(map(str, cfg.mesh))}"
        )
    if ndim > 2:
        raise ValueError(f"--mesh must have 1 or 2 dims, got {'x'.join(map(str, cfg.mesh))}")


def dim_names(cfg: TrainConfig) -> tuple[str, ...]:
    """The mesh's dim names: ``--mesh-dim-names``, else ``replicate,shard`` (2-D) or ``dp``;
    ``--model moe``: :data:`MOE_DIMS`."""
    if cfg.model == "moe":
        return MOE_DIMS
    if cfg.mesh_dim_names is not None:
        return cfg.mesh_dim_names
    return ("replicate", "shard") if cfg.mesh is not None and len(cfg.mesh) == 2 else ("dp",)


def bandwidths(cfg: TrainConfig) -> dict[str, float] | str:
    """``--bandwidth``: ``"profile"`` or ``{dim name: bytes/s}`` from ``inter=1.25e8,intra=1e10``
    (one positive value per mesh dim)."""
    if cfg.bandwidth == "profile":
        return "profile"
    names, out = dim_names(cfg), {}
    for item in cfg.bandwidth.split(","):
        name, _, value = item.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            out[name.strip()] = math.nan
    if sorted(out) != sorted(names) or not all(math.isfinite(v) and v > 0 for v in out.values()):
        raise ValueError(f"--bandwidth must be 'profile' or one positive bytes/s per mesh dim "
                         f"({','.join(f'{n}=...' for n in names)}), got {cfg.bandwidth!r}")
    return out


def features(cfg: TrainConfig) -> dict[Feature, Given]:
    """The features of :data:`ragged_placement.combinations.REFUSED` the options turn on, in
    their flags' words (checked by :func:`check_config`, before any process group)."""
    hf_experts = is_hf(cfg.model) and hf_moe_type(cfg.model) is not None
    flags = (
        (Feature.TORCH_FSDP2, cfg.runtime == "fsdp2", "--runtime fsdp2", "pass --runtime ours"),
        (Feature.STATE_SHARDING, cfg.state_sharding in PER_STATE,
         f"--state-sharding {cfg.state_sharding}", "pass --state-sharding zero3"),
        (Feature.QUANT, cfg.fp8, "--fp8", "drop --fp8"),
        (Feature.EXPERT_PARALLEL, cfg.ep > 1, f"--ep {cfg.ep}", "pass --ep 1"),
        (Feature.MATRIX_OPTIMIZER, cfg.optimizer in ("muon", "shampoo"),
         f"--optimizer {cfg.optimizer}", "pass --optimizer adamw"),
        (Feature.HF_EXPERTS, hf_experts, f"--model {cfg.model!r}", "pass --model moe"),
    )
    return {f: Given(spelling, fix) for f, on, spelling, fix in flags if on}


def _check_state_sharding(cfg: TrainConfig) -> None:
    if cfg.state_sharding == "amsp" and cfg.model != "moe" and len(cfg.mesh or ()) != 2:
        raise ValueError(
            "--state-sharding amsp needs a 2-D --mesh (inter, intra: parameters sharded over "
            f"intra, gradients and optimizer state over both), got "
            f"{'none' if cfg.mesh is None else 'x'.join(map(str, cfg.mesh))}"
        )
    if cfg.state_sharding == "auto":
        bandwidths(cfg)
