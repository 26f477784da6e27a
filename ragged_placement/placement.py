"""The ``RaggedShard`` placement and its geometry.

``RaggedShard(dims, local_units)`` flattens the leading ``dims`` of a tensor into a prefix of
``L = prod(shape[d] for d in dims)`` "rows" (each row is the trailing ``shape[len(dims):]``) and
gives rank ``i`` of the mesh dimension one contiguous run of ``local_units[i] * (L // sum(units))``
rows, in rank order. Ranks may hold nothing.

The local tensor of a rank has shape ``(run_rows, *shape[len(dims):])``: for ``dims=(0,)`` that is
exactly ``full[start:end]``; for longer prefixes it is the flattened run (a view of the contiguous
global tensor, which is how a flat FSDP buffer holds it).

This module holds the placement type and its pure shape arithmetic (the planner and the
optimizers reason about layouts without a process group); it imports nothing of the package's
DTensor core, which imports one way, as torch's does: redistribute -> transforms -> regions ->
placement. The transform methods torch's ``Shard`` has (``_transform_to``,
``_to_replicate_tensor``, ``_reduce_shard_tensor``, ...) are defined with their data movement in
:mod:`ragged_placement.transforms`, which attaches them to :class:`RaggedShard` (importing the
package imports it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch.distributed.tensor import Placement

__all__ = ["RaggedShard"]

# The package patches nothing when imported: the first RaggedShard made installs RaggedShard
# support into torch's DTensor, since no call reaches a patched path without one.
# :mod:`ragged_placement._install` (imported with the package, before anything makes a
# placement) sets the hook and keeps the flag.
_install_hook: Callable[[], None] | None = None
_installed = False


def _install_once() -> None:
    if not _installed:
        if _install_hook is None:
            raise RuntimeError("ragged_placement._install was not imported: import ragged_placement")
        _install_hook()


class RowRunPlacement(Placement):
    """A placement that is none of torch's kinds (``Shard``, ``Replicate``, ``Partial``): its
    predicates all answer ``False``, so torch's propagation never takes it for one of them and
    every op on it goes through the rules of :mod:`ragged_placement.ops`."""

    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:  # noqa: D102
        return False

    def is_replicate(self) -> bool:  # noqa: D102
        return False

    def is_partial(self, reduce_op: str | None = None) -> bool:  # noqa: D102
        return False


def _as_int_tuple(name: str, value: object) -> tuple[int, ...]:
    if isinstance(value, int):
        value = (value,)
    try:
        out = tuple(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{name} must be a sequence of ints, got {value!r}") from None
    for v in out:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name} must contain only ints, got {value!r}")
    return out


class RaggedShard(RowRunPlacement):
    """Shard the flattened leading ``dims`` of a tensor in uneven, contiguous runs.

    Args:
        dims: a prefix of the tensor's dims, ``(0,)``, ``(0, 1)``, ... They are flattened into
            ``L`` rows.
        local_units: one non-negative int per rank of the mesh dimension, at least one positive.
            ``L`` must be divisible by ``sum(local_units)``; rank ``i`` holds
            ``local_units[i] * L // sum(local_units)`` rows, contiguous, in rank order.

    Examples: ``RaggedShard((0,), (1, 2, 1, 0))`` on an ``[8, h]`` tensor gives ranks 2, 4, 2 and
    0 rows; equal units express ``Shard(0)`` when divisible; all units on one rank put the whole
    tensor there; ``dims`` = all dims gives FSDP1's element-wise flat shard.

    ``split_factor`` (keyword, default 1) composes RaggedShard with a ``Shard`` of the same dim on a
    later mesh dim, as torch's ``_StridedShard`` does for FSDP2 + tensor parallel: the ``L`` rows
    are first seen as ``split_factor`` equal contiguous blocks, each cut by the same units, and a
    rank holds its run of every block, in block order. With ``(RaggedShard(..., split_factor=T),
    Shard(0))`` on a ``(dp, tp)`` mesh, the local tensor of ``(d, t)`` is run ``d`` of tensor-parallel
    shard ``t``: FSDP cuts the TP-local shard.

    The placement is immutable and hashable on ``(dims, local_units, split_factor)``. Like torch's
    ``_StridedShard``, it answers ``False`` to ``is_shard()``, ``is_replicate()`` and
    ``is_partial()``: code that handles it recognizes it explicitly.
    """

    __slots__ = ("dims", "local_units", "split_factor")
    dims: tuple[int, ...]
    local_units: tuple[int, ...]
    split_factor: int

    def __init__(self, dims: Sequence[int] | int, local_units: Sequence[int], *, split_factor: int = 1) -> None:
        _install_once()
        super().__init__()
        dims_t = _as_int_tuple("dims", dims)
        units_t = _as_int_tuple("local_units", local_units)
        if not dims_t or dims_t != tuple(range(len(dims_t))):
            raise ValueError(
                f"dims must be a non-empty prefix of the tensor dims (0,), (0, 1), ..., got {dims_t}"
            )
        if not units_t:
            raise ValueError("local_units must have one entry per rank of the mesh dim, got ()")
        if any(u < 0 for u in units_t):
            raise ValueError(f"local_units must be non-negative, got {units_t}")
        if sum(units_t) == 0:
            raise ValueError(f"local_units must have at least one positive entry, got {units_t}")
        if isinstance(split_factor, bool) or not isinstance(split_factor, int) or split_factor < 1:
            raise ValueError(f"split_factor must be a positive int, got {split_factor!r}")
        if split_factor > 1 and len(dims_t) > 1:
            raise ValueError(f"split_factor={split_factor} needs dims=(0,), got dims={dims_t}")
        object.__setattr__(self, "dims", dims_t)
        object.__setattr__(self, "local_units", units_t)
        object.__setattr__(self, "split_factor", split_factor)

    @classmethod
    def _unchecked(cls, dims: tuple[int, ...], local_units: tuple[int, ...], split_factor: int = 1) -> RaggedShard:
        """Build from values that are valid by construction (tuples of ints, a dims prefix,
        non-negative units with a positive entry), skipping the O(ranks) argument checks.

        For internal producers such as the planner, which builds one placement per parameter
        with one unit per rank (65,536 entries at the largest scale): the checks cost more
        than the layout itself there. User-facing code uses the constructor.
        """
        _install_once()
        self = cls.__new__(cls)
        Placement.__init__(self)
        object.__setattr__(self, "dims", dims)
        object.__setattr__(self, "local_units", local_units)
        object.__setattr__(self, "split_factor", split_factor)
        return self

    # -- value semantics -------------------------------------------------------------------
    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"RaggedShard is immutable (tried to set {name!r})")

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, RaggedShard)
            and self.dims == other.dims
            and self.local_units == other.local_units
            and self.split_factor == other.split_factor
        )

    def __hash__(self) -> int:
        return hash(("RaggedShard", self.dims, self.local_units, self.split_factor))

    def __repr__(self) -> str:
        sf = f", split_factor={self.split_factor}" if self.split_factor != 1 else ""
        return f"RaggedShard(dims={self.dims}, local_units={self.local_units}{sf})"

    def __str__(self) -> str:
        sf = f";sf={self.split_factor}" if self.split_factor != 1 else ""
        return f"RS({','.join(map(str, self.dims))};{','.join(map(str, self.local_units))}{sf})"

    def __reduce__(self):
        return (_rebuild, (self.dims, self.local_units, self.split_factor))

    def __fx_repr__(self):
        return (repr(self), {"RaggedShard": RaggedShard})

    def __copy__(self) -> RaggedShard:
        return self

    def __deepcopy__(self, memo) -> RaggedShard:
        return self

    # -- geometry ----------------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return len(self.local_units)

    def check_mesh_size(self, mesh_dim_size: int, *, mesh_dim: int | None = None) -> None:
        """Raise ``ValueError`` unless there is one unit per rank of the mesh dim."""
        if mesh_dim_size != len(self.local_units):
            where = "" if mesh_dim is None else f" (mesh dim {mesh_dim})"
            raise ValueError(
                f"local_units has {len(self.local_units)} entries but the mesh dim{where} has "
                f"{mesh_dim_size} ranks: {self!r}"
            )

    def prefix_rows(self, shape: Sequence[int]) -> int:
        """``L``: the number of rows of the flattened prefix of ``shape``."""
        if len(shape) < len(self.dims):
            raise ValueError(
                f"dims={self.dims} needs a tensor of at least {len(self.dims)} dims, got shape "
                f"{tuple(shape)}"
            )
        return math.prod(int(shape[d]) for d in self.dims)

    def row_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The shape of one row: the dims after the flattened prefix."""
        return tuple(int(s) for s in shape[len(self.dims):])

    def unit_rows(self, shape: Sequence[int]) -> int:
        """Rows per unit (within one block when ``split_factor > 1``); raises ``ValueError`` if
        ``L`` is not divisible by ``split_factor * sum(units)``."""
        rows = self.prefix_rows(shape)
        total = sum(self.local_units) * self.split_factor
        if rows % total:
            sf = f" x split_factor={self.split_factor}" if self.split_factor != 1 else ""
            raise ValueError(
                f"the flattened prefix of shape {tuple(shape)} over dims={self.dims} has {rows} rows, "
                f"not divisible by sum(local_units)={sum(self.local_units)}{sf} ({self!r})"
            )
        return rows // total

    def runs(self, shape: Sequence[int], rank: int) -> list[tuple[int, int]]:
        """Every ``[start, end)`` prefix-row run of ``rank``, one per block, in local order."""
        unit = self.unit_rows(shape)
        block = self.prefix_rows(shape) // self.split_factor
        start = unit * sum(self.local_units[:rank])
        end = start + unit * self.local_units[rank]
        return [(b * block + start, b * block + end) for b in range(self.split_factor)]

    def row_ranges(self, shape: Sequence[int]) -> list[tuple[int, int]]:
        """``[start, end)`` prefix-row ranges of every rank, in rank order (``split_factor == 1``:
        each rank holds one contiguous run; use :meth:`runs` for strided placements)."""
        if self.split_factor != 1:
            raise ValueError(f"{self!r} holds {self.split_factor} runs per rank; use runs(shape, rank)")
        return [self.runs(shape, r)[0] for r in range(len(self.local_units))]

    def local_row_range(self, shape: Sequence[int], rank: int) -> tuple[int, int]:
        """``[start, end)`` prefix rows held by ``rank`` (``split_factor == 1``)."""
        return self.row_ranges(shape)[rank]

    def local_rows(self, shape: Sequence[int], rank: int) -> int:
        """Number of prefix rows ``rank`` holds (over all blocks)."""
        return sum(e - s for s, e in self.runs(shape, rank))

    def local_shape(self, shape: Sequence[int], rank: int) -> tuple[int, ...]:
        """Shape of the local tensor of ``rank``: ``(rows_held, *row_shape)``."""
        return (self.local_rows(shape, rank), *self.row_shape(shape))

    def shard_local(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """The local tensor of ``rank`` from a full ``tensor``: a view when ``split_factor == 1``,
        else the concatenation of the rank's runs."""
        flat = self.flatten_prefix(tensor)
        runs = self.runs(tensor.shape, rank)
        if len(runs) == 1:
            return flat[runs[0][0]:runs[0][1]]
        return torch.cat([flat[s:e] for s, e in runs])

    def flatten_prefix(self, tensor: torch.Tensor) -> torch.Tensor:
        """View ``tensor`` as ``(L, *row_shape)`` (a reshape when the prefix is not viewable)."""
        if len(self.dims) == 1:
            return tensor
        return tensor.reshape(self.prefix_rows(tensor.shape), *self.row_shape(tensor.shape))

    def unflatten_prefix(self, flat: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        """Inverse of :meth:`flatten_prefix` for a full set of rows."""
        if len(self.dims) == 1:
            return flat
        return flat.reshape(tuple(shape))

    # -- split ------------------------------------------------------------------------------------
    def _split_tensor(self, tensor: torch.Tensor, num_chunks: int) -> list[torch.Tensor]:
        """Every rank's local tensor of the full ``tensor``, in rank order (no communication;
        torch's ``Shard._split_tensor``). The methods that move data (``_shard_tensor``,
        ``_to_replicate_tensor``, ``_transform_to``, ...) are attached by
        :mod:`ragged_placement.transforms`."""
        self.check_mesh_size(num_chunks)
        return [self.shard_local(tensor, r) for r in range(num_chunks)]


def _rebuild(dims, local_units, split_factor=1) -> RaggedShard:
    return RaggedShard(dims, local_units, split_factor=split_factor)


# ``torch.load`` (``weights_only=True``, its default) of what holds RaggedShard DTensors (a
# state dict, an optimizer's) may call the function that rebuilds the placement.
torch.serialization.add_safe_globals([_rebuild])


def ragged_placements(placements: Sequence[Placement]) -> list[tuple[int, RaggedShard]]:
    """``(mesh_dim, placement)`` for every RaggedShard in ``placements``."""
    return [(i, p) for i, p in enumerate(placements) if isinstance(p, RaggedShard)]
