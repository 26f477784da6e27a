"""The block matrices of a GPT-style model in ``shared/models.json`` (optim.py, shampoo.py)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

MODELS_JSON = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "models.json"
)


def block_matrices(config: Mapping[str, Any], layers: int) -> list[tuple[int, int]]:
    """``layers`` x (fused qkv ``[q + 2 kv, h]``, attention proj ``[h, h]``, MLP up
    ``[f, h]``, MLP down ``[h, f]``) of a model config from ``models.json``."""
    h, f = config["hidden"], config["intermediate"]
    qkv = (config["heads"] + 2 * config["kv_heads"]) * config["head_dim"]
    return [s for _ in range(layers) for s in [(qkv, h), (h, h), (f, h), (h, f)]]
