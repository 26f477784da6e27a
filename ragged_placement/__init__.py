"""ragged-placement: the ``RaggedShard`` DTensor placement and what is built on it.

Importing the package installs RaggedShard support into torch's DTensor (every hook is listed in
:mod:`ragged_placement._install`): ``distribute_tensor``, ``DTensor.from_local``, ``redistribute``
to and from every placement, ``full_tensor``, element-wise and foreach ops, reductions,
``clip_grad_norm_`` and distributed checkpoint accept RaggedShard DTensors.
"""

from ragged_placement._install import install as _install
from ragged_placement.ops import RaggedMeanPartial
from ragged_placement.placement import RaggedShard

_install()

__all__ = ["RaggedShard", "RaggedMeanPartial"]
__version__ = "0.1.0"
