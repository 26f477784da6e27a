"""Hugging Face ``transformers`` causal language models for the trainer's ``--model``.

``--model hf:TYPE`` builds ``AutoModelForCausalLM`` from ``AutoConfig.for_model(TYPE, ...)``
with the sizes of ``--layers``, ``--width`` (``hidden_size``; ``intermediate_size`` is 4x),
``--heads`` and ``--seq`` (``max_position_embeddings``), the byte vocabulary and untied
embeddings; ``--model CONFIG.json`` builds it from a local ``config.json`` (its ``model_type``
and sizes; nothing is downloaded). Either needs the ``transformers`` package; every check here
runs before any process-group work and raises ``ValueError`` naming ``--model``.

The mixtures of experts ``hf:mixtral``, ``hf:qwen3_moe`` and ``hf:deepseek_v3`` (:data:`MOE_TYPES`)
take ``--experts`` routed experts of hidden size ``--width`` per MoE layer and ``--top-k`` per
token; the last ``--moe-layers`` layers are MoE (every layer for Mixtral, which has no dense
one); DeepSeek-V3 has one shared expert, one expert group, and its MLA ranks from the head
size. ``--ep N`` shards their experts by expert
(:func:`ragged_placement.parallelize.parallelize_hf_moe`). The trainer's loss is the cross
entropy of the logits: a config whose router adds an auxiliary loss (``output_router_logits``)
or noise (``router_jitter_noise``) is refused.
"""

from __future__ import annotations

import json
import os
from types import ModuleType
from typing import Any, Protocol

from torch import nn

__all__ = ["HF_PREFIX", "MOE_TYPES", "SIZE_FLAGS", "hf_config", "hf_model", "hf_moe_type",
           "is_hf"]

HF_PREFIX = "hf:"
# The options hf:TYPE takes its sizes from; a config.json has its own (they are refused with it).
SIZE_FLAGS = ("layers", "width", "heads")


class ModelOptions(Protocol):
    """The options of :class:`~ragged_placement.trainer.config.TrainConfig` that build a
    Hugging Face model (this module sits below the trainer's configuration, which asks it)."""

    model: str
    layers: int
    width: int
    heads: int
    seq: int
    experts: int
    top_k: int
    moe_layers: int
    ep: int


def _mixtral(cfg: ModelOptions) -> dict[str, Any]:
    return {"intermediate_size": cfg.width}  # Mixtral's experts' hidden size; no dense layer


def _qwen3_moe(cfg: ModelOptions) -> dict[str, Any]:
    return {"moe_intermediate_size": cfg.width, "head_dim": cfg.width // cfg.heads,
            "mlp_only_layers": list(range(cfg.layers - cfg.moe_layers))}


def _deepseek_v3(cfg: ModelOptions) -> dict[str, Any]:
    head = cfg.width // cfg.heads
    return {"moe_intermediate_size": cfg.width, "first_k_dense_replace": cfg.layers - cfg.moe_layers,
            "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "q_lora_rank": cfg.width // 2,
            "kv_lora_rank": cfg.width // 2, "qk_rope_head_dim": max(2, head // 2),
            "qk_nope_head_dim": max(2, head // 2), "v_head_dim": head}


# The mixtures of experts --ep shards by expert, and their config from the MoE flags.
MOE_TYPES = {"mixtral": _mixtral, "qwen3_moe": _qwen3_moe, "deepseek_v3": _deepseek_v3}


def is_hf(model: str) -> bool:
    """Whether ``--model`` names a Hugging Face model (``hf:TYPE`` or a ``.json`` file)."""
    return model.startswith(HF_PREFIX) or model.endswith(".json")


def _transformers(model: str) -> ModuleType:
    try:
        import transformers
    except ImportError:
        raise ValueError(
            f"--model {model!r}: Hugging Face models need the transformers package: "
            "pip install transformers (or use --model gpt or llama)"
        ) from None
    return transformers


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ValueError(f"--model {path!r}: no such file (a Hugging Face config.json)")
    try:
        with open(path) as f:
            doc = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"--model {path!r}: not valid JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("model_type"), str):
        # a bad file, not a bad argument type: the trainer's option errors are ValueErrors
        raise ValueError(  # noqa: TRY004
            f"--model {path!r}: a Hugging Face config.json needs a \"model_type\" key")
    return doc


def hf_config(cfg: ModelOptions, vocab: int) -> Any:
    """The ``transformers`` config of ``--model`` (``hf:TYPE`` or ``CONFIG.json``), checked: a
    causal LM type, a vocabulary of at least ``vocab`` tokens, positions for ``--seq``."""
    transformers = _transformers(cfg.model)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if cfg.model.startswith(HF_PREFIX):
        kind = cfg.model[len(HF_PREFIX):]
        kwargs: dict[str, Any] = {
            "model_type": kind, "vocab_size": vocab,
            "hidden_size": cfg.width, "num_hidden_layers": cfg.layers,
            "num_attention_heads": cfg.heads, "intermediate_size": 4 * cfg.width,
            "max_position_embeddings": cfg.seq, "tie_word_embeddings": False,
        }
        if kind in MOE_TYPES:
            kwargs.update(num_local_experts=cfg.experts, num_experts_per_tok=cfg.top_k,
                          num_key_value_heads=cfg.heads, **MOE_TYPES[kind](cfg))
    else:
        kwargs = _read_json(cfg.model)
    kind = kwargs.pop("model_type")
    if kind not in CONFIG_MAPPING_NAMES or kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(
            f"--model {cfg.model!r}: {kind!r} is not a causal LM model type of transformers "
            f"{transformers.__version__} (for example llama, qwen2, mistral, gpt2)"
        )
    try:
        config = transformers.AutoConfig.for_model(kind, **kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--model {cfg.model!r}: transformers refuses the config: {e}") from None
    if config.vocab_size < vocab:
        raise ValueError(f"--model {cfg.model!r}: vocab_size {config.vocab_size} < {vocab}, the "
                         "data's vocabulary (bytes)")
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and positions < cfg.seq:
        raise ValueError(f"--seq {cfg.seq} > max_position_embeddings {positions} of --model "
                         f"{cfg.model!r}")
    _check_router(cfg, config)
    # Training: no KV cache. With one, a forward recomputed by activation checkpointing appends
    # to the cache the first pass filled (DeepSeek-V3's MLA: keys of 2 x --seq positions).
    config.use_cache = False
    if kind in MOE_TYPES:
        _check_moe_config(cfg, config)
    elif cfg.ep > 1:
        raise ValueError(f"--ep {cfg.ep} with --model {cfg.model!r}: expert parallelism takes "
                         f"the mixtures of experts {', '.join(MOE_TYPES)} (or --model moe); "
                         f"{kind!r} is not one of them: drop --ep")
    return config


def hf_moe_type(model: str) -> str | None:
    """The model type of ``--model`` if it is one of :data:`MOE_TYPES` (``hf:TYPE``, or a
    config.json whose ``model_type`` is), else ``None``. Reads the file; checks nothing."""
    if model.startswith(HF_PREFIX):
        kind = model[len(HF_PREFIX):]
    elif model.endswith(".json") and os.path.isfile(model):
        try:
            with open(model) as f:
                kind = json.load(f).get("model_type")
        except (json.JSONDecodeError, AttributeError):
            return None
    else:
        return None
    return kind if kind in MOE_TYPES else None


def _check_router(cfg: ModelOptions, config: Any) -> None:
    """No router auxiliary loss (the trainer's loss is the logits' cross entropy) and no router
    noise (drawn per rank, which is not one process's), in any mixture of experts."""
    if getattr(config, "output_router_logits", False):
        raise ValueError(f"--model {cfg.model!r}: output_router_logits is true, which adds the "
                         f"router's auxiliary loss to transformers' own loss; the trainer's loss is "
                         f"the cross entropy of the logits and would leave it out: set "
                         f"output_router_logits to false")
    if getattr(config, "router_jitter_noise", 0):
        raise ValueError(f"--model {cfg.model!r}: router_jitter_noise "
                         f"{config.router_jitter_noise} draws noise per rank, which no one-process "
                         f"run reproduces: set it to 0")


def _check_moe_config(cfg: ModelOptions, config: Any) -> None:
    """A MoE config of :data:`MOE_TYPES` the trainer trains as one process would: top-k within
    the experts, whole experts per ep rank (``--fp8`` with it:
    :data:`ragged_placement.combinations.REFUSED`)."""
    experts, top_k = config.num_local_experts, config.num_experts_per_tok
    if top_k > experts:
        raise ValueError(f"--model {cfg.model!r}: num_experts_per_tok {top_k} exceeds the "
                         f"{experts} experts: a token cannot be routed to more experts than exist")
    if experts % cfg.ep:
        raise ValueError(f"--ep {cfg.ep} does not divide the {experts} experts of --model "
                         f"{cfg.model!r}: each ep rank owns whole experts, an equal number each; "
                         f"pick --ep among the divisors of {experts}")


def hf_model(cfg: ModelOptions, vocab: int) -> nn.Module:
    """``AutoModelForCausalLM`` of :func:`hf_config`, initialised by ``transformers`` from the
    current RNG state (on the current default device: ``meta`` allocates nothing)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_config(hf_config(cfg, vocab))
