"""Models and data used by the examples, tests and benchmarks."""

from ragged_placement.models.data import StdlibCorpus
from ragged_placement.models.gpt import GPT, Block, GPTConfig
from ragged_placement.models.moe import MoEConfig, MoETransformer, parallelize_moe

__all__ = [
    "GPT", "Block", "GPTConfig", "MoEConfig", "MoETransformer", "StdlibCorpus", "parallelize_moe",
]
