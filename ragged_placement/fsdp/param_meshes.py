"""Parameters that FSDP2's ``shard_placement_fn`` places on another mesh than the unit's.

torch 2.13's ``shard_placement_fn`` may return ``ShardPlacementResult(placement, mesh_info)``:
the parameter is sharded over ``mesh_info.mesh`` instead of ``fully_shard``'s ``mesh``.
torchtitan's MoE recipe does so under expert parallelism (the routed experts over the ``efsdp``
mesh beside ``ep``, every other parameter of the block over ``fsdp``). FSDP2 keeps one parameter
group per mesh in the module's state. Here a unit has one mesh, so the parameters on each other
mesh become a unit of their own, on the modules that register them (``fully_shard`` of those
modules, nested in this one): the same shards, gradients and numbers, one all-gather per mesh as
FSDP2, issued when those modules run instead of when this one does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from ragged_placement._compat import ShardPlacementResult
from ragged_placement.fsdp.param import ParamSlot


@dataclass
class OtherMeshGroup:
    """The parameters placed on one other mesh: the modules that register them (to shard as one
    unit over ``mesh``) and each parameter's placement there."""

    mesh: DeviceMesh
    modules: list[nn.Module]
    placements: dict[int, Shard | None]  # id(parameter) -> placement

    def placement_fn(self) -> Callable[[nn.Parameter], Shard | None]:
        """The ``shard_placement_fn`` of the nested unit: the placement part of the results."""
        return lambda p: self.placements.get(id(p))


def _result_mesh(result: object, fqn: str, mesh: DeviceMesh) -> tuple[object, DeviceMesh | None]:
    """``(placement, other mesh or None)`` of one ``shard_placement_fn`` result."""
    if ShardPlacementResult is None or not isinstance(result, ShardPlacementResult):
        return result, None
    info = result.mesh_info
    if getattr(info, "dp_mesh_dims", None) is not None:
        raise ValueError(
            f"shard_placement_fn returned {result!r} for parameter {fqn!r}: a mesh_info with "
            f"dp_mesh_dims (an SPMD mesh) is not supported per parameter; pass a mesh_info "
            f"built without dp_mesh_dims"
        )
    other = info.mesh
    # fully_shard's reading of a mesh: 1-D shards over dim 0; 2-D replicates over 0, shards over 1
    expected = (0, None) if other.ndim == 1 else (1, 0)
    got = (getattr(info, "shard_mesh_dim", None), getattr(info, "replicate_mesh_dim", None))
    if got != expected:
        raise ValueError(
            f"shard_placement_fn returned {result!r} for parameter {fqn!r}: fully_shard shards "
            f"a {other.ndim}-D mesh with (shard_mesh_dim, replicate_mesh_dim) = {expected}, "
            f"not {got}; pass FSDPMeshInfo(mesh, shard_mesh_dim=0) for a 1-D mesh or "
            f"HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0) for a 2-D one"
        )
    return result.placement, (None if other == mesh else other)


def split_by_mesh(
    shard_placement_fn: Callable | None,
    slots: list[ParamSlot],
    params: list[nn.Parameter],
    mesh: DeviceMesh,
    roots: Sequence[nn.Module],
) -> tuple[Callable | None, list[OtherMeshGroup]]:
    """The ``shard_placement_fn`` for the parameters on ``mesh`` (results on ``mesh`` unwrapped
    to their placement) and the groups of parameters on other meshes.

    Every module registering a parameter of a group must register parameters of that group only
    (they become one unit over its mesh) and must not be one of ``roots`` (the unit being built);
    otherwise ``ValueError`` naming the parameter, before any collective.
    """
    if not callable(shard_placement_fn) or ShardPlacementResult is None:
        return shard_placement_fn, []  # None, or a bad value _placement_policy names
    own: dict[int, object] = {}
    groups: dict[DeviceMesh, OtherMeshGroup] = {}
    mesh_of: dict[int, DeviceMesh | None] = {}
    for slot, p in zip(slots, params):
        placement, other = _result_mesh(shard_placement_fn(p), slot.fqn, mesh)
        mesh_of[id(p)] = other
        if other is None:
            own[id(p)] = placement
            continue
        group = groups.setdefault(other, OtherMeshGroup(other, [], {}))
        group.placements[id(p)] = placement
        for module, _ in slot.owners:
            if any(module is r for r in roots):
                raise ValueError(
                    f"shard_placement_fn places parameter {slot.fqn!r} on {other}, not on "
                    f"fully_shard's mesh {mesh}, but the module being sharded registers it "
                    f"itself: parameters on another mesh must belong to a submodule (they are "
                    f"sharded as that submodule's own unit)"
                )
            if not any(module is m for m in group.modules):
                group.modules.append(module)
    by_id = {id(p): slot for slot, p in zip(slots, params)}
    for group in groups.values():
        for module in group.modules:
            for attr, q in module._parameters.items():
                if q is not None and id(q) in mesh_of and mesh_of[id(q)] != group.mesh:
                    raise ValueError(
                        f"shard_placement_fn places parameter {by_id[id(q)].fqn!r} on "
                        f"{mesh_of[id(q)] or mesh}, but its module {type(module).__name__} also "
                        f"registers parameters placed on {group.mesh}: the parameters on another "
                        f"mesh are sharded as their modules' own unit, so a module's parameters "
                        f"must all be on one mesh"
                    )
    return lambda p: own.get(id(p)), list(groups.values())
