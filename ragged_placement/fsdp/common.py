"""What the parts of the FSDP runtime share: a unit's state and its communication counters
(torch FSDP2's ``_fsdp_common.py``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields

__all__ = ["CommStats", "UnitState"]


@dataclass
class CommStats:
    """Per-unit counters of collectives issued and bytes moved (this rank's send + receive view).

    ``all_gathers`` / ``all_gather_bytes`` count every all-gather (bytes: its output, the unit's
    gathered buffer); the ``post_forward_`` ones count those of them that ran over the
    post-forward group (an ``int`` ``reshard_after_forward``) instead of the shard group. The
    ``h2d_`` / ``d2h_`` ones count the CPU-offload staging copies: host-to-device before each
    all-gather, device-to-host after each reduction (zero without offload)."""

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

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, 0)


class UnitState(enum.Enum):
    SHARDED = "sharded"
    UNSHARDING = "unsharding"  # all-gather issued, not waited on
    UNSHARDED = "unsharded"
