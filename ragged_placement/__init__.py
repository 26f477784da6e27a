"""ragged-placement: the ``RaggedShard`` DTensor placement and what is built on it.

Importing the package changes nothing in torch. The first ``RaggedShard`` made installs
RaggedShard support into torch's DTensor (every patched torch attribute is a row of
:data:`ragged_placement._install.PATCHES`, each a wrapper that passes calls without a RaggedShard
to torch's own function; :func:`uninstall` restores them all): ``distribute_tensor``,
``DTensor.from_local``, the factories, random ops, ``redistribute`` to and from every placement,
``full_tensor``, element-wise and foreach ops, reductions, ``clip_grad_norm_`` and distributed
checkpoint accept RaggedShard DTensors. :func:`one_worker_gloo` is the opt-in for gloo process
groups that this package's collectives overlap on (torch's two worker threads per group race).
"""

from ragged_placement._install import install, uninstall, warn_if_untested  # first: see placement
from ragged_placement import transforms  # noqa: F401 - attaches RaggedShard's transform methods
from ragged_placement._gloo import one_worker_gloo
from ragged_placement.ops import RaggedMeanPartial
from ragged_placement.placement import RaggedShard

warn_if_untested()

__all__ = ["RaggedShard", "RaggedMeanPartial", "install", "one_worker_gloo", "uninstall"]
__version__ = "0.1.0"
