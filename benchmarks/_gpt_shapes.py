"""The block matrices of a GPT-style model of ``ragged_placement/planner/models.json`` (optim.py,
shampoo.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ragged_placement.planner.models import MODELS_JSON  # noqa: F401 - the scripts' default


def block_matrices(config: Mapping[str, Any], layers: int) -> list[tuple[int, int]]:
    """``layers`` x (fused qkv ``[q + 2 kv, h]``, attention proj ``[h, h]``, MLP up
    ``[f, h]``, MLP down ``[h, f]``) of a model config from ``models.json``."""
    h, f = config["hidden"], config["intermediate"]
    qkv = (config["heads"] + 2 * config["kv_heads"]) * config["head_dim"]
    return [s for _ in range(layers) for s in [(qkv, h), (h, h), (f, h), (h, f)]]
