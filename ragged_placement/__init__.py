"""ragged-placement: the ``RaggedShard`` DTensor placement and what is built on it.

Importing the package installs RaggedShard support into torch's DTensor (see
:mod:`ragged_placement._install`).
"""

from ragged_placement.placement import RaggedShard

__all__ = ["RaggedShard"]
__version__ = "0.1.0"
