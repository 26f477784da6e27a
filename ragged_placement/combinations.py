"""The feature combinations ragged_placement refuses: one table, and the check every entry
point runs before it builds anything.

Each entry point that can turn several features on (:func:`ragged_placement.fsdp.fully_shard`,
``parallelize_moe`` and ``parallelize_hf_moe``, the trainer's options) says which of
:class:`Feature` a call turns on, each as a :class:`Given`: how that call spelled it (``"quant=BlockFP8Config(...)"``, ``"--runtime fsdp2"``) and how to turn it off in the
same words (``"drop quant"``, ``"pass --runtime ours"``). :func:`check_combinations` raises the
error of the first row of :data:`REFUSED` whose features are all given, before any process group
or collective, naming the caller's arguments, the reason and the fixes::

    --optimizer muon with --runtime fsdp2 and --ep 2 is not supported: torch FSDP2 lays out an
    expert-parallel stack as _StridedShard over the data-parallel and ep dims, which
    ragged_placement.optim's Muon and Shampoo do not take; pass --optimizer adamw, or pass
    --runtime ours, or pass --ep 1

A row is a combination refused wherever it can be reached; an entry point that cannot express
one of a row's features never meets that row. Nothing else in the package refuses a combination
of features (a single argument's bad value is checked where the argument is read).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["REFUSED", "Feature", "Given", "Refusal", "check_combinations"]


class Feature(enum.Enum):
    """A feature an entry point turns on; the value says what it is."""

    TORCH_FSDP2 = "torch's fully_shard shards the model"
    STATE_SHARDING = "per-state sharding: a StateSharding other than the mesh's default"
    QUANT = "block-wise FP8 all-gathers and linears"
    DP_MESH_DIMS = "fully_shard on a full SPMD mesh (dp_mesh_dims)"
    CPU_OFFLOAD = "the sharded state on CPU (CPUOffloadPolicy)"
    INT_RESHARD = "an int reshard_after_forward (reshard to a smaller group after forward)"
    OTHER_MESH = "a shard_placement_fn placing parameters on another mesh (ShardPlacementResult)"
    GRANULARITY = "the planner's granularity policy"
    EXPERT_PARALLEL = "experts sharded by expert over an ep mesh dim of more than one rank"
    MATRIX_OPTIMIZER = "ragged_placement.optim's Muon or Shampoo"
    HF_EXPERTS = "a transformers mixture of experts (its experts stored as stacked tensors)"


@dataclass(frozen=True)
class Given:
    """A feature as one call turned it on.

    Attributes:
        spelling: the argument and value that turned it on, in the caller's words.
        fix: how to turn it off in the same words (``"drop quant"``).
    """

    spelling: str
    fix: str


@dataclass(frozen=True)
class Refusal:
    """A refused combination: refused when every feature of ``features`` is given.

    Attributes:
        features: the combination, in the order the message names them.
        reason: why it is refused (what would go wrong, or what is not built yet).
        error: the exception type raised (``ValueError`` unless the peer raises another).
    """

    features: tuple[Feature, ...]
    reason: str
    error: type[Exception] = ValueError

    def message(self, given: Mapping[Feature, Given]) -> str:
        """The error's text for ``given`` (which holds every feature of the row)."""
        first, *rest = (given[f].spelling for f in self.features)
        fixes = ", or ".join(given[f].fix for f in self.features)
        return f"{first} with {' and '.join(rest)} is not supported: {self.reason}; {fixes}"


_F = Feature
_OTHER_MESH = ("the parameters on another mesh form a nested unit of their own, which does not "
               "take it yet")

REFUSED: tuple[Refusal, ...] = (
    Refusal((_F.STATE_SHARDING, _F.TORCH_FSDP2),
            "torch FSDP2 shards parameters, gradients and optimizer state over the same mesh "
            "dims; only ragged_placement.fsdp.fully_shard takes a per-state sharding"),
    Refusal((_F.QUANT, _F.TORCH_FSDP2),
            "torch FSDP2 has no block-wise FP8 all-gather; only ragged_placement.fsdp."
            "fully_shard takes quant"),
    Refusal((_F.MATRIX_OPTIMIZER, _F.TORCH_FSDP2, _F.EXPERT_PARALLEL),
            "torch FSDP2 lays out an expert-parallel stack as _StridedShard over the "
            "data-parallel and ep dims, which ragged_placement.optim's Muon and Shampoo do not "
            "take"),
    Refusal((_F.QUANT, _F.HF_EXPERTS),
            "the transformers experts have no FP8 compute here"),
    Refusal((_F.STATE_SHARDING, _F.EXPERT_PARALLEL, _F.HF_EXPERTS),
            "per-state sharding of the transformers experts under expert parallelism is not "
            "tested yet (only the default sharding is)"),
    Refusal((_F.DP_MESH_DIMS, _F.STATE_SHARDING),
            "per-state sharding on a full SPMD mesh is not built yet"),
    Refusal((_F.CPU_OFFLOAD, _F.STATE_SHARDING),
            "per-state sharding keeps its chunks on the mesh's device; CPU offload of them is "
            "not built yet"),
    Refusal((_F.INT_RESHARD, _F.STATE_SHARDING),
            "per-state sharding reshards to its parameter dims after forward; an int "
            "reshard_after_forward is not built for it yet"),
    Refusal((_F.INT_RESHARD, _F.DP_MESH_DIMS),
            "an int reshard_after_forward on a full SPMD mesh is not built yet (torch FSDP2 "
            "raises NotImplementedError for it too)", NotImplementedError),
    Refusal((_F.QUANT, _F.DP_MESH_DIMS),
            "the FP8 gather is not built for parameters on a full SPMD mesh yet"),
    Refusal((_F.GRANULARITY, _F.OTHER_MESH), _OTHER_MESH),
    Refusal((_F.QUANT, _F.OTHER_MESH), _OTHER_MESH),
    Refusal((_F.STATE_SHARDING, _F.OTHER_MESH), _OTHER_MESH),
    Refusal((_F.DP_MESH_DIMS, _F.OTHER_MESH), _OTHER_MESH),
)
"""Every refused feature combination, first match first."""


def check_combinations(given: Mapping[Feature, Given]) -> None:
    """Raise the error of the first row of :data:`REFUSED` whose features are all in ``given``
    (the features a call turns on); return if none is. No communication."""
    for row in REFUSED:
        if all(f in given for f in row.features):
            raise row.error(row.message(given))
