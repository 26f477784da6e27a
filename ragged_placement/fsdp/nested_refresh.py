"""Per-state sharding's refresh: the updated optimizer chunks all-gathered into the parameter
chunks (step 1 of :mod:`ragged_placement.fsdp.nested`'s per-step list), and when it runs.

A unit refreshes before an unshard when the optimizer chunk changed since its
last refresh: any ``torch.optim`` step in the process (a global step post-hook), a write
into the sharded parameters (the version counters of the parameters and of their local
tensors: ``copy_``, ``load_state_dict``, an initializer), a ``state_dict()`` taken (its
detached tensors may be loaded into in place before the next forward, as ``dcp.load`` does), or
a move. A write through ``.data`` bypasses all of them. Every rank of an ``O \\ P`` group must
take the same decision, or the refresh would wait for the ranks that skip it: at the root's
forward the data-parallel ranks agree per unit (one byte per unit, all-reduced: max;
:func:`agree_on_refreshes`), so a state dict or a write on some ranks only refreshes
everywhere. An unshard outside the root's forward (backward, a submodule called on its own)
decides locally. :class:`ChunkRefresh` holds a unit's refresh: its state, the step hook's
refresh, the unshard's and the agreement.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING

from torch.optim.optimizer import register_optimizer_step_post_hook

from ragged_placement.fsdp.collectives import issue_all_gather
from ragged_placement.fsdp.common import UnitState
from ragged_placement.fsdp.mesh import ParamRefresh, UnitMesh, any_rank

if TYPE_CHECKING:
    from ragged_placement.fsdp.unit import FSDPUnit

__all__ = ["ChunkRefresh", "agree_on_refreshes"]


class ChunkRefresh(ParamRefresh):
    """The refresh of one unit's parameter chunks (step 1 of the per-step list in
    :mod:`~ragged_placement.fsdp.nested`): the all-gather over ``O \\ P`` of the updated
    optimizer chunks, issued by each optimizer step over the unit's parameters
    (:func:`_refresh_after_step`, waited on at the next unshard), else before an unshard where
    the optimizer chunks may have changed since the last one (the module docstring), which the
    data-parallel ranks agree on at the root's forward (:func:`agree_on_refreshes`).

    Args:
        unit: the unit, on ``mesh``, holding parameters.
        mesh: its :class:`~ragged_placement.fsdp.nested.StateShardedMesh`, which
            :attr:`~ragged_placement.fsdp.nested.StateShardedMesh.refreshes`.
    """

    unit: FSDPUnit
    mesh: UnitMesh  # a StateShardedMesh (fsdp/nested.py, which imports this module)
    # whether the optimizer chunks may have changed since the last refresh of the parameter
    # chunks (where no version counter shows it: a step, a move, a state dict taken), and the
    # sharded chunks' versions at that refresh
    _stale: bool
    _synced_versions: list[int]
    _agreed: bool | None  # the ranks' agreed decision for the next unshard (None: none yet)
    _work: object | None  # a refresh issued at an optimizer step, not waited on yet

    def __init__(self, unit: FSDPUnit, mesh: UnitMesh) -> None:
        self.unit = unit
        self.mesh = mesh
        self._stale = True
        self._synced_versions = []
        self._agreed = None
        self._work = None
        _REFRESHES.add(self)
        for module in {id(m): m for slot in unit.slots for m, _ in slot.owners}.values():
            module.register_state_dict_post_hook(partial(_stale_after_state_dict, self))

    def before_unshard(self) -> bool:
        """All-gather the optimizer chunks over ``O \\ P`` into the parameter chunks if they
        changed since the last refresh (or as the ranks agreed); blocks until done, as it does
        for a refresh issued at the last optimizer step. With ``params=()`` that filled the
        unsharded buffers."""
        self.wait()
        versions = self._versions()
        stale = self._agreed if self._agreed is not None else self.needs_refresh(versions)
        self._agreed = None
        if stale:
            self._issue()
            self.wait()
        self._stale = False
        self._synced_versions = versions
        return self.mesh.keeps_params_unsharded

    def after_step(self) -> None:
        """After an optimizer step over the unit's parameters (every rank steps): issue the
        refresh now, asynchronously, beside the other stepped units' (waited on at the next
        unshard). A unit on the meta device, or one that is not resharded, is only marked
        stale."""
        unit = self.unit
        if unit.state is not UnitState.SHARDED or unit.device.type == "meta":
            self._stale = True
            return
        self.wait()
        self._issue()
        self._stale = False
        self._synced_versions = self._versions()

    def _issue(self) -> None:
        unit = self.unit
        # the buffers' NestedBuffers (one or more), each packing as the buffer sends
        refreshes = [b.comm.prepare_refresh(b.send_buffer) for b in unit.buffers]
        self._work = issue_all_gather(refreshes, unit.stats)
        nbytes = sum(g.output.numel() * g.output.element_size() for g in refreshes)
        self.mesh.count(unit.stats, "all_gather", "refresh", nbytes)

    def wait(self) -> None:
        """Wait for an issued refresh and release its send buffers."""
        if self._work is None:
            return
        self._work.wait()
        self._work = None
        for b in self.unit.buffers:
            b.comm.finish_refresh()

    def needs_refresh(self, versions: list[int] | None = None) -> bool:
        """Whether this rank's optimizer chunks may have changed since the last refresh (an
        optimizer step, a move, a state dict taken, or a write the version counters show)."""
        return self._stale or (versions or self._versions()) != self._synced_versions

    def mark_stale(self) -> None:
        """The sharded parameters may change unseen (a move, a state dict taken): refresh the
        parameter chunks before the next all-gather."""
        self._stale = True

    def _versions(self) -> list[int]:
        """The version counters of the sharded chunks, of the sharded parameters and of their
        local tensors: each has its own (``nn.Parameter(DTensor)`` detaches, and DTensor ops
        run below the counters' bump), so an op on a parameter (``copy_``, ``mul_``, an
        ``nn.init``) bumps only the parameter's, a write into its local tensor
        (``load_state_dict``) only that one's."""
        unit = self.unit
        params = [(p._version, p._local_tensor._version) for p in unit.sharded_params]
        return [b.sharded._version for b in unit.buffers] + [v for pv in params for v in pv]

    @staticmethod
    def agree(refreshes: Sequence[ChunkRefresh]) -> None:
        """The data-parallel ranks' agreement on whether each of ``refreshes`` (on one mesh)
        runs at its unit's next unshard: it replaces each rank's own :meth:`needs_refresh`
        there, so that a rank that alone wrote (or took a state dict) cannot leave its refresh
        group waiting."""
        first = refreshes[0]
        stale = any_rank([r.needs_refresh() for r in refreshes], first.unit.device,
                         first.mesh.agreement_groups)
        for r, flag in zip(refreshes, stale):
            r._agreed = flag


# the live refreshes, issued after every optimizer step over their units' parameters
_REFRESHES: weakref.WeakSet[ChunkRefresh] = weakref.WeakSet()


def agree_on_refreshes(units: Sequence[FSDPUnit]) -> None:
    """At the root's forward, over ``units`` (the root's, in module order, the same on every
    rank): the data-parallel ranks agree, per unit whose parameter chunks are refreshed
    (:class:`ChunkRefresh`), whether its next unshard refreshes them: one all-reduce (max) of
    one byte per unit over the optimizer ranks (and one over the replicas), per distinct
    state-sharded mesh, whose result the host reads (on GPUs: a device sync at the start of
    forward). Each rank's own view can differ (a state dict or a write on some ranks only), and
    a refresh that not every rank of its group joins would hang. No collective where no unit
    refreshes."""
    by_mesh: dict[int, list[ChunkRefresh]] = {}
    for unit in units:
        refresh = unit.refresh
        if isinstance(refresh, ChunkRefresh) and unit.device.type != "meta":
            by_mesh.setdefault(id(refresh.mesh), []).append(refresh)
    for refreshes in by_mesh.values():
        ChunkRefresh.agree(refreshes)


def _refresh_after_step(optimizer, args, kwargs) -> None:
    """Every optimizer step in the process: the refreshes of the units holding a parameter it
    stepped are issued (:meth:`ChunkRefresh.after_step`), all in flight at once (one all-gather
    per unit), each waited on at its unit's next unshard, so that they run while the next
    forward starts."""
    del args, kwargs
    owner = {id(p): r for r in list(_REFRESHES) for p in r.unit.sharded_params}
    # in the optimizer's parameter order, the same on every rank (the set's order is not)
    stepped = {id(owner[id(p)]): owner[id(p)] for group in optimizer.param_groups
               for p in group["params"] if id(p) in owner}
    for refresh in stepped.values():
        refresh.after_step()


register_optimizer_step_post_hook(_refresh_after_step)


def _stale_after_state_dict(refresh: ChunkRefresh, module, state_dict, prefix,
                            local_metadata) -> None:
    """A state dict holds detached views of the sharded parameters, which may be written in
    place past every version counter the refresh reads (``dcp.load``): refresh before the
    unit's next all-gather."""
    del module, state_dict, prefix, local_metadata
    refresh.mark_stale()
