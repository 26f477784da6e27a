"""Sharding granularities and the cut structure they impose on one parameter.

A :class:`Granularity` says where a parameter may be cut between ranks. :func:`resolve` turns a
(name, shape, granularity) triple into a :class:`CutSpec`: the RaggedShard prefix (``dims``), the
row size, and the set of row indices at which a cut is allowed. Everything downstream (packing,
placements) works on ``CutSpec`` alone, so a plan depends only on shapes and granularities.

Allowed cut rows have one periodic form: ``{j * period + i * band}`` (plus the end), with
``band <= period``. A uniform band has ``period == band``; a ragged band (dim not divisible by
the band) repeats per matrix with a short last band, ``period`` = the matrix rows.
"""

from __future__ import annotations

import fnmatch
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Union

__all__ = ["Granularity", "GranularityPolicy", "CutSpec", "resolve", "resolve_policy"]

_KINDS = ("element", "rows", "block", "matrix", "matrices")


@dataclass(frozen=True)
class Granularity:
    """Where a parameter may be cut between ranks.

    Build with the class methods:

    * :meth:`element` - anywhere (FSDP1-style; the local tensor is flat).
    * :meth:`row` / :meth:`rows` - between rows (slices along dim 0), or between bands of ``B``
      rows (a Shampoo block). A last band shorter than ``B`` (dim 0 not divisible) is allowed and
      never cut.
    * :meth:`block` - quantization blocks ``(rows, cols)`` of the matrix in the last two dims:
      only between whole bands of ``rows`` rows (cols need not divide, a band holds whole
      blocks of every column). Leading dims are stacking dims: a stacked expert tensor
      ``[E, out, in]`` is cut between experts or between bands of one expert (RaggedShard dims
      ``(0, 1)``); if ``out`` is not divisible, each expert's last band is short and whole.
    * :meth:`matrix` - never: the whole tensor on one rank (a Muon owner).
    * :meth:`matrices` - between the trailing 2-D matrices of a stacked tensor: each expert of
      ``[E, out, in]`` whole on one rank (a Muon owner per expert); a 2-D tensor stays whole.

    ``keep_dims_whole`` (element, row, rows, block) is the tensor-parallel constraint: a dim sharded on
    another mesh dim must never be cut through. Keeping dim ``k`` whole allows cuts only
    between whole slices ``x[i_0, ..., i_{k-1}]``; keeping dim 0 whole keeps the whole tensor on
    one rank. It combines with the granularity (both must hold).
    """

    kind: str
    band_rows: int = 1
    block_cols: int = 1
    keep_dims_whole: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"Granularity kind must be one of {_KINDS}, got {self.kind!r}")
        for field, value in (("band_rows", self.band_rows), ("block_cols", self.block_cols)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Granularity {field} must be a positive int, got {value!r}")
        keep = self.keep_dims_whole
        if not isinstance(keep, tuple) or any(
            isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in keep
        ):
            raise ValueError(f"keep_dims_whole must be a tuple of non-negative ints, got {keep!r}")

    # -- constructors ---------------------------------------------------------------------
    @classmethod
    def element(cls, *, keep_dims_whole: Sequence[int] = ()) -> Granularity:
        """Cut anywhere."""
        return cls("element", keep_dims_whole=tuple(keep_dims_whole))

    @classmethod
    def row(cls, *, keep_dims_whole: Sequence[int] = ()) -> Granularity:
        """Cut between slices along dim 0."""
        return cls("rows", 1, keep_dims_whole=tuple(keep_dims_whole))

    @classmethod
    def rows(cls, band: int, *, keep_dims_whole: Sequence[int] = ()) -> Granularity:
        """Cut between bands of ``band`` dim-0 rows (Shampoo blocks); the last may be short."""
        return cls("rows", band, keep_dims_whole=tuple(keep_dims_whole))

    @classmethod
    def block(cls, rows: int, cols: int, *, keep_dims_whole: Sequence[int] = ()) -> Granularity:
        """Cut between whole ``rows``-row bands of the trailing matrix (quantization blocks)."""
        return cls("block", rows, cols, keep_dims_whole=tuple(keep_dims_whole))

    @classmethod
    def matrix(cls) -> Granularity:
        """Never cut: the whole tensor lives on one rank."""
        return cls("matrix")

    @classmethod
    def matrices(cls) -> Granularity:
        """Cut only between the trailing matrices of a stacked tensor (one owner per expert)."""
        return cls("matrices")

    def __str__(self) -> str:
        base = {
            "element": "element",
            "rows": "row" if self.band_rows == 1 else f"rows({self.band_rows})",
            "block": f"block({self.band_rows}x{self.block_cols})",
            "matrix": "matrix",
            "matrices": "matrices",
        }[self.kind]
        return base + (f"[keep {self.keep_dims_whole}]" if self.keep_dims_whole else "")


GranularityPolicy = Union[
    None,
    Granularity,
    Callable[[str, tuple[int, ...]], Granularity],
    Mapping[str, Granularity],
]


def default_granularity(shape: Sequence[int]) -> Granularity:
    """Row granularity for tensors of >= 2 dims, element granularity for 1-D ones."""
    return Granularity.row() if len(shape) >= 2 else Granularity.element()


def resolve_policy(policy: GranularityPolicy, name: str, shape: tuple[int, ...]) -> Granularity:
    """The granularity ``policy`` assigns to parameter ``name`` of ``shape``.

    ``policy`` is ``None`` (the default), one :class:`Granularity` for every parameter, a
    callable ``(name, shape) -> Granularity``, or a mapping ``{fnmatch pattern: Granularity}``
    where the first matching pattern wins and unmatched names get the default.
    """
    if policy is None:
        return default_granularity(shape)
    if isinstance(policy, Granularity):
        return policy
    if isinstance(policy, Mapping):
        for pattern, gran in policy.items():
            if fnmatch.fnmatchcase(name, pattern):
                if not isinstance(gran, Granularity):
                    raise ValueError(
                        f"granularity policy maps {pattern!r} to {gran!r}, not a Granularity"
                    )
                return gran
        return default_granularity(shape)
    if callable(policy):
        gran = policy(name, shape)
        if not isinstance(gran, Granularity):
            raise ValueError(
                f"granularity policy returned {gran!r} for {name!r} {shape}, not a Granularity"
            )
        return gran
    raise ValueError(
        f"granularity must be None, a Granularity, a callable or a mapping, got {policy!r}"
    )


def policy_resolver(policy: GranularityPolicy) -> Callable[[str, tuple[int, ...]], Granularity]:
    """``resolve_policy(policy, ...)`` as a function of ``(name, shape)``, with the kind of
    ``policy`` decided once (a planner call resolves tens of thousands of parameters)."""
    if policy is None:
        return lambda name, shape: default_granularity(shape)
    if isinstance(policy, Granularity):
        return lambda name, shape: policy
    if callable(policy) and not isinstance(policy, Mapping):

        def call(name: str, shape: tuple[int, ...]) -> Granularity:
            gran = policy(name, shape)
            if not isinstance(gran, Granularity):
                raise ValueError(
                    f"granularity policy returned {gran!r} for {name!r} {shape}, not a "
                    f"Granularity"
                )
            return gran

        return call
    return lambda name, shape: resolve_policy(policy, name, shape)


@dataclass(frozen=True)
class CutSpec:
    """The cut structure of one parameter.

    ``prefix`` leading dims are flattened into ``rows`` rows of ``row_numel`` elements (the
    RaggedShard ``dims`` are ``range(prefix)``). A cut may fall only before row
    ``j * period + i * band`` (``0 <= i * band < period``) or at the end. ``work`` is the
    optimizer work of the whole tensor, spread evenly over its elements: Newton-Schulz FLOPs
    ``m*n*min(m,n)`` per owned matrix for matrix granularities, the numel otherwise.
    """

    shape: tuple[int, ...]
    prefix: int
    row_numel: int
    rows: int
    band: int
    period: int
    work: int

    @property
    def numel(self) -> int:
        return self.rows * self.row_numel

    @property
    def whole(self) -> bool:
        """True if the parameter can never be cut (it must sit inside one rank's chunk)."""
        return self.band >= self.rows

    @property
    def band_numel(self) -> int:
        """Elements of the largest uncuttable piece."""
        return min(self.band, self.rows) * self.row_numel

    @property
    def period_numel(self) -> int:
        return self.period * self.row_numel

    def cut_allowed(self, offset: int) -> bool:
        """Whether a cut ``offset`` elements into the parameter is allowed."""
        if offset <= 0 or offset >= self.numel:
            return True
        row, rem = divmod(offset, self.row_numel)
        return rem == 0 and (row % self.period) % self.band == 0



def _canonical(rows: int, band: int, period: int) -> tuple[int, int]:
    """Normalize ``(band, period)``. A band dividing its period is uniform (period == band), and
    so is a single period (``period == rows``): its short last band ends at the end, where a
    cut is always allowed, so every multiple of the band is a cut."""
    if band >= period:
        return max(period, 1), max(period, 1)
    if period % band == 0 or period == rows:
        return band, band
    return band, period


def _coarsen(spec: CutSpec, gran: Granularity, keep: int) -> CutSpec:
    """Restrict ``spec`` to cuts between whole slices ``x[i_0, ..., i_{keep-1}]``."""
    shape = spec.shape
    if keep == 0:
        return CutSpec(shape, 1, math.prod(shape[1:]), shape[0], max(shape[0], 1),
                       max(shape[0], 1), spec.work)
    if keep >= spec.prefix:
        return spec
    q = math.prod(shape[keep:spec.prefix])  # fine rows per coarse row
    rows = math.prod(shape[:keep])
    row_numel = spec.row_numel * q
    if spec.whole:
        band = period = max(rows, 1)
    elif spec.period % q == 0:
        band, period = _canonical(rows, spec.band // math.gcd(spec.band, q), spec.period // q)
    elif spec.band == spec.period:
        band = spec.band // math.gcd(spec.band, q)
        band, period = _canonical(rows, band, rows)
    else:
        raise ValueError(
            f"shape {shape}: granularity {gran} cannot keep dim {keep} whole "
            f"(its bands of {spec.band} rows do not align with slices of {q} rows)"
        )
    return CutSpec(shape, keep, row_numel, rows, band, period, spec.work)


def _newton_schulz_flops(m: int, n: int) -> int:
    """FLOPs of a Newton-Schulz orthogonalization step on an ``m x n`` matrix, up to a constant."""
    return m * n * min(m, n)


def resolve(name: str, shape: Sequence[int], gran: Granularity) -> CutSpec:
    """The :class:`CutSpec` of parameter ``name`` with ``shape`` under ``gran``."""
    try:
        return _resolve(tuple(int(s) for s in shape), gran)
    except ValueError as exc:
        raise ValueError(f"parameter {name!r}: {exc}") from None


@functools.lru_cache(maxsize=4096)
def _resolve(shape: tuple[int, ...], gran: Granularity) -> CutSpec:
    if not shape:
        raise ValueError("0-d tensor; RaggedShard needs at least one dim (reshape it to (1,))")
    if any(s < 0 for s in shape):
        raise ValueError(f"negative dim in shape {shape}")
    ndim = len(shape)
    numel = math.prod(shape)
    if gran.kind == "element":
        spec = CutSpec(shape, ndim, 1, numel, 1, 1, numel)
    elif gran.kind == "rows":
        band, period = _canonical(shape[0], gran.band_rows, shape[0])
        spec = CutSpec(shape, 1, math.prod(shape[1:]), shape[0], band, period, numel)
    elif gran.kind == "block":
        if ndim < 2:
            raise ValueError(
                f"shape {shape}: block granularity needs a matrix (>= 2 dims); "
                "use element or rows for 1-D parameters"
            )
        band, period = _canonical(math.prod(shape[:-1]), gran.band_rows, shape[-2])
        spec = CutSpec(shape, ndim - 1, shape[-1], math.prod(shape[:-1]), band, period, numel)
    elif gran.kind == "matrix" or ndim <= 2:
        rows = max(shape[0], 1)
        spec = CutSpec(shape, 1, math.prod(shape[1:]), shape[0], rows, rows,
                       _newton_schulz_flops(shape[0], numel // rows))
    else:  # matrices of a stacked tensor: cut between them
        m, n = shape[-2], shape[-1]
        stack = math.prod(shape[:-2])
        spec = CutSpec(shape, ndim - 2, m * n, stack, 1, 1, stack * _newton_schulz_flops(m, n))
    if gran.keep_dims_whole:
        bad = [d for d in gran.keep_dims_whole if d >= ndim]
        if bad:
            raise ValueError(
                f"shape {shape}: keep_dims_whole={gran.keep_dims_whole} names dims "
                f"{bad} beyond its {ndim} dims"
            )
        spec = _coarsen(spec, gran, min(gran.keep_dims_whole))
    return spec
