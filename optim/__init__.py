"""Optimizers that step directly on RaggedShard / Shard(0) / Replicate DTensors and plain tensors.

* :class:`Muon`: momentum + Newton-Schulz orthogonalization per matrix, owners balanced by NS
  FLOPs, one batched all-to-all each way per step (none when matrices are whole on a rank);
  AdamW for ``{"algorithm": "adamw"}`` groups.
* :class:`Shampoo`: block-diagonal Shampoo with grafting; no communication when the placement
  cuts on preconditioner-block rows, otherwise row blocks are gathered to owners like Muon.
"""

from ragged_placement.optim.muon import Muon, MuonStepInfo, adjusted_lr
from ragged_placement.optim.newton_schulz import (
    DEFAULT_NS_COEFFICIENTS,
    newton_schulz,
    newton_schulz_flops,
)
from ragged_placement.optim.shampoo import Shampoo, matrix_power

__all__ = [
    "DEFAULT_NS_COEFFICIENTS",
    "Muon",
    "MuonStepInfo",
    "Shampoo",
    "adjusted_lr",
    "matrix_power",
    "newton_schulz",
    "newton_schulz_flops",
]
