"""torchtitan (0.3.0) on ragged_placement's runtime, from torchtitan's own configuration.

:func:`configure` takes a stock ``Trainer.Config`` and returns one whose FSDP is this package's,
with per-state sharding (AMSP, the partitioner), Muon or Shampoo on the shards and block-wise FP8
all-gathers to choose; every change goes through an extension point torchtitan has (its config
registries, the model spec's ``parallelize_fn``, its optimizer container, its model converters).
See docs/torchtitan.md.
"""

from ragged_placement.integrations.torchtitan.configure import (
    OPTIMIZERS,
    STATE_SHARDINGS,
    Options,
    TrainerConfig,
    check,
    configure,
)
from ragged_placement.integrations.torchtitan.fp8 import BlockFP8Linear, BlockFP8LinearConverter
from ragged_placement.integrations.torchtitan.optimizer import ShardedOptimizersContainer, from_adamw
from ragged_placement.integrations.torchtitan.parallelize import Parallelize

__all__ = [
    "OPTIMIZERS",
    "STATE_SHARDINGS",
    "BlockFP8Linear",
    "BlockFP8LinearConverter",
    "Options",
    "Parallelize",
    "ShardedOptimizersContainer",
    "TrainerConfig",
    "check",
    "configure",
    "from_adamw",
]
