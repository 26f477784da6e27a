"""A zero-copy FSDP runtime on RaggedShard DTensors with torch FSDP2's call shape.

``fully_shard(module, mesh=..., mp_policy=...)`` packs a module's parameters into one flat
buffer per unit (placed by :mod:`ragged_placement.planner`), all-gathers and reduce-scatters
each unit with one collective, and exposes sharded parameters and gradients as RaggedShard
DTensors, so stock torch optimizers, ``clip_grad_norm_`` and ``torch.distributed.checkpoint``
work on them.
"""

from ragged_placement._compat import DataParallelMeshDims
from ragged_placement.fsdp.api import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from ragged_placement.fsdp.common import CommStats
from ragged_placement.planner.sharding import StateSharding
from ragged_placement.fsdp.unit import FSDPUnit

__all__ = [
    "CPUOffloadPolicy",
    "CommStats",
    "DataParallelMeshDims",
    "FSDPModule",
    "FSDPUnit",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "StateSharding",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]
