"""Models and data used by the examples, tests and benchmarks."""

from ragged_placement.models.data import StdlibCorpus
from ragged_placement.models.gpt import GPT, Block, GPTConfig

__all__ = ["GPT", "Block", "GPTConfig", "StdlibCorpus"]
