"""Structure-aware planner: block-aligned RaggedShard placements for every parameter.

``plan(named_shapes, world_size, granularity)`` lays the parameters of one FSDP unit out in a
flat buffer of ``world_size`` equal chunks so that no chunk boundary cuts a granularity block,
with the least padding it can find, and gives each parameter the :class:`RaggedShard` those
boundaries induce. See :mod:`.packing` for the algorithm and its lower bound.

``plan_state_sharding(model, mesh, memory_budget)`` chooses how far to shard parameters,
gradients and optimizer state (a :class:`~ragged_placement.planner.StateSharding`) from a memory
and communication model (:mod:`.state_sharding`).
"""

from ragged_placement.planner.granularity import CutSpec, Granularity, GranularityPolicy
from ragged_placement.planner.layout import FlatLayout
from ragged_placement.planner.packing import chunk_lower_bound
from ragged_placement.planner.plan import Plan, Segment, plan, plan_units
from ragged_placement.planner.profile import profile_mesh
from ragged_placement.planner.segments import SegmentedPlan, layers_per_unit, plan_segmented
from ragged_placement.planner.sharding import StateSharding
from ragged_placement.planner.state_sharding import (
    ShardingCandidate,
    StateShardingPlan,
    plan_state_sharding,
)
from ragged_placement.planner.uneven import (
    UnevenPlan,
    gather_starts,
    plan_uneven,
    shard0_padding,
)

__all__ = [
    "plan", "plan_units", "plan_segmented", "Plan", "SegmentedPlan", "Segment", "Granularity",
    "GranularityPolicy", "CutSpec", "chunk_lower_bound", "UnevenPlan", "plan_uneven",
    "shard0_padding", "layers_per_unit", "plan_state_sharding", "StateShardingPlan",
    "ShardingCandidate", "profile_mesh", "gather_starts", "FlatLayout", "StateSharding",
]
