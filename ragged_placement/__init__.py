"""ragged-placement: the ``RaggedShard`` DTensor placement and what is built on it.

Importing the package installs RaggedShard support into torch's DTensor (every patched torch
attribute is a row of :data:`ragged_placement._install.PATCHES`; :func:`uninstall` restores them
all): ``distribute_tensor``, ``DTensor.from_local``, the factories, random ops, ``redistribute``
to and from every placement, ``full_tensor``, element-wise and foreach ops, reductions,
``clip_grad_norm_`` and distributed checkpoint accept RaggedShard DTensors.
"""

from ragged_placement import transforms  # noqa: F401 - attaches RaggedShard's transform methods
from ragged_placement._install import install, uninstall
from ragged_placement.ops import RaggedMeanPartial
from ragged_placement.placement import RaggedShard

install()

__all__ = ["RaggedShard", "RaggedMeanPartial", "install", "uninstall"]
__version__ = "0.1.0"
