"""Block-wise FP8 references the quant tests share: DeepSeek-V3's block formula, one block at a
time (``formula``), and the unit ``test_quant_sharded`` lays out for the sharded gather
(``PARAMS``, ``S``, ``WORLD``).
"""

from __future__ import annotations

import math

import torch

from ragged_placement.quant import FlatParam

FP8 = torch.float8_e4m3fn
TINY = torch.finfo(torch.float32).tiny


def formula(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's block formula, one block at a time (no padding, no reshapes)."""
    m, n = w.shape
    bm, bn = block
    w = w.float()
    q = torch.empty(m, n, dtype=FP8)
    s = torch.empty(math.ceil(m / bm), math.ceil(n / bn))
    for i in range(0, m, bm):
        for j in range(0, n, bn):
            blk = w[i : i + bm, j : j + bn]
            scale = torch.clamp_min(blk.abs().max() / torch.tensor(448.0), TINY)
            s[i // bm, j // bn] = scale
            q[i : i + bm, j : j + bn] = torch.clamp(blk / scale, -448.0, 448.0).to(FP8)
    return q, s


S, WORLD = 65536, 4


# A unit as a 128-row-granularity planner would lay it out (S = 65536 elements per rank):
#   w1 [384, 256] at 0        -> rank 0 rows [0, 256), rank 1 rows [256, 384)
#   w2 [200, 256] at 98304    -> rank 1 rows [0, 128), rank 2 rows [128, 200) (ragged edge block)
#   norm [256] at 149504      -> rank 2 (gathered in bf16)
#   w3 [384, 128] at 196608   -> rank 3, then a bias [300] and 16084 elements of padding
PARAMS = [
    FlatParam("w1", (384, 256), 0, True),
    FlatParam("w2", (200, 256), 98304, True),
    FlatParam("norm", (256,), 149504, False),
    FlatParam("w3", (384, 128), 196608, True),
    FlatParam("bias", (300,), 245760, False),
]
