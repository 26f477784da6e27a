"""What the parts of the FSDP runtime share: a unit's state, its settings and its
communication counters (torch FSDP2's ``_fsdp_common.py``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch.distributed.fsdp import CPUOffloadPolicy

__all__ = ["CommStats", "Registration", "TrainingState", "UnitOptions", "UnitState"]


@dataclass
class CommStats:
    """Per-unit counters of collectives issued and bytes moved (this rank's send + receive view).

    ``all_gathers`` / ``all_gather_bytes`` count every all-gather (bytes: its output, the unit's
    gathered buffer); the ``post_forward_`` ones count those of them that ran over the
    post-forward group (an ``int`` ``reshard_after_forward``) instead of the shard group. The
    ``h2d_`` / ``d2h_`` ones count the CPU-offload staging copies: host-to-device before each
    all-gather, device-to-host after each reduction (zero without offload). Under a
    ``state_sharding`` (:mod:`ragged_placement.fsdp.nested`) ``by_dims`` also counts every
    collective by the mesh dims it runs over (:meth:`count_dims`)."""

    all_gathers: int = 0
    reduce_scatters: int = 0
    all_reduces: int = 0  # HSDP: over the replicate dim
    all_gather_bytes: int = 0
    reduce_scatter_bytes: int = 0
    all_reduce_bytes: int = 0
    post_forward_all_gathers: int = 0
    post_forward_all_gather_bytes: int = 0
    h2d_copies: int = 0
    d2h_copies: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    # with a state_sharding (fsdp/nested.py): (collective, mesh dims) -> [count, bytes]
    by_dims: dict[tuple[str, tuple[str, ...]], list[int]] = field(default_factory=dict)

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, {} if f.name == "by_dims" else 0)

    def count_dims(self, kind: str, dims: tuple[str, ...], nbytes: int) -> None:
        """Count one ``kind`` collective (``"all_gather"``, ``"reduce_scatter"``,
        ``"all_reduce"``) over the mesh ``dims`` moving ``nbytes`` (as the totals above)."""
        entry = self.by_dims.setdefault((kind, tuple(dims)), [0, 0])
        entry[0] += 1
        entry[1] += nbytes


class UnitState(enum.Enum):
    """Where a unit's parameters are (torch FSDP2's ``ShardedState``, plus the all-gather in
    flight)::

        SHARDED --unshard--> UNSHARDING --wait_unshard--> UNSHARDED --reshard--> SHARDED
        UNSHARDED --reshard_post_forward--> SHARDED_POST_FORWARD --unshard--> UNSHARDING
        SHARDED_POST_FORWARD --reshard--> SHARDED
    """

    SHARDED = "sharded"
    # an int reshard_after_forward: the unit keeps 1/N of the gathered buffer between forward
    # and backward, and all-gathers over the N-rank group from it
    SHARDED_POST_FORWARD = "sharded_post_forward"
    UNSHARDING = "unsharding"  # all-gather issued, not waited on
    UNSHARDED = "unsharded"


class Registration(enum.Enum):
    """What a unit's modules give for its parameters: ``module._parameters`` (what
    ``parameters()``, ``state_dict()`` and an optimizer built from them get) and an attribute
    read (``module.weight``: what a forward computes with)::

        SHARDED                      both: the sharded DTensors
        UNSHARDED                    both: the unsharded tensors
        SHARDED_UNSHARDED_ATTRIBUTES ``_parameters``: the sharded ones; attribute reads: the
                                     unsharded ones, from the module's instance ``__dict__``

    ``UNSHARDED`` inside the unit's own forward and backward (and after
    :meth:`FSDPModule.unshard`, as FSDP2); ``SHARDED_UNSHARDED_ATTRIBUTES`` while the unit holds
    its all-gather between them (the root from forward to backward, a unit with
    ``reshard_after_forward=False``, one with ``set_reshard_after_backward(False)``), so that
    ``model.parameters()`` gives the sharded parameters at every point outside the hooks;
    ``SHARDED`` otherwise.
    """

    SHARDED = enum.auto()
    UNSHARDED = enum.auto()
    SHARDED_UNSHARDED_ATTRIBUTES = enum.auto()


class TrainingState(enum.Enum):
    """Where one unit is in the current iteration (torch FSDP2's ``TrainingState``; the state
    diagram is in :mod:`ragged_placement.fsdp.state`)."""

    IDLE = enum.auto()  # outside forward and backward, or between a forward and its backward
    FORWARD = enum.auto()  # between the unit's pre-forward and post-forward
    # after a forward that kept its all-gather (or post-forward shard) for backward
    POST_FORWARD = enum.auto()
    PRE_BACKWARD = enum.auto()  # its backward started: unsharded and registered for it
    POST_BACKWARD = enum.auto()  # its gradients are reduced and it is resharded


@dataclass(frozen=True)
class UnitOptions:
    """The settings of one ``fully_shard`` unit that its flat buffers share.

    Args:
        gathers: how the unit's flat buffers gather, chosen by ``fully_shard`` from its
            ``quant`` (:func:`~ragged_placement.fsdp.fp8.unit_gathers`: plainly, or the buffers
            holding FP8 weights as FP8 blocks and scales, planned at block granularity).
        param_dtype: dtype of the all-gather and of the unsharded parameters (``None``: the
            parameters' dtype, also after a cast).
        reduce_dtype: dtype of the gradient reduce-scatter (``None``: ``param_dtype``).
        granularity: the planner's granularity policy for the unit's parameters.
        split_by_submodule: prefer one plan segment per direct submodule (see
            :func:`~ragged_placement.fsdp.buffer.plan_buffer`).
        offload_policy: a :class:`~torch.distributed.fsdp.CPUOffloadPolicy` keeps ``sharded``
            and ``sharded_grad`` on CPU (:class:`~ragged_placement.fsdp.offload.OffloadStaging`);
            ``None``: no offload.
        spmd: with ``fully_shard(dp_mesh_dims=...)``, the full SPMD mesh the unsharded
            parameters and their gradients are DTensors on
            (:class:`~ragged_placement.fsdp.spmd.SPMDMesh`); ``None`` otherwise.
    """

    gathers: Any  # a PlainGathers (fsdp/gather.py, which imports this module)
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    granularity: Any = None
    split_by_submodule: bool = False
    offload_policy: CPUOffloadPolicy | None = None
    spmd: Any = None
