"""Hugging Face ``transformers`` causal language models for the trainer's ``--model``.

``--model hf:TYPE`` builds ``AutoModelForCausalLM`` from ``AutoConfig.for_model(TYPE, ...)``
with the sizes of ``--layers``, ``--width`` (``hidden_size``; ``intermediate_size`` is 4x),
``--heads`` and ``--seq`` (``max_position_embeddings``), the byte vocabulary and untied
embeddings; ``--model CONFIG.json`` builds it from a local ``config.json`` (its ``model_type``
and sizes; nothing is downloaded). Either needs the ``transformers`` package; every check here
runs before any process-group work and raises ``ValueError`` naming ``--model``.
"""

from __future__ import annotations

import json
import os
from types import ModuleType
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from ragged_placement.trainer.config import TrainConfig

__all__ = ["HF_PREFIX", "SIZE_FLAGS", "hf_config", "hf_model", "is_hf"]

HF_PREFIX = "hf:"
# The options hf:TYPE takes its sizes from; a config.json has its own (they are refused with it).
SIZE_FLAGS = ("layers", "width", "heads")


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


def hf_config(cfg: TrainConfig, vocab: int) -> Any:
    """The ``transformers`` config of ``--model`` (``hf:TYPE`` or ``CONFIG.json``), checked: a
    causal LM type, a vocabulary of at least ``vocab`` tokens, positions for ``--seq``."""
    transformers = _transformers(cfg.model)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if cfg.model.startswith(HF_PREFIX):
        kwargs: dict[str, Any] = {
            "model_type": cfg.model[len(HF_PREFIX):], "vocab_size": vocab,
            "hidden_size": cfg.width, "num_hidden_layers": cfg.layers,
            "num_attention_heads": cfg.heads, "intermediate_size": 4 * cfg.width,
            "max_position_embeddings": cfg.seq, "tie_word_embeddings": False,
        }
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
    return config


def hf_model(cfg: TrainConfig, vocab: int) -> nn.Module:
    """``AutoModelForCausalLM`` of :func:`hf_config`, initialised by ``transformers`` from the
    current RNG state (on the current default device: ``meta`` allocates nothing)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_config(hf_config(cfg, vocab))
