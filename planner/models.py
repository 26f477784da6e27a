"""Parameter shapes of real models, grouped into FSDP units, from published configs.

``fsdp_units(name, config)`` returns ``[(unit_name, [(param_name, shape), ...]), ...]``: the
token embedding, one unit per transformer layer, and the head (final norm and, unless tied,
the output projection). Linear weights are ``[out_features, in_features]``. MoE experts are
either separate matrices per expert or stacked ``[E, out, in]`` tensors.

Covered families: GPT-2 (fused qkv, LayerNorm with bias), Llama-style (Llama 3.1, Qwen2.5 with
qkv bias, Mixtral and Qwen3 MoE), DeepSeek-V3 and Kimi K2 (MLA attention, dense then MoE layers
with a shared expert and a router bias; names starting ``deepseek`` or ``kimi``) and GPT-OSS
(biased attention with sinks, fused gate/up experts with biases; names starting ``gpt-oss``). The multi-token-prediction module of DeepSeek-V3 is not included.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["MODELS_JSON", "fsdp_units", "load_configs"]

#: The package's own file of public model configurations (GPT-2, Llama 3.1, Qwen2.5, Mixtral,
#: DeepSeek-V3), shipped with it.
MODELS_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models.json")

Shape = tuple[int, ...]
Unit = tuple[str, list[tuple[str, Shape]]]

# GPT-2 has 1024 learned positions (not part of the configs in models.json).
GPT2_POSITIONS = 1024


def load_configs(path: str = MODELS_JSON) -> dict[str, dict[str, Any]]:
    """The model configs of a models.json file, by default :data:`MODELS_JSON` (keys starting
    with ``_`` are skipped)."""
    with open(path) as fh:
        data = json.load(fh)
    return {k: v for k, v in data.items() if not k.startswith("_")}


def _experts(prefix: str, e: int, inter: int, hidden: int, stacked: bool) -> list[tuple[str, Shape]]:
    if stacked:
        return [
            (f"{prefix}.experts.gate_proj", (e, inter, hidden)),
            (f"{prefix}.experts.up_proj", (e, inter, hidden)),
            (f"{prefix}.experts.down_proj", (e, hidden, inter)),
        ]
    out = []
    for i in range(e):
        out += [
            (f"{prefix}.experts.{i}.gate_proj", (inter, hidden)),
            (f"{prefix}.experts.{i}.up_proj", (inter, hidden)),
            (f"{prefix}.experts.{i}.down_proj", (hidden, inter)),
        ]
    return out


def _gpt2_layer(p: str, h: int) -> list[tuple[str, Shape]]:
    return [
        (f"{p}.ln_1.weight", (h,)), (f"{p}.ln_1.bias", (h,)),
        (f"{p}.attn.c_attn.weight", (3 * h, h)), (f"{p}.attn.c_attn.bias", (3 * h,)),
        (f"{p}.attn.c_proj.weight", (h, h)), (f"{p}.attn.c_proj.bias", (h,)),
        (f"{p}.ln_2.weight", (h,)), (f"{p}.ln_2.bias", (h,)),
        (f"{p}.mlp.c_fc.weight", (4 * h, h)), (f"{p}.mlp.c_fc.bias", (4 * h,)),
        (f"{p}.mlp.c_proj.weight", (h, 4 * h)), (f"{p}.mlp.c_proj.bias", (h,)),
    ]


def _llama_layer(p: str, c: Mapping[str, Any], stacked: bool) -> list[tuple[str, Shape]]:
    h, hd = c["hidden"], c["head_dim"]
    q, kv = c["heads"] * hd, c["kv_heads"] * hd
    out = [
        (f"{p}.input_layernorm.weight", (h,)),
        (f"{p}.self_attn.q_proj.weight", (q, h)),
        (f"{p}.self_attn.k_proj.weight", (kv, h)),
        (f"{p}.self_attn.v_proj.weight", (kv, h)),
    ]
    if c.get("qkv_bias"):
        out += [(f"{p}.self_attn.q_proj.bias", (q,)), (f"{p}.self_attn.k_proj.bias", (kv,)),
                (f"{p}.self_attn.v_proj.bias", (kv,))]
    out += [(f"{p}.self_attn.o_proj.weight", (h, q)), (f"{p}.post_attention_layernorm.weight", (h,))]
    inter = c["intermediate"]
    if c.get("experts"):
        out.append((f"{p}.mlp.gate.weight", (c["experts"], h)))
        out += _experts(f"{p}.mlp", c["experts"], inter, h, stacked)
    else:
        out += [(f"{p}.mlp.gate_proj.weight", (inter, h)), (f"{p}.mlp.up_proj.weight", (inter, h)),
                (f"{p}.mlp.down_proj.weight", (h, inter))]
    return out


def _deepseek_layer(p: str, c: Mapping[str, Any], moe: bool, stacked: bool) -> list[tuple[str, Shape]]:
    h, heads = c["hidden"], c["heads"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    ql, kvl = c["q_lora_rank"], c["kv_lora_rank"]
    out = [
        (f"{p}.input_layernorm.weight", (h,)),
        (f"{p}.self_attn.q_a_proj.weight", (ql, h)),
        (f"{p}.self_attn.q_a_layernorm.weight", (ql,)),
        (f"{p}.self_attn.q_b_proj.weight", (heads * (nope + rope), ql)),
        (f"{p}.self_attn.kv_a_proj_with_mqa.weight", (kvl + rope, h)),
        (f"{p}.self_attn.kv_a_layernorm.weight", (kvl,)),
        (f"{p}.self_attn.kv_b_proj.weight", (heads * (nope + v), kvl)),
        (f"{p}.self_attn.o_proj.weight", (h, heads * v)),
        (f"{p}.post_attention_layernorm.weight", (h,)),
    ]
    if not moe:
        inter = c["intermediate"]
        return out + [(f"{p}.mlp.gate_proj.weight", (inter, h)),
                      (f"{p}.mlp.up_proj.weight", (inter, h)),
                      (f"{p}.mlp.down_proj.weight", (h, inter))]
    e, mi = c["experts"], c["moe_intermediate"]
    si = mi * c.get("shared_experts", 1)
    out += [(f"{p}.mlp.gate.weight", (e, h)), (f"{p}.mlp.gate.e_score_correction_bias", (e,))]
    out += _experts(f"{p}.mlp", e, mi, h, stacked)
    out += [(f"{p}.mlp.shared_experts.gate_proj.weight", (si, h)),
            (f"{p}.mlp.shared_experts.up_proj.weight", (si, h)),
            (f"{p}.mlp.shared_experts.down_proj.weight", (h, si))]
    return out


def _gpt_oss_layer(p: str, c: Mapping[str, Any], stacked: bool) -> list[tuple[str, Shape]]:
    """A GPT-OSS layer: attention with biases and sinks, a biased router, and experts with a
    fused gate/up projection ``[E, 2F, H]`` and biases (``F`` = ``intermediate``)."""
    h, hd, e, f = c["hidden"], c["head_dim"], c["experts"], c["intermediate"]
    q, kv = c["heads"] * hd, c["kv_heads"] * hd
    out = [(f"{p}.input_layernorm.weight", (h,))]
    for proj, rows, cols in (("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, q)):
        out += [(f"{p}.self_attn.{proj}.weight", (rows, cols)), (f"{p}.self_attn.{proj}.bias", (rows,))]
    out += [(f"{p}.self_attn.sinks", (c["heads"],)), (f"{p}.post_attention_layernorm.weight", (h,)),
            (f"{p}.mlp.router.weight", (e, h)), (f"{p}.mlp.router.bias", (e,))]
    if stacked:
        return out + [
            (f"{p}.mlp.experts.gate_up_proj", (e, 2 * f, h)),
            (f"{p}.mlp.experts.gate_up_proj_bias", (e, 2 * f)),
            (f"{p}.mlp.experts.down_proj", (e, h, f)),
            (f"{p}.mlp.experts.down_proj_bias", (e, h)),
        ]
    for i in range(e):
        out += [(f"{p}.mlp.experts.{i}.gate_up_proj.weight", (2 * f, h)),
                (f"{p}.mlp.experts.{i}.gate_up_proj.bias", (2 * f,)),
                (f"{p}.mlp.experts.{i}.down_proj.weight", (h, f)),
                (f"{p}.mlp.experts.{i}.down_proj.bias", (h,))]
    return out


def fsdp_units(name: str, config: Mapping[str, Any], stacked_experts: bool = True) -> list[Unit]:
    """FSDP units of model ``name``: embeddings, each layer, head (see the module docstring)."""
    h, vocab, layers = config["hidden"], config["vocab"], config["layers"]
    gpt2 = name.startswith("gpt2")
    if gpt2:
        units: list[Unit] = [("embed", [("wte.weight", (vocab, h)), ("wpe.weight", (GPT2_POSITIONS, h))])]
    else:
        units = [("embed", [("embed_tokens.weight", (vocab, h))])]
    for i in range(layers):
        p = f"layers.{i}"
        if gpt2:
            params = _gpt2_layer(p, h)
        elif name.startswith("gpt-oss"):
            params = _gpt_oss_layer(p, config, stacked_experts)
        elif name.startswith(("deepseek", "kimi")):
            params = _deepseek_layer(p, config, i >= config.get("dense_layers", 0), stacked_experts)
        else:
            params = _llama_layer(p, config, stacked_experts)
        units.append((p, params))
    head = [("ln_f.weight", (h,)), ("ln_f.bias", (h,))] if gpt2 else [("norm.weight", (h,))]
    if not config.get("tied_embeddings"):
        head.append(("lm_head.weight", (vocab, h)))
    units.append(("head", head))
    return units
