"""Which mesh dims each training state is sharded over (AMSP's per-state sharding degrees): the
value type :class:`StateSharding` the planner chooses (:mod:`.state_sharding`) and the runtime
takes (``fully_shard(state_sharding=...)``, re-exported as ``ragged_placement.fsdp.StateSharding``).

Torch FSDP2 shards parameters, gradients and optimizer state over the same ranks: all of them
over one mesh dim, replicated over the other (HSDP) if there is one. AMSP (arXiv 2311.00257)
gives each state its own sharding factor ``s_P <= s_G <= s_OS``: parameters sharded inside a
node (cheap all-gathers), gradients and optimizer state over every rank (1/W of Adam's state), so
that the cross-node traffic is HSDP's while the optimizer memory is full sharding's.

:class:`StateSharding` names, for each state, the mesh dims it is sharded over; the state is
replicated over the other dims. The named points: ZeRO-1 (:meth:`StateSharding.zero1`),
ZeRO-2 (:meth:`~StateSharding.zero2`), ZeRO-3 / FSDP full sharding (:meth:`~StateSharding.zero3`),
HSDP / MiCS (:meth:`~StateSharding.hsdp`). :func:`ragged_placement.planner.plan_state_sharding`
chooses one from a memory and communication model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh

__all__ = ["StateSharding", "mesh_dims"]

MeshLike = DeviceMesh | Mapping[str, int]
_STATES = ("params", "grads", "optim")


def mesh_dims(mesh: MeshLike, arg: str = "mesh") -> dict[str, int]:
    """``{dim name: size}`` of ``mesh`` in mesh order: a named ``DeviceMesh`` or a mapping
    ``{dim name: size}`` (a mesh described without processes). ``ValueError`` naming ``arg``
    for anything else, an unnamed mesh, or a size that is not a positive int."""
    if isinstance(mesh, DeviceMesh):
        if mesh.mesh_dim_names is None:
            raise ValueError(
                f"{arg} must have mesh_dim_names (StateSharding names mesh dims): build it with "
                f"init_device_mesh(..., mesh_dim_names=(...)), got {mesh!r}"
            )
        return dict(zip(mesh.mesh_dim_names, mesh.shape))
    if isinstance(mesh, Mapping):
        if not mesh:
            raise ValueError(f"{arg} must name at least one mesh dim, got {dict(mesh)!r}")
        for name, size in mesh.items():
            if not isinstance(name, str):
                raise ValueError(f"{arg} dim names must be str, got {name!r}")
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{arg}[{name!r}] must be a positive int size, got {size!r}")
        return dict(mesh)
    raise ValueError(
        f"{arg} must be a DeviceMesh with mesh_dim_names or a mapping {{dim name: size}}, "
        f"got {type(mesh).__name__}"
    )


def _dims_tuple(state: str, value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, (tuple, list)) or not all(isinstance(d, str) for d in value):
        raise ValueError(
            f"StateSharding {state} must be a tuple of mesh dim names (str), got {value!r}"
        )
    dims = tuple(value)
    if len(set(dims)) != len(dims):
        raise ValueError(f"StateSharding {state} names a mesh dim twice: {dims!r}")
    return dims


@dataclass(frozen=True)
class StateSharding:
    """The mesh dims each training state is sharded over; it is replicated over the others.

    AMSP's sharding degree of a state is the product of the sizes of its dims
    (:meth:`degrees`). Rule: ``params`` ⊆ ``grads`` ⊆ ``optim`` (a rank can only update what it
    holds the gradient of, and only hold a gradient shard inside its parameter shard).

    Per training step (one micro-batch) the runtime that honours it runs, per unit: the
    parameters all-gathered over ``params`` (forward, and backward unless
    ``reshard_after_forward=False``); gradients reduce-scattered over ``params``, then over
    ``grads \\ params`` into the gradient shard, then all-reduced over the dims outside ``grads``;
    the optimizer steps its ``optim`` shard; the updated parameters all-gathered over
    ``optim \\ params`` back into the parameter shard. Nested layout: a rank's ``optim`` shard
    lies inside its ``grads`` shard, which lies inside its ``params`` shard.

    Args:
        params: mesh dims the parameters are sharded over (``()``: replicated, ZeRO-1/2).
        grads: mesh dims the gradients are sharded over; must include ``params``.
        optim: mesh dims the optimizer state (and the parameters the optimizer steps) are
            sharded over; must include ``grads``.

    A bare ``str`` is one dim. Each tuple lists dims in the mesh's order (:meth:`validate`).

    Raises:
        ValueError: a state is not a tuple of dim names, names a dim twice, or the rule
            ``params`` ⊆ ``grads`` ⊆ ``optim`` is broken (the message names the dims to add).
    """

    params: tuple[str, ...]
    grads: tuple[str, ...]
    optim: tuple[str, ...]

    def __post_init__(self) -> None:
        for state in _STATES:
            object.__setattr__(self, state, _dims_tuple(state, getattr(self, state)))
        for inner, outer in (("params", "grads"), ("grads", "optim")):
            missing = [d for d in getattr(self, inner) if d not in getattr(self, outer)]
            if missing:
                raise ValueError(
                    f"StateSharding needs params ⊆ grads ⊆ optim, but {inner}={getattr(self, inner)!r} "
                    f"names {missing!r}, which {outer}={getattr(self, outer)!r} does not: add "
                    f"{missing!r} to {outer} or drop them from {inner}"
                )

    # -- named points ---------------------------------------------------------------------------
    @classmethod
    def zero1(cls, mesh: MeshLike) -> StateSharding:
        """ZeRO-1: only the optimizer state sharded, over every dim of ``mesh``."""
        return cls(params=(), grads=(), optim=tuple(mesh_dims(mesh)))

    @classmethod
    def zero2(cls, mesh: MeshLike) -> StateSharding:
        """ZeRO-2: gradients and optimizer state sharded over every dim of ``mesh``."""
        every = tuple(mesh_dims(mesh))
        return cls(params=(), grads=every, optim=every)

    @classmethod
    def zero3(cls, mesh: MeshLike) -> StateSharding:
        """ZeRO-3 (FSDP full sharding): every state sharded over every dim of ``mesh``."""
        every = tuple(mesh_dims(mesh))
        return cls(params=every, grads=every, optim=every)

    @classmethod
    def hsdp(cls, mesh: MeshLike, shard_dim: str) -> StateSharding:
        """HSDP (MiCS): every state sharded over ``shard_dim``, replicated over the others."""
        dims = mesh_dims(mesh)
        if shard_dim not in dims:
            raise ValueError(
                f"shard_dim {shard_dim!r} is not a dim of mesh {tuple(dims)}: pass one of them"
            )
        return cls(params=(shard_dim,), grads=(shard_dim,), optim=(shard_dim,))

    @classmethod
    def default(cls, mesh: MeshLike) -> StateSharding:
        """What ``fully_shard`` does on ``mesh`` without a ``state_sharding``: a 1-D mesh,
        :meth:`zero3`; a 2-D ``(replicate, shard)`` mesh, :meth:`hsdp` over the last dim (FSDP2's
        HSDP). ``ValueError`` for other meshes (``fully_shard`` takes only those two)."""
        dims = tuple(mesh_dims(mesh))
        if len(dims) == 1:
            return cls.zero3(mesh)
        if len(dims) == 2:
            return cls.hsdp(mesh, dims[-1])
        raise ValueError(
            f"fully_shard without state_sharding takes a 1-D or 2-D mesh, got dims {dims}: "
            f"name a StateSharding for this mesh"
        )

    def is_default(self, mesh: MeshLike) -> bool:
        """Whether this is what ``fully_shard`` already does on ``mesh`` (:meth:`default`):
        zero3 on a 1-D mesh, HSDP over the last dim of a 2-D mesh. False on other meshes."""
        if len(mesh_dims(mesh)) not in (1, 2):
            return False
        return self == StateSharding.default(mesh)

    # -- checks and degrees ---------------------------------------------------------------------
    def validate(self, mesh: MeshLike, tp_dims: Sequence[str] = ()) -> None:
        """Check this sharding against ``mesh`` (a named ``DeviceMesh`` or ``{name: size}``).

        ``tp_dims``: the tensor-parallel dims (of ``mesh`` or of a sibling mesh); a state may
        not be sharded over them (tensor parallel composes as it does without a
        ``StateSharding``: the data-parallel mesh excludes them).

        Raises:
            ValueError: a state names a dim that ``mesh`` does not have, a tensor-parallel dim,
                or lists its dims in another order than the mesh's.
        """
        dims = mesh_dims(mesh)
        order = {d: i for i, d in enumerate(dims)}
        for state in _STATES:
            value = getattr(self, state)
            unknown = [d for d in value if d not in order]
            if unknown:
                raise ValueError(
                    f"StateSharding {state}={value!r} names {unknown!r}, not a dim of the mesh "
                    f"{tuple(dims)}: use the mesh's dim names"
                )
            tp = [d for d in value if d in tuple(tp_dims)]
            if tp:
                raise ValueError(
                    f"StateSharding {state}={value!r} names tensor-parallel dim(s) {tp!r}: "
                    f"shard states over data-parallel dims only (drop {tp!r})"
                )
            in_order = tuple(sorted(value, key=order.__getitem__))
            if value != in_order:
                raise ValueError(
                    f"StateSharding {state}={value!r} lists mesh dims out of the mesh's order: "
                    f"write {in_order!r}"
                )

    def degrees(self, mesh: MeshLike) -> tuple[int, int, int]:
        """``(s_P, s_G, s_OS)``: ranks each state is sharded over (AMSP's sharding degrees)."""
        self.validate(mesh)
        sizes = mesh_dims(mesh)
        out = []
        for state in _STATES:
            n = 1
            for d in getattr(self, state):
                n *= sizes[d]
            out.append(n)
        return out[0], out[1], out[2]

    def __str__(self) -> str:
        def fmt(dims: tuple[str, ...]) -> str:
            return "(" + ",".join(dims) + ")"

        return f"P{fmt(self.params)} G{fmt(self.grads)} OS{fmt(self.optim)}"
