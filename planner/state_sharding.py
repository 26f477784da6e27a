r"""The partitioner: which :class:`~ragged_placement.fsdp.StateSharding` a model should train with.

:func:`plan_state_sharding` evaluates every valid per-state sharding of a mesh (AMSP's planner,
arXiv 2311.00257, without its pruning) with a memory model built from the planner's own layouts
and a communication model built from the collectives the runtime issues per step, and picks the
one with the least predicted communication time that fits a memory budget.

Memory per rank, bytes, per state (``P`` = the gather dtype ``param_dtype``, ``R`` =
``reduce_dtype``, ``s`` = each parameter's own (storage) dtype; ``W_X`` = the ranks state ``X`` is
sharded over). Each unit (and each dtype of a unit, as :class:`~ragged_placement.fsdp.FSDPUnit`
splits it) is planned once with ``plan_segmented(..., uneven=True)``, as ``fully_shard`` plans it,
at ``W_optim`` ranks; the ``grads`` and ``params`` chunks are ``W_optim / W_grads`` and
``W_optim / W_params`` consecutive optimizer chunks (the nested layout: a rank's optimizer shard
lies inside its gradient shard inside its parameter shard, every level cut on the plan's
granularity boundaries). ``c_X`` is the largest such chunk, padding included:

* ``params``: ``sum_units c_optim * s + c_params * P``: the optimizer steps its chunk in the
  parameters' own dtype (no separate fp32 master copy), and where ``optim`` spans more ranks than
  ``params`` the runtime keeps the parameter chunk it all-gathers from in ``P``, refreshed after
  each step (for ``params=()`` the whole unsharded buffer, kept between steps);
* ``grads``: ``sum_units c_optim * s``: the reduced gradient that persists (``.grad``) is the
  optimizer chunk's part, whatever ``grads`` is; sharding ``grads`` over fewer dims than
  ``optim`` changes the communication (an all-reduce over ``optim \ grads`` instead of a
  reduce-scatter), and the transient ``c_grads * R`` gradient chunk (in ``buffers``);
* ``optim``: ``sum_units c_optim * (state bytes of the unit / elements of the unit)``:
  ``"adamw"`` 2 moments in ``s`` (``torch.optim.AdamW`` and ours allocate ``zeros_like(param)``),
  ``"sgd"`` (with momentum) 1 buffer in ``s``, ``"muon"`` 1 momentum buffer in ``s`` for
  parameters with >= 2 dims and AdamW's 2 for the others, ``"shampoo"`` (our defaults: blocks of
  at most 1024, Adam grafting) per ``r x c`` block ``2 r^2 + 2 c^2`` fp32 (statistics and roots)
  plus 2 fp32 grafting moments per element. Exact for adamw and sgd (an upper bound by the
  chunk's padding); for muon and shampoo the unit's state is spread in proportion to chunk size;
* ``buffers``: the unsharded buffers held at once: the two largest units' all-gather outputs
  (``buffer * P``: the unit and the prefetched next one; with ``reshard_after_forward=False``
  every unit's, held from forward to backward), the largest ``c_params * P`` send buffer (when
  ``P != s``), and the largest unit's gradient buffers (``buffer * P``, its ``R`` cast when
  ``R != P``, the ``c_params * R`` reduce-scatter output).

Activations are not modelled: pass as ``memory_budget`` what is left for these states.

Communication per step (one micro-batch), per unit, per rank (``n`` = ranks in the collective's
group). An all-gather moves to each rank the gathered region less its own chunk, and a
reduce-scatter the same out of it: with equal chunks ``c`` that is the ring's ``(n - 1) c``;
with uneven chunks (an :class:`~ragged_placement.planner.UnevenPlan`) the most over ranks of
region less own chunk. ``g_X`` below is that count for the chunks of state ``X`` inside the
region they fill:

==================================================  =============================  ============
collective                                          bytes per rank                 ring steps
==================================================  =============================  ============
all-gather params over ``params`` dims (x2, or x1   ``g_params P`` (region: unit)  ``n - 1``
with ``reshard_after_forward=False``)
reduce-scatter grads over ``params`` dims           ``g_params R``                 ``n - 1``
reduce-scatter over ``grads \ params`` dims         ``g_grads R`` (region: c_P)    ``n - 1``
all-reduce over the dims outside ``grads``          ``2 (n - 1) / n c_grads R``    ``2 (n - 1)``
all-gather updated params over ``optim \ params``   ``g_optim P`` (region: c_P)    ``n - 1``
==================================================  =============================  ============

A collective over several dims is one ring over their ranks: its bytes and steps are charged to
its slowest dim (least bandwidth). Each dim's time is ``bytes / bandwidth[dim] + latency[dim] *
steps``; a candidate's time is the sum over dims (collectives serialized, no overlap with
compute modelled). ``bandwidth="profile"`` measures ``(bandwidth, latency)`` on the mesh for
each dim and each set of dims (:func:`profile_mesh`): a collective over a profiled set of dims
takes that set's fit (AMSP profiles each group), still charged to its slowest dim.

Expert parallelism (``ep``, searched with the sharding; off by default). Expert tensors are the
stacked ones of a unit: parameters named ``*.experts.*`` (``shared_experts`` excluded) with at
least 2 dims whose dim 0 is the unit's expert count ``E`` (the dim 0 of its 3-D ``[E, out, in]``
expert tensors). At degree ``ep`` the EP group fills the mesh from its innermost dim (inside a
node where it fits: ``ep`` divides the last dim's size, or is a multiple of it and spans the
dims it fills); a rank holds ``E / ep`` experts of every stacked tensor, and the per-state
sharding of those is applied over the remaining data-parallel ranks (each dim's size divided by
the EP ranks it holds), while the dense parameters are sharded over every data-parallel rank
(torchtitan's ``fully_shard(experts, mesh=dp_mod_ep)``). Memory: each unit's dense part and its
local experts, planned as above at their own sharding degrees, summed (the unit's gathered
buffers hold both). Communication: the dense part's collectives over their groups, the experts'
over theirs (groups of the reduced dims), and per MoE unit 4 all-to-alls a step (dispatch and
combine, forward and backward) of ``tokens_per_rank * top_k * hidden * itemsize * (ep - 1) / ep``
bytes per rank (uniform routing; ``hidden`` the last dim of the unit's input projection,
``w1``/``w3``/``gate_proj``/``up_proj``/``gate_up_proj``, else of its first 3-D expert tensor;
``itemsize`` of ``param_dtype``, or the experts' dtype), ``ep - 1`` steps each, charged to the
slowest dim the EP group spans. Activation recomputation's repeated all-to-alls are not
modelled. At ``ep > 1`` a sharding whose ``optim`` names only dims the EP group takes whole,
where other dims remain, is not a candidate: it would leave the experts replicated over those
(DDP), which ``parallelize_moe`` refuses.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import product
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from ragged_placement.planner.granularity import GranularityPolicy, policy_resolver
from ragged_placement.planner.profile import profile_mesh
from ragged_placement.planner.segments import plan_segmented
from ragged_placement.planner.sharding import StateSharding, mesh_dims
from ragged_placement.planner.uneven import UnevenPlan
from torch import nn
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "OPTIMIZERS", "ShardingCandidate", "StateShardingPlan", "StepCollective", "plan_state_sharding",
]

OPTIMIZERS = ("adamw", "sgd", "muon", "shampoo")
DEFAULT_BANDWIDTH = {"intra": 450e9, "inter": 50e9}
SHAMPOO_BLOCK = 1024
STATES = ("params", "grads", "optim", "buffers")

Entry = tuple[str, tuple[int, ...], torch.dtype]


@dataclass(frozen=True)
class StepCollective:
    """One kind of collective of a step, summed over units: ``op`` (``"all_gather"``,
    ``"reduce_scatter"``, ``"all_reduce"``) over the group of ``dims`` (``ranks`` ranks),
    ``calls`` times, moving ``bytes`` per rank in all; charged to mesh dim ``charged``, whose
    (or the profiled group's) bandwidth and latency give its ``seconds`` per step."""

    op: str
    dims: tuple[str, ...]
    ranks: int
    calls: int
    bytes: float
    charged: str
    seconds: float


@dataclass(frozen=True)
class ShardingCandidate:
    """One evaluated point: a :class:`StateSharding` and ``reshard_after_forward``.

    ``memory_per_rank``: bytes by state (``params``, ``grads``, ``optim``, ``buffers``);
    ``comm_bytes`` / ``comm_seconds``: per mesh dim, per step; ``fits``: within the budget;
    ``collectives``: what a step runs (the model's input for ``comm_*``); ``ep``: the
    expert-parallel degree (1: experts sharded like the dense parameters)."""

    sharding: StateSharding
    reshard_after_forward: bool
    memory_per_rank: dict[str, int]
    comm_bytes: dict[str, int]
    comm_seconds: dict[str, float]
    fits: bool
    collectives: tuple[StepCollective, ...]
    ep: int = 1

    @property
    def memory_total(self) -> int:
        return sum(self.memory_per_rank.values())

    @property
    def comm_seconds_total(self) -> float:
        return sum(self.comm_seconds.values())


class StateShardingPlan:
    """The partitioner's answer: the chosen candidate's fields, and every candidate ranked.

    Ranking: candidates within the budget first, by predicted communication seconds, then by
    memory; then the others by memory. The choice is the first."""

    candidates: tuple[ShardingCandidate, ...]
    memory_budget: float
    mesh: dict[str, int]
    bandwidth: dict[str, float]
    latency: dict[str, float]
    profiled: dict[tuple[str, ...], tuple[float, float]]

    def __init__(self, candidates: Sequence[ShardingCandidate], memory_budget: float,
                 mesh: Mapping[str, int], bandwidth: Mapping[str, float],
                 latency: Mapping[str, float],
                 profiled: Mapping[tuple[str, ...], tuple[float, float]]) -> None:
        self.candidates = tuple(candidates)
        self.memory_budget = memory_budget
        self.mesh, self.bandwidth, self.latency = dict(mesh), dict(bandwidth), dict(latency)
        self.profiled = dict(profiled)

    @property
    def choice(self) -> ShardingCandidate:
        return self.candidates[0]

    @property
    def sharding(self) -> StateSharding:
        return self.choice.sharding

    @property
    def reshard_after_forward(self) -> bool:
        return self.choice.reshard_after_forward

    @property
    def memory_per_rank(self) -> dict[str, int]:
        return self.choice.memory_per_rank

    @property
    def comm_seconds(self) -> dict[str, float]:
        return self.choice.comm_seconds

    @property
    def comm_bytes(self) -> dict[str, int]:
        return self.choice.comm_bytes

    @property
    def ep(self) -> int:
        return self.choice.ep

    def find(self, sharding: StateSharding, reshard_after_forward: bool = True,
             ep: int = 1) -> ShardingCandidate:
        """The evaluated candidate for ``sharding`` at expert-parallel degree ``ep`` (e.g.
        FSDP2's points, to compare)."""
        for c in self.candidates:
            if (c.sharding == sharding and c.reshard_after_forward == reshard_after_forward
                    and c.ep == ep):
                return c
        raise ValueError(f"no candidate {sharding} reshard_after_forward={reshard_after_forward} "
                         f"ep={ep}")

    def table(self, limit: int | None = None) -> str:
        """Every candidate (or the first ``limit``), ranked: degrees, memory per rank by state
        (GB), predicted communication seconds per dim and in total (4 significant digits)."""
        dims = list(self.mesh)
        show_ep = any(c.ep > 1 for c in self.candidates)
        head = (["#", "sharding", *(["ep"] if show_ep else []), "s_P", "s_G", "s_OS", "raf"]
                + [f"{s} GB" for s in STATES]
                + ["total GB", "fits"] + [f"{d} s" for d in dims] + ["comm s"])
        rows = []
        for i, c in enumerate(self.candidates[:limit]):
            deg = c.sharding.degrees(self.mesh)
            rows.append([str(i + 1), str(c.sharding), *([str(c.ep)] if show_ep else []),
                         *map(str, deg),
                         "T" if c.reshard_after_forward else "F",
                         *(f"{c.memory_per_rank[s] / 1e9:.4g}" for s in STATES),
                         f"{c.memory_total / 1e9:.4g}", "yes" if c.fits else "no",
                         *(f"{c.comm_seconds[d]:.4g}" for d in dims),
                         f"{c.comm_seconds_total:.4g}"])
        widths = [max(len(r[k]) for r in [head] + rows) for k in range(len(head))]
        lines = ["  ".join(h.rjust(w) for h, w in zip(r, widths)) for r in [head] + rows]
        return "\n".join([lines[0], "  ".join("-" * w for w in widths)] + lines[1:])

    def __repr__(self) -> str:
        c = self.choice
        return (f"StateShardingPlan({c.sharding}, reshard_after_forward={c.reshard_after_forward}, "
                f"ep={c.ep}, "
                f"memory {c.memory_total / 1e9:.2f} GB, comm {c.comm_seconds_total:.4f} s)")


# -- input: units -------------------------------------------------------------------------------
def _module_units(model: nn.Module, units: Sequence[nn.Module] | None) -> list[list[Entry]]:
    """Parameters of ``model`` grouped as ``fully_shard`` groups them when called on each of
    ``units`` (inner first) and then on ``model``: a parameter belongs to the innermost unit
    that holds it (tied parameters once). Units in module order, the root last."""
    order = {id(m): i for i, m in enumerate(model.modules())}
    if units is None:
        units = [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]
    for u in units:
        if not isinstance(u, nn.Module) or id(u) not in order:
            raise ValueError(f"units must be submodules of the model, got {type(u).__name__}")
    chosen = sorted({id(u): u for u in [*units, model]}.values(), key=lambda m: order[id(m)])
    names = {id(m): n for n, m in model.named_modules()}
    entries: list[list[Entry]] = [[] for _ in chosen]
    seen: set[int] = set()
    for k in reversed(range(len(chosen))):  # every module before its ancestors
        prefix = names[id(chosen[k])]
        for name, p in chosen[k].named_parameters():
            full = f"{prefix}.{name}" if prefix else name
            if isinstance(p, DTensor):
                raise ValueError(
                    f"model_or_named_shapes: parameter {full} is a DTensor (tensor parallel): "
                    f"pass the units as named shapes with its tensor-parallel local shape"
                )
            if id(p) not in seen:
                seen.add(id(p))
                entries[k].append((full, tuple(p.shape), p.dtype))
    return [e for e in entries if e]


def _entry(e: object, dtype: torch.dtype) -> Entry:
    if (isinstance(e, (tuple, list)) and len(e) in (2, 3) and isinstance(e[0], str)
            and isinstance(e[1], (tuple, list, torch.Size))
            and (len(e) == 2 or isinstance(e[2], torch.dtype))):
        shape = tuple(e[1])
        for d in shape:  # (a loop, not all(...): ~70,000 tensors for a 1T MoE)
            if not isinstance(d, int) or d < 0:
                break
        else:
            return e[0], shape, e[2] if len(e) == 3 else dtype
    raise ValueError(
        f"model_or_named_shapes: each parameter must be (name, shape) or (name, shape, dtype), "
        f"got {e!r}"
    )


def _units(model_or_named_shapes: object, units: Sequence[nn.Module] | None,
           dtype: torch.dtype) -> list[list[Entry]]:
    if isinstance(model_or_named_shapes, nn.Module):
        out = _module_units(model_or_named_shapes, units)
    else:
        if units is not None:
            raise ValueError("units is for an nn.Module; named shapes are grouped already")
        if isinstance(model_or_named_shapes, (str, bytes)) \
                or not isinstance(model_or_named_shapes, Sequence):
            raise ValueError(
                f"model_or_named_shapes must be an nn.Module or a list of units, got "
                f"{type(model_or_named_shapes).__name__}"
            )
        out = []
        for u in model_or_named_shapes:
            if isinstance(u, tuple) and len(u) == 2 and isinstance(u[0], str) \
                    and isinstance(u[1], (list, tuple)) and u[1] and isinstance(u[1][0], (list, tuple)):
                u = u[1]  # (unit name, entries), as planner.models.fsdp_units gives
            if not isinstance(u, (list, tuple)):
                raise ValueError(f"model_or_named_shapes: a unit must be a list of parameters, got {u!r}")
            out.append([_entry(e, dtype) for e in u])
    out = [u for u in out if u]
    if not out:
        raise ValueError("model_or_named_shapes holds no parameters")
    return out


# -- per-unit layouts (cached) ------------------------------------------------------------------
@dataclass(frozen=True)
class _Part:
    """One dtype of one unit: what its plan depends on."""

    shapes: tuple[tuple[int, ...], ...]
    granularities: tuple[Any, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:  # hashed once: parts key every cache
        object.__setattr__(self, "_hash", hash((self.shapes, self.granularities, self.dtype)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


def _parts(unit: list[Entry], grans: Sequence[Any]) -> tuple[_Part, ...]:
    """The unit's parts, one per dtype, ``grans`` giving each entry's granularity."""
    by_dtype: dict[torch.dtype, tuple[list, list]] = {}
    for e, g in zip(unit, grans):
        shapes, gs = by_dtype.setdefault(e[2], ([], []))
        shapes.append(e[1])
        gs.append(g)
    return tuple(_Part(tuple(shapes), tuple(gs), d) for d, (shapes, gs) in by_dtype.items())


@functools.lru_cache(maxsize=4096)
def _layout(part: _Part, world_size: int) -> tuple[int, int, np.ndarray | None]:
    """``(buffer_numel, equal chunk, rank_starts)`` of ``part`` planned at ``world_size``:
    ``rank_starts`` for an uneven plan, else ``None`` and every chunk is the equal chunk."""
    grans = dict(zip((str(i) for i in range(len(part.shapes))), part.granularities))
    plan = plan_segmented([(str(i), s) for i, s in enumerate(part.shapes)], world_size,
                          granularity=lambda name, shape: grans[name], dtype=part.dtype,
                          uneven=True)
    if isinstance(plan, UnevenPlan):
        return plan.buffer_numel, plan.chunk_numel, plan.rank_starts
    return plan.buffer_numel, plan.chunk_numel, None


@functools.lru_cache(maxsize=16384)
def _chunk(part: _Part, world_size: int, merge: int) -> int:
    """The largest chunk of ``merge`` consecutive ranks of ``part``'s plan at ``world_size``."""
    _, chunk, starts = _layout(part, world_size)
    if starts is None:
        return merge * chunk
    return int(np.diff(starts[::merge]).max())


@functools.lru_cache(maxsize=16384)
def _traffic(part: _Part, world_size: int, outer: int, inner: int) -> int:
    """Elements a rank receives when the ``outer // inner`` ranks sharing an ``outer``-merged
    region all-gather their ``inner``-merged chunks into it (or sends, reduce-scattering it):
    the most, over ranks, of the region less the rank's own chunk. Equal chunks ``c``:
    ``(outer // inner - 1) * c``."""
    _, chunk, starts = _layout(part, world_size)
    if starts is None:
        return (outer - inner) * chunk
    regions = np.diff(starts[::outer])
    own = np.diff(starts[::inner])
    return int((np.repeat(regions, outer // inner) - own).max())


@functools.lru_cache(maxsize=4096)
def _optim_bytes(part: _Part, optimizer: str) -> int:
    """Bytes of ``optimizer``'s state for the whole of ``part`` (see the module docstring)."""
    item = part.dtype.itemsize
    total = 0
    for shape in part.shapes:
        numel = math.prod(shape)
        if optimizer == "adamw":
            total += 2 * numel * item
        elif optimizer == "sgd":
            total += numel * item
        elif optimizer == "muon":
            total += (1 if len(shape) >= 2 else 2) * numel * item
        else:  # shampoo: fp32 statistics and roots per block, fp32 Adam grafting moments
            total += 2 * numel * 4
            if len(shape) >= 2:
                rows, cols = shape[-2:]
                r = _span_squares(rows)
                c = _span_squares(cols)
                n_row, n_col = -(-rows // SHAMPOO_BLOCK), -(-cols // SHAMPOO_BLOCK)
                total += math.prod(shape[:-2]) * 4 * 2 * (r * n_col + c * n_row)
    return total


def _span_squares(n: int) -> int:
    """Sum of squared block sizes of ``n`` cut into blocks of at most ``SHAMPOO_BLOCK``."""
    full, rest = divmod(n, SHAMPOO_BLOCK)
    return full * SHAMPOO_BLOCK**2 + rest**2


# -- arguments ----------------------------------------------------------------------------------
def _per_dim(arg: str, value: object, dims: Sequence[str], allow_zero: bool) -> dict[str, float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = {d: float(value) for d in dims}
    if not isinstance(value, Mapping):
        raise ValueError(f"{arg} must be a number or a mapping {{mesh dim: value}}, got {value!r}")
    missing = [d for d in dims if d not in value]
    extra = [d for d in value if d not in dims]
    if missing or extra:
        raise ValueError(
            f"{arg} must give one value per mesh dim {tuple(dims)}, got {dict(value)!r}"
            + (f" (missing {missing})" if missing else "") + (f" (unknown {extra})" if extra else "")
        )
    out = {}
    for d in dims:
        v = value[d]
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if not ok or v < 0 or (v == 0 and not allow_zero):
            raise ValueError(f"{arg}[{d!r}] must be a positive finite number, got {v!r}")
        out[d] = float(v)
    return out


def _candidates(dims: Sequence[str]) -> list[tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]]:
    """Every chain ``params ⊆ grads ⊆ optim`` of ``dims`` that shards something: each dim
    replicated (0), sharded for optim (1), grads and optim (2), or every state (3); not all
    replicated (DDP, which ``fully_shard`` refuses)."""
    out = []
    for levels in product(range(4), repeat=len(dims)):
        if any(levels):
            out.append(tuple(tuple(d for d, lv in zip(dims, levels) if lv >= k) for k in (3, 2, 1)))
    return out


# -- the models -------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Model:
    """What every candidate is evaluated against (the arguments of :func:`plan_state_sharding`)."""

    sizes: dict[str, int]
    optimizer: str
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    bandwidth: dict[str, float]
    latency: dict[str, float]
    profiled: dict[tuple[str, ...], tuple[float, float]]
    budget: float
    tokens_per_rank: int = 0
    top_k: int = 0


@dataclass
class _UnitCost:
    """Bytes per rank of one unit (all its dtypes) under one candidate."""

    states: dict[str, int]       # params, grads, optim
    gathered: int                # the all-gather output
    send: int                    # the mixed-precision send buffer
    grad_buffers: int            # gradient buffers, their reduce-dtype cast, reduce-scatter out
    traffic: dict[str, float]    # collective -> bytes moved


# collective -> (op, group: which dims, from the StateSharding)
_COLLECTIVES = {
    "ag": ("all_gather", "params"), "rs_p": ("reduce_scatter", "params"),
    "rs_g": ("reduce_scatter", "grads-params"), "ar": ("all_reduce", "replicated-grads"),
    "ag_o": ("all_gather", "optim-params"),
}


def _group_dims(sharding: StateSharding, dims: Sequence[str], group: str) -> tuple[str, ...]:
    if group == "params":
        return sharding.params
    if group == "replicated-grads":
        return tuple(d for d in dims if d not in sharding.grads)
    outer = sharding.grads if group == "grads-params" else sharding.optim
    return tuple(d for d in outer if d not in sharding.params)


def _unit_cost(parts: tuple[_Part, ...], degrees: tuple[int, int, int], replicas: int,
               reshard: bool, m: _Model) -> _UnitCost:
    """Memory and traffic of one unit at sharding degrees ``(W_params, W_grads, W_optim)``,
    gradients replicated over ``replicas`` ranks (see the module docstring)."""
    w_p, w_g, w_o = degrees
    k_p, k_g = w_o // w_p, w_o // w_g  # optimizer chunks per params / grads chunk
    cost = _UnitCost(dict.fromkeys(("params", "grads", "optim"), 0), 0, 0, 0,
                     dict.fromkeys(_COLLECTIVES, 0.0))
    for part in parts:
        gather_dt = m.param_dtype or part.dtype
        reduce_dt = m.reduce_dtype or gather_dt
        s, p, r = part.dtype.itemsize, gather_dt.itemsize, reduce_dt.itemsize
        buffer = _layout(part, w_o)[0]
        c_p, c_g, c_o = _chunk(part, w_o, k_p), _chunk(part, w_o, k_g), _chunk(part, w_o, 1)
        cast = gather_dt != part.dtype
        # the optimizer's chunk in s, and a parameter chunk in P where it holds more (for
        # params=() the whole unsharded buffer, kept between steps)
        cost.states["params"] += c_o * s + (c_p * p if k_p > 1 else 0)
        cost.states["grads"] += c_o * s  # .grad: the optimizer chunk's part of the reduction
        cost.states["optim"] += math.ceil(_optim_bytes(part, m.optimizer) * c_o / max(part.numel, 1))
        cost.gathered += buffer * p if w_p > 1 else 0
        cost.send += (c_o if k_p > 1 else c_p) * p if cast else 0
        cost.grad_buffers += (buffer * p + (buffer * r if reduce_dt != gather_dt else 0)
                              + c_p * r + (c_g * r if k_g > 1 and k_g < w_o else 0))
        unit_from_params = _traffic(part, w_o, w_o, k_p)
        cost.traffic["ag"] += unit_from_params * p * (2 if reshard else 1)
        cost.traffic["rs_p"] += unit_from_params * r
        cost.traffic["rs_g"] += _traffic(part, w_o, k_p, k_g) * r
        cost.traffic["ar"] += 2 * (replicas - 1) / replicas * c_g * r
        cost.traffic["ag_o"] += _traffic(part, w_o, k_p, 1) * p
    return cost


def _buffers(costs: list[tuple[_UnitCost, int]], reshard: bool) -> int:
    """Unsharded buffers held at once: the two largest all-gather outputs (the unit and the
    prefetched next one), or with ``reshard_after_forward=False`` every unit's; the largest send
    buffer and the largest unit's gradient buffers."""
    gathered = sorted(((c.gathered, n) for c, n in costs), reverse=True)
    if reshard:
        (largest, count), rest = gathered[0], gathered[1:]
        held = largest + (largest if count > 1 else rest[0][0] if rest else 0)
    else:
        held = sum(b * n for b, n in gathered)
    return held + max(c.send for c, _ in costs) + max(c.grad_buffers for c, _ in costs)


@dataclass(frozen=True)
class _Unit:
    """One distinct unit: its parts whole (``ep == 1``), and split into its dense parts and its
    stacked expert parts (``experts`` experts; ``hidden`` the all-to-all's row width)."""

    whole: tuple[_Part, ...]
    dense: tuple[_Part, ...]
    expert: tuple[_Part, ...]
    experts: int
    hidden: int


_EXPERT_NAME = re.compile(r"(^|\.)experts\.")
_SEPARATE_EXPERT = re.compile(r"(^|\.)experts\.\d+(\.|$)")


def _expert_split(unit: list[Entry]) -> tuple[list[int], list[int], int, int]:
    """``(dense, stacked expert entries, E, hidden)`` of a unit, the entries by their index in
    it (``E = 0``: no stacked experts)."""
    named = [i for i, e in enumerate(unit)  # the substring test first: most names have none
             if "experts." in e[0] and not _SEPARATE_EXPERT.search(e[0])
             and _EXPERT_NAME.search(e[0])]
    stacked = [unit[i] for i in named if len(unit[i][1]) == 3]
    counts = {e[1][0] for e in stacked}
    if len(counts) > 1:
        raise ValueError(
            f"model_or_named_shapes: a unit's stacked expert tensors disagree on the expert count "
            f"(dim 0): {[(e[0], e[1]) for e in stacked]}"
        )
    if not counts:
        return list(range(len(unit))), [], 0, 0
    experts = counts.pop()
    expert = [i for i in named if len(unit[i][1]) >= 2 and unit[i][1][0] == experts]
    taken = set(expert)
    return [i for i in range(len(unit)) if i not in taken], expert, experts, _hidden(stacked)


_INPUT_PROJ = re.compile(r"(^|\.)(w1|w3|gate_proj|up_proj|gate_up_proj)(\.weight)?$")


def _hidden(stacked: list[Entry]) -> int:
    """The row width of the all-to-all: the input dim (last, of ``[E, out, in]``) of an input
    projection (``w1``, ``w3``, ``gate_proj``, ``up_proj``, ``gate_up_proj``), else of the
    first stacked tensor."""
    named = [e for e in stacked if _INPUT_PROJ.search(e[0])]
    return (named or stacked)[0][1][-1]


def _unit(unit: list[Entry], granularity: GranularityPolicy) -> _Unit:
    resolve = policy_resolver(granularity)
    grans = [resolve(e[0], e[1]) for e in unit]  # once per tensor
    dense, expert, experts, hidden = _expert_split(unit)
    whole = _parts(unit, grans)
    if not expert:  # the dense parts are the whole unit's
        return _Unit(whole, whole, (), 0, 0)

    def parts(indices: list[int]) -> tuple[_Part, ...]:
        return _parts([unit[i] for i in indices], [grans[i] for i in indices]) if indices else ()

    return _Unit(whole, parts(dense), parts(expert), experts, hidden)


@functools.lru_cache(maxsize=4096)
def _local_experts(part: _Part, ep: int) -> _Part:
    """``part`` (stacked expert tensors) as one of ``ep`` expert-parallel ranks holds it."""
    return _Part(tuple((s[0] // ep, *s[1:]) for s in part.shapes), part.granularities, part.dtype)


def _ep_mesh(sizes: Mapping[str, int], ep: int) -> tuple[dict[str, int], tuple[str, ...]]:
    """``(sizes with the EP group's ranks divided out, the dims the EP group spans)``: the group
    fills the mesh from its innermost dim. ``ValueError`` naming ``ep`` where it does not fit."""
    reduced, spans, rest = dict(sizes), [], ep
    for d in reversed(list(sizes)):
        if rest == 1:
            break
        n = sizes[d]
        if rest % n and n % rest:
            break
        take = min(rest, n)
        reduced[d], rest = n // take, rest // take
        spans.append(d)
    if rest != 1:
        raise ValueError(
            f"ep={ep} cannot be laid on mesh {dict(sizes)}: the expert-parallel group fills the "
            f"mesh from its innermost dim, so ep must divide the data-parallel size "
            f"{math.prod(sizes.values())} and each dim it spans (or be a multiple of it); "
            f"use a divisor such as {math.gcd(ep, list(sizes.values())[-1])}"
        )
    return reduced, tuple(reversed(spans))


@dataclass(frozen=True)
class _Domain:
    """The ranks one set of parts is sharded over: ``sizes`` (the mesh, or the mesh with the EP
    group divided out) and the sharding degrees there."""

    sizes: dict[str, int]
    degrees: tuple[int, int, int]

    @property
    def replicas(self) -> int:
        return math.prod(self.sizes.values()) // self.degrees[1]

    def ranks(self, group: str) -> int:
        w_p, w_g, w_o = self.degrees
        return {"params": w_p, "grads-params": w_g // w_p, "optim-params": w_o // w_p,
                "replicated-grads": self.replicas}[group]


def _merge(a: _UnitCost, b: _UnitCost) -> _UnitCost:
    """Memory of a unit's dense part and its local experts, held together."""
    return _UnitCost({k: a.states[k] + b.states[k] for k in a.states}, a.gathered + b.gathered,
                     a.send + b.send, a.grad_buffers + b.grad_buffers, {})


def _domain_collectives(costs: list[tuple[_UnitCost, int]], sharding: StateSharding,
                        dom: _Domain, reshard: bool, m: _Model) -> list[StepCollective]:
    """The per-state collectives of ``costs`` (units and their counts) over ``dom``."""
    calls = sum(n for c, n in costs if any(c.traffic.values()) or c.gathered)
    out = []
    for key, (op, group) in _COLLECTIVES.items():
        total = sum(c.traffic[key] * n for c, n in costs)
        n_ranks = dom.ranks(group)
        # dims the EP group took whole are not in the experts' group (a size-1 dim of the
        # mesh itself stays, as without EP)
        group_dims = tuple(d for d in _group_dims(sharding, list(dom.sizes), group)
                           if dom.sizes[d] > 1 or m.sizes[d] == 1)
        if n_ranks == 1 or not total:
            continue
        n_calls = calls * (2 if key == "ag" and reshard else 1)
        out.append(_charged(op, group_dims, n_ranks, n_calls, total, m))
    return out


def _charged(op: str, dims: tuple[str, ...], n_ranks: int, calls: int, total: float,
             m: _Model) -> StepCollective:
    """A collective charged to its slowest dim (first of the slowest, mesh order)."""
    slow = min(dims, key=lambda d: m.bandwidth[d])
    bw, lat = m.profiled.get(dims, (m.bandwidth[slow], m.latency[slow]))
    steps = (2 if op == "all_reduce" else 1) * (n_ranks - 1) * calls
    return StepCollective(op, dims, n_ranks, calls, total, slow, total / bw + lat * steps)


def _evaluate(units: list[tuple[_Unit, int]], sharding: StateSharding,
              reshard: bool, m: _Model, ep: int = 1) -> ShardingCandidate:
    """One candidate: memory per state, and each collective's bytes and time per step."""
    dims = list(m.sizes)
    dense = _Domain(m.sizes, sharding.degrees(m.sizes))
    dense_costs, expert_costs, merged = [], [], []
    if ep == 1:
        dense_costs = [(_unit_cost(u.whole, dense.degrees, dense.replicas, reshard, m), n)
                       for u, n in units]
        merged = dense_costs
    else:
        ep_sizes, ep_dims = _ep_mesh(m.sizes, ep)
        experts = _Domain(ep_sizes, sharding.degrees(ep_sizes))
        for u, n in units:
            d = _unit_cost(u.dense, dense.degrees, dense.replicas, reshard, m)
            local = tuple(_local_experts(p, ep) for p in u.expert)
            e = _unit_cost(local, experts.degrees, experts.replicas, reshard, m)
            dense_costs.append((d, n))
            expert_costs.append((e, n))
            merged.append((_merge(d, e), n))
    mem = {state: sum(c.states[state] * n for c, n in merged) for state in ("params", "grads", "optim")}
    mem["buffers"] = _buffers(merged, reshard)
    collectives = _domain_collectives(dense_costs, sharding, dense, reshard, m)
    if ep > 1:
        collectives += _domain_collectives(expert_costs, sharding, experts, reshard, m)
        moe = [(u, n) for u, n in units if u.experts]
        per_row = m.tokens_per_rank * m.top_k * (ep - 1) / ep
        total = sum(4 * n * per_row * u.hidden * (m.param_dtype or u.expert[0].dtype).itemsize
                    for u, n in moe)
        collectives.append(_charged("all_to_all", ep_dims, ep, 4 * sum(n for _, n in moe), total, m))
    comm_bytes, seconds = dict.fromkeys(dims, 0), dict.fromkeys(dims, 0.0)
    for c in collectives:
        comm_bytes[c.charged] += round(c.bytes)
        seconds[c.charged] += c.seconds
    return ShardingCandidate(sharding, reshard, mem, comm_bytes, seconds,
                             sum(mem.values()) <= m.budget, tuple(collectives), ep)


def _ep_candidates(ep: object, units: list[tuple[_Unit, int]], sizes: dict[str, int]) -> tuple[int, ...]:
    """The expert-parallel degrees to search: ``None`` -> ``(1,)``; ``"auto"`` -> every degree
    that divides every unit's expert count and lays on the mesh; else the given ints, checked."""
    counts = sorted({u.experts for u, _ in units if u.experts})
    world = math.prod(sizes.values())
    if ep is None:
        return (1,)
    if isinstance(ep, str):
        if ep != "auto":
            raise ValueError(f"ep must be None, 'auto', an int or a sequence of ints, got {ep!r}")
        out = []
        for d in range(1, world + 1):
            if world % d or any(e % d for e in counts) or (d > 1 and not counts):
                continue
            try:
                _ep_mesh(sizes, d)
            except ValueError:
                continue
            out.append(d)
        return tuple(out)
    values = (ep,) if isinstance(ep, int) else ep
    if not isinstance(values, Sequence) or not values or any(
            isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
        raise ValueError(f"ep must be None, 'auto', a positive int or a sequence of them, got {ep!r}")
    for v in values:
        if v == 1:
            continue
        if not counts:
            raise ValueError(
                f"ep={v}: the model has no stacked expert tensors (parameters named *.experts.* "
                f"of shape [E, out, in]) to shard by expert; use ep=None"
            )
        bad = [e for e in counts if e % v]
        if bad:
            raise ValueError(f"ep={v} does not divide the expert count {bad[0]}: use a divisor of "
                             f"{math.gcd(*counts)}")
        if world % v:
            raise ValueError(f"ep={v} does not divide the data-parallel size {world} of mesh {sizes}")
        _ep_mesh(sizes, v)
    return tuple(dict.fromkeys(values))


def _experts_sharded(sharding: StateSharding, sizes: Mapping[str, int], ep: int) -> bool:
    """Whether ``sharding`` at degree ``ep`` can shard the experts: its ``optim`` names a dim the
    EP group does not take whole, or the EP group takes every dim whole (nothing is left to
    shard the experts over). Otherwise the experts would be replicated over the remaining
    ranks (DDP), which the runtime refuses (``parallelize_moe``'s ``state_sharding`` with the
    ep dim dropped from each state)."""
    if ep == 1:
        return True
    reduced, spans = _ep_mesh(sizes, ep)
    left = [d for d in sizes if d not in spans or reduced[d] > 1]
    return not left or any(d in left for d in sharding.optim)


def _routing(degrees: tuple[int, ...], units: list[tuple[_Unit, int]], tokens_per_rank: object,
             top_k: object) -> tuple[int, int]:
    """``(tokens_per_rank, top_k)``, checked where a degree above 1 is searched."""
    if max(degrees) == 1:
        return 0, 0
    for arg, v in (("tokens_per_rank", tokens_per_rank), ("top_k", top_k)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{arg} must be a positive int where ep searches expert parallelism "
                             f"(ep degrees {degrees}), got {v!r}")
    fewest = min(u.experts for u, _ in units if u.experts)
    if top_k > fewest:
        raise ValueError(f"top_k={top_k} exceeds the expert count {fewest} of a unit")
    return tokens_per_rank, top_k


def plan_state_sharding(
    model_or_named_shapes: nn.Module | Sequence[Any],
    mesh: DeviceMesh | Mapping[str, int],
    memory_budget: float,
    bandwidth: Mapping[str, float] | str = DEFAULT_BANDWIDTH,
    optimizer: str = "adamw",
    param_dtype: torch.dtype | None = torch.bfloat16,
    *,
    reduce_dtype: torch.dtype | None = None,
    latency: Mapping[str, float] | float = 0.0,
    dtype: torch.dtype = torch.float32,
    units: Sequence[nn.Module] | None = None,
    granularity: GranularityPolicy = None,
    ep: int | Sequence[int] | str | None = None,
    tokens_per_rank: int | None = None,
    top_k: int | None = None,
) -> StateShardingPlan:
    """Choose per-state sharding (AMSP's partitioner) from a memory and communication model.

    Every valid :class:`~ragged_placement.fsdp.StateSharding` of the mesh (every chain
    ``params ⊆ grads ⊆ optim`` of its dims: ``4 ** ndim`` points, AMSP's ``s_G in {s_P, s_OS}``
    not imposed) is evaluated with ``reshard_after_forward`` True and False (only True where
    ``params`` is empty: nothing is gathered), by the models of the module docstring. Units are
    planned once per distinct shape and world size (cached), so a 1T-parameter MoE on 16,384
    ranks plans in well under a second.

    Args:
        model_or_named_shapes: an ``nn.Module`` (on any device, ``meta`` included), grouped into
            units as ``fully_shard`` would be when called on each of ``units`` and then on the
            model; or a list of units, each a list of ``(name, shape)`` or
            ``(name, shape, dtype)`` (``dtype``: the stored dtype, default ``dtype``), or a
            ``(unit name, that list)`` pair as :func:`ragged_placement.planner.models.fsdp_units`
            returns. Every parameter is counted as trained (gradient and optimizer state).
        mesh: the data-parallel mesh (no tensor-parallel dims): a ``DeviceMesh`` with
            ``mesh_dim_names``, or a mapping ``{dim name: size}`` in mesh order (plan 16,384
            ranks without any process).
        memory_budget: bytes per rank available to parameters, gradients, optimizer state and
            the unsharded buffers (not activations).
        bandwidth: bytes/s per rank per mesh dim (``{"intra": 450e9, "inter": 50e9}``: NVLink
            per direction, one 400 Gb/s NIC per GPU), or ``"profile"`` to measure bandwidth and
            latency on ``mesh`` (a ``DeviceMesh``; a collective call on every rank,
            :func:`profile_mesh`).
        optimizer: ``"adamw"``, ``"sgd"`` (with momentum), ``"muon"`` or ``"shampoo"``.
        param_dtype: the dtype parameters are gathered and computed in (mixed precision's
            ``param_dtype``; ``None``: their own).
        reduce_dtype: the dtype gradients are reduced in (``None``: ``param_dtype``).
        latency: seconds per ring step per mesh dim (or one number); ignored with ``"profile"``.
        dtype: stored dtype of named shapes given without one.
        units: with an ``nn.Module``, the submodules that are units (default: every child of
            every ``nn.ModuleList``).
        granularity: the planner's policy, as ``fully_shard``'s ``granularity``.
        ep: expert-parallel degrees to search with the sharding (module docstring): ``None``
            (default) plans without expert parallelism; ``"auto"`` every degree that divides
            every unit's expert count and the data-parallel size and lays on the mesh (only 1
            for a model without stacked experts); or an int or a sequence of ints.
        tokens_per_rank: tokens each rank routes per step (micro-batch x sequence length);
            required where a degree above 1 is searched.
        top_k: experts per token; required where a degree above 1 is searched.

    Returns:
        A :class:`StateShardingPlan`: ``.sharding``, ``.reshard_after_forward``,
        ``.memory_per_rank`` (bytes by state), ``.comm_seconds`` / ``.comm_bytes`` (per dim per
        step), ``.table()`` (every candidate, ranked).

    Raises:
        ValueError: an unknown ``optimizer``, a bad ``mesh``, ``bandwidth`` or ``latency`` (one
            value per mesh dim), bad named shapes, an ``ep`` that does not divide an expert
            count or the data-parallel size or does not lay on the mesh (or with no stacked
            experts), ``tokens_per_rank`` / ``top_k`` missing or bad where ``ep`` searches EP,
            or a ``memory_budget`` no candidate fits (naming the least memory found).
    """
    if not isinstance(optimizer, str) or optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r} is not modelled: use one of {OPTIMIZERS}")
    sizes = mesh_dims(mesh)
    budget_ok = isinstance(memory_budget, (int, float)) and not isinstance(memory_budget, bool)
    if not budget_ok or not memory_budget > 0:
        raise ValueError(f"memory_budget must be a positive number of bytes, got {memory_budget!r}")
    for arg, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if value is not None and not isinstance(value, torch.dtype):
            raise ValueError(f"{arg} must be a torch.dtype or None, got {value!r}")
    if isinstance(bandwidth, str):
        if bandwidth != "profile":
            raise ValueError(f"bandwidth must be a mapping or 'profile', got {bandwidth!r}")
        from torch.distributed.device_mesh import DeviceMesh

        if not isinstance(mesh, DeviceMesh):
            raise ValueError("bandwidth='profile' needs mesh to be a DeviceMesh (it measures it)")
        fits = profile_mesh(mesh)
        bw = {d: fits.get((d,), (math.inf, 0.0))[0] for d in sizes}
        lat = {d: fits.get((d,), (math.inf, 0.0))[1] for d in sizes}
    else:
        fits = {}
        bw = _per_dim("bandwidth", bandwidth, list(sizes), allow_zero=False)
        lat = _per_dim("latency", latency, list(sizes), allow_zero=True)
    counted: dict[_Unit, int] = {}
    for unit in _units(model_or_named_shapes, units, dtype):
        key = _unit(unit, granularity)
        counted[key] = counted.get(key, 0) + 1
    grouped = list(counted.items())
    degrees = _ep_candidates(ep, grouped, sizes)
    tokens, k = _routing(degrees, grouped, tokens_per_rank, top_k)
    model = _Model(sizes, optimizer, param_dtype, reduce_dtype, bw, lat, fits, float(memory_budget),
                   tokens, k)
    candidates = []
    for params, grads, optim in _candidates(list(sizes)):
        sharding = StateSharding(params=params, grads=grads, optim=optim)
        runnable = [d for d in degrees if _experts_sharded(sharding, sizes, d)]
        for reshard in (True, False) if params else (True,):
            candidates += [_evaluate(grouped, sharding, reshard, model, d) for d in runnable]
    fitting = sorted((c for c in candidates if c.fits),
                     key=lambda c: (c.comm_seconds_total, c.memory_total, str(c.sharding), c.ep))
    if not fitting:
        least = min(candidates, key=lambda c: c.memory_total)
        raise ValueError(
            f"memory_budget={memory_budget:.4g} bytes per rank fits no StateSharding of mesh "
            f"{sizes}: the least memory found is {least.memory_total:.4g} bytes ({least.sharding}, "
            f"reshard_after_forward={least.reshard_after_forward}, ep={least.ep}); raise "
            f"memory_budget or add ranks" + ("" if max(degrees) > 1 or not any(u.experts for u, _ in grouped)
                                            else ", or search expert parallelism (ep='auto')")
        )
    rest = sorted((c for c in candidates if not c.fits),
                  key=lambda c: (c.memory_total, c.comm_seconds_total, str(c.sharding), c.ep))
    return StateShardingPlan(fitting + rest, float(memory_budget), sizes, bw, lat, fits)
