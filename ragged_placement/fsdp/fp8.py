"""Block-wise FP8 all-gather of an FSDP unit (``fully_shard(..., quant=BlockFP8Config(...))``).

Which parameters train in FP8: the 2-D weights of ``nn.Linear`` modules (exactly
``nn.Linear``, swapped for :class:`~ragged_placement.quant.FP8Linear` by ``fully_shard``;
subclasses with their own forward are left alone) that every owner uses as a Linear weight; a
weight tied to an embedding stays in high precision. Also the stacks of matrices ``[*stack, m,
n]`` that a module names in its class attribute ``fp8_stacks`` (MoE experts:
:class:`~ragged_placement.models.moe.GroupedExperts`' ``w1``/``w2``/``w3``, each expert's matrix
an ``fp8_linear`` weight); ``fully_shard`` sets such a module's ``quant`` and its
``fp8_weights[name] = (q, s)`` (``q`` of the stack's shape, ``s`` of :func:`~ragged_placement.
quant.reference.scale_shape`: one scale per block of each matrix). A stack may be a
tensor-parallel ``Shard(0)`` DTensor, sharded by whole matrices (expert parallelism): the unit
then gathers and quantizes the TP-local stack. They are planned at ``Granularity.block(*block)``
(whole ``block[0]``-row bands per rank; of one matrix, for a stack: a block never holds rows of
two experts), so every rank quantizes its own blocks from the fp32 master shard with no
communication.

Per unshard (:class:`FP8UnitGather`), with ``W`` ranks and one
:class:`~ragged_placement.quant.FP8GatherLayout` per segment of the unit's plan:

1. ``pack``: each rank quantizes its blocks and copies its other parameters (in
   ``param_dtype``) into a uint8 send buffer (per segment: fp32 scales, raw parameters, FP8
   bytes, padding; segments back to back).
2. one all-gather of the send buffers into ``gathered`` (rank ``r``'s at ``send_starts[r]``).
   A unit of one segment (equal or uneven per-rank chunks) gathers its ranks' sends unpadded
   where padding them to the largest would add more than 1% of the payload (:attr:`segment`
   is then uneven: ``W`` broadcasts, see :func:`~ragged_placement.planner.gather_starts`); a
   unit of several (equal) segments pads every rank's send to the largest.
3. the unsharded values are fixed aliases created once: a parameter held by one rank aliases
   ``gathered`` (zero-copy); one split over ranks aliases a small ``assembled`` buffer that its
   pieces are copied into (one byte copy per piece; scales and FP8 bytes of a split weight are
   not adjacent in ``gathered``). Both storages are allocated on unshard and freed on reshard,
   and because the aliases keep their storages, tensors autograd saved in forward see the
   values re-gathered for backward (as the unit's unsharded parameters do).

An FP8 weight's unsharded ``nn.Parameter`` is only a gradient sink: a zero-stride tensor of the
weight's shape (its values read as zeros; ``FP8Linear`` reads ``weight_fp8`` instead) whose
``.grad`` the unit presets to its view of the flat gradient buffer, so the weight gradient lands
there in place and goes through the unit's one reduce-scatter like every other gradient.

Non-finite master weights are not checked here (that would cost a host sync per unshard): they
give a non-finite block scale, so the forward produces NaN, as a bf16 all-gather would.
"""

from __future__ import annotations

import fnmatch
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import Shard

from ragged_placement.fsdp.gather import PlainGather, PlainGathers
from ragged_placement.fsdp.param import ParamSlot
from ragged_placement.planner import Granularity, Segment
from ragged_placement.planner.granularity import resolve, resolve_policy
from ragged_placement.planner.layout import FlatLayout
from ragged_placement.quant import (
    BlockFP8Config,
    FlatParam,
    FP8GatherLayout,
    FP8Linear,
    convert_to_fp8_linear,
)
from ragged_placement.quant.reference import FP8_DTYPE, scale_shape
from ragged_placement.quant.sharded import align_bytes, byte_view, first_block_row

if TYPE_CHECKING:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

__all__ = [
    "FP8Gathers",
    "FP8UnitGather",
    "check_quant",
    "convert_unit_linears",
    "fp8_config",
    "fp8_granularity",
    "fp8_stacks",
    "is_fp8_weight",
    "segment_layouts",
    "unit_gathers",
]


def check_quant(quant: object) -> BlockFP8Config | None:
    """Validate ``fully_shard``'s ``quant`` argument."""
    if quant is not None and not isinstance(quant, BlockFP8Config):
        raise ValueError(f"quant must be a BlockFP8Config or None, got {quant!r}")
    return quant


def fp8_stacks(module: nn.Module) -> tuple[str, ...]:
    """The parameters ``module`` computes with as stacks of FP8 matrices (its class attribute
    ``fp8_stacks``; see the module doc)."""
    return tuple(getattr(type(module), "fp8_stacks", ()))


def fp8_config(module: nn.Module) -> BlockFP8Config | None:
    """The FP8 config ``module`` computes with: an ``FP8Linear``'s ``config``, the ``quant`` of
    a module with ``fp8_stacks``; ``None`` for any other module (or one not set)."""
    if isinstance(module, FP8Linear):
        return module.config
    return getattr(module, "quant", None) if fp8_stacks(module) else None


def is_fp8_weight(owners: Sequence[tuple[nn.Module, str]], shape: Sequence[int]) -> bool:
    """Whether a parameter trains in FP8: 2-D and the ``weight`` of Linear modules only (a
    weight tied to an embedding or used elsewhere stays in high precision), or a stack of
    matrices (>= 3-D) that every owner names in its ``fp8_stacks``."""
    if len(shape) == 2:
        return all(
            attr == "weight" and (type(m) is nn.Linear or isinstance(m, FP8Linear))
            for m, attr in owners
        )
    return len(shape) > 2 and all(attr in fp8_stacks(m) for m, attr in owners)


def _set_fp8_weight(module: nn.Module, attr: str, weight) -> None:
    """Point ``module``'s FP8 view of its parameter ``attr`` at the gathered ``(q, s)``
    (``None``: none, the module is sharded)."""
    if isinstance(module, FP8Linear):
        module.weight_fp8 = weight
        return
    weights = getattr(module, "fp8_weights", None)
    if weights is None:
        module.fp8_weights = weights = {}
    if weight is None:
        weights.pop(attr, None)
    else:
        weights[attr] = weight


def convert_unit_linears(
    module: nn.Module,
    slots: Sequence,
    params: Sequence[torch.Tensor],
    quant: BlockFP8Config,
) -> None:
    """Swap the ``nn.Linear`` modules whose weight is one of this unit's FP8 weights (``slots``
    with ``.fqn``, ``.owners``, ``.shape``, parallel to ``params``) for :class:`FP8Linear`
    sharing its parameters, and set ``quant`` on the modules that own its FP8 stacks
    (``ValueError`` if one has another config). Modules of inner ``fully_shard`` units are left
    alone."""
    if type(module) is nn.Linear:
        raise ValueError(
            "fully_shard(quant=...) swaps the nn.Linear children of module for FP8Linear; a bare "
            "nn.Linear cannot swap itself: shard its parent module"
        )
    ids = set()
    for slot, p in zip(slots, params):
        if not is_fp8_weight(slot.owners, slot.shape):
            continue
        for m, _ in slot.owners:
            config = fp8_config(m)
            if config is not None and config != quant:
                raise ValueError(
                    f"{slot.fqn} belongs to a {type(m).__name__} with FP8 config {config}, but "
                    f"fully_shard got quant={quant}"
                )
            if fp8_stacks(m):
                m.quant = quant
        ids.add(id(p))
    convert_to_fp8_linear(module, quant, filter_fn=lambda _, linear: id(linear.weight) in ids)


def _explicit(policy, name: str, shape: tuple[int, ...]) -> Granularity | None:
    """The granularity ``policy`` names for ``name``, or ``None`` if it leaves it to the default."""
    if policy is None:
        return None
    if isinstance(policy, Mapping) and not any(fnmatch.fnmatchcase(name, p) for p in policy):
        return None
    return resolve_policy(policy, name, shape)


def _keeps_blocks(name: str, shape: tuple[int, ...], gran: Granularity, bm: int) -> bool:
    """Whether every cut ``gran`` allows in an ``[m, n]`` weight (or a stack ``[*stack, m, n]``
    of them) falls on a ``bm``-row boundary of one matrix or between two."""
    spec = resolve(name, shape, gran)
    if spec.whole:
        return True
    band, period = spec.band * spec.row_numel, spec.period * spec.row_numel
    if band % shape[-1]:  # a cut inside a row
        return False
    blocks = resolve(name, shape, Granularity.block(bm, 1))
    # both cut patterns repeat with their periods: check one common period
    span = min(spec.numel, math.lcm(period, blocks.period * blocks.row_numel))
    return all(
        blocks.cut_allowed(start + offset)
        for start in range(0, span, period)
        for offset in range(0, period, band)
    )


def fp8_granularity(policy, fp8_shapes: Mapping[str, tuple[int, int]], block: tuple[int, int]):
    """The planner policy of an FP8 unit: FP8 weights the user's ``policy`` does not name get
    ``Granularity.block(*block)``; one it names keeps the user's granularity if that never cuts a
    block (e.g. ``rows(256)``, ``matrix()``), else ``ValueError`` naming the weight. Other
    parameters follow ``policy``."""
    bm, bn = block
    for name, shape in fp8_shapes.items():
        gran = _explicit(policy, name, shape)
        if gran is not None and not _keeps_blocks(name, shape, gran, bm):
            raise ValueError(
                f"granularity {gran} of FP8 weight {name} {tuple(shape)} lets the planner cut "
                f"its {block} quantization blocks, whose scales would then need a cross-rank "
                f"amax; give it Granularity.block({bm}, {bn}) (the default under quant) or a "
                f"coarser granularity"
            )
    default = Granularity.block(bm, bn)

    def resolved(name: str, shape: tuple[int, ...]) -> Granularity:
        if name in fp8_shapes:
            return _explicit(policy, name, shape) or default
        return resolve_policy(policy, name, shape)

    return resolved


def unit_gathers(quant: BlockFP8Config | None) -> PlainGathers | FP8Gathers:
    """How the flat buffers of a unit with ``fully_shard``'s ``quant`` (checked,
    :func:`check_quant`) gather: plainly without one."""
    return PlainGathers() if quant is None else FP8Gathers(quant)


class FP8Gathers(PlainGathers):
    """How the flat buffers of a unit under ``quant`` gather: a buffer holding FP8 weights
    (:func:`is_fp8_weight`) with its :class:`FP8UnitGather`, the others plainly (the interface
    of :class:`~ragged_placement.fsdp.gather.PlainGathers`; ``slots``: a buffer's
    parameters)."""

    def __init__(self, quant: BlockFP8Config) -> None:
        self.quant = quant

    @staticmethod
    def _quantized(slots: Sequence[ParamSlot]) -> list[bool]:
        return [is_fp8_weight(s.owners, s.shape) for s in slots]

    def check_unit(self, slots: Sequence[ParamSlot], params: Sequence[torch.Tensor]) -> None:
        """``ValueError`` unless the unit's parameters share a dtype (the FP8 gather packs its
        other parameters in one dtype)."""
        by_dtype: dict[torch.dtype, list[str]] = {}
        for slot, p in zip(slots, params):
            by_dtype.setdefault(p.dtype, []).append(slot.fqn)
        if len(by_dtype) > 1:
            found = "; ".join(f"{d}: {', '.join(names[:3])}" for d, names in by_dtype.items())
            raise ValueError(
                f"all parameters of one fully_shard unit must share a dtype, got {found}. Give "
                f"the differently-typed modules units of their own (fully_shard them first), "
                f"or cast the module to one dtype and use mp_policy for the compute dtype"
            )

    def check_params(self, slots: Sequence[ParamSlot],
                     tp_specs: Sequence[DTensorSpec | None]) -> None:
        """``ValueError`` if tensor-parallel parameters share a buffer with FP8 weights, unless
        each is an FP8 stack sharded by whole matrices (``Shard(0)``, expert parallelism):
        its TP-local stack holds whole matrices, quantized as one process would."""
        quantized = self._quantized(slots)
        if not any(quantized):
            return
        bad = [
            f"{s.fqn} ({tuple(t.placements)})"
            for s, t, q in zip(slots, tp_specs, quantized)
            if t is not None and not (q and len(s.shape) > 2 and t.placements == (Shard(0),))
        ]
        if bad:
            raise ValueError(
                f"quant composes with tensor-parallel parameters only for stacks of FP8 "
                f"matrices sharded by whole matrices (Shard(0), expert parallelism); got "
                f"{', '.join(bad)}: shard them without quant, or as Shard(0) stacks"
            )

    def granularity(self, slots: Sequence[ParamSlot], policy):
        """``policy`` keeping whole quantization blocks of the FP8 weights
        (:func:`fp8_granularity`)."""
        quantized = self._quantized(slots)
        if not any(quantized):
            return policy
        fp8_shapes = {s.fqn: tuple(s.shape) for s, q in zip(slots, quantized) if q}
        return fp8_granularity(policy, fp8_shapes, self.quant.block)

    def check_cast(self, slots: Sequence[ParamSlot], dtype: torch.dtype,
                   param_dtype: torch.dtype | None) -> None:
        """``ValueError`` unless the parameters gathered beside the FP8 weights stay float32,
        bfloat16 or float16 (without a ``param_dtype``, the buffer's dtype is theirs)."""
        allowed = (torch.float32, torch.bfloat16, torch.float16)
        fp8 = [s.fqn for s, q in zip(slots, self._quantized(slots)) if q]
        if fp8 and param_dtype is None and dtype not in allowed:
            raise ValueError(
                f"cannot cast the FP8 unit holding {fp8[0]} to {dtype}: the parameters it "
                f"all-gathers next to the FP8 weights must be float32, bfloat16 or float16"
            )

    def sends_chunk(self, slots: Sequence[ParamSlot]) -> bool:
        """Not for a buffer holding FP8 weights (it sends packed blocks and scales)."""
        return not any(self._quantized(slots))

    def build(self, plan: FlatLayout, slots: Sequence[ParamSlot], param_dtype: torch.dtype,
              device: torch.device, shared: torch.Tensor | None
              ) -> PlainGather | FP8UnitGather:
        """A buffer's gather on ``device``: its :class:`FP8UnitGather` (the other parameters
        in ``param_dtype``) if it holds FP8 weights, else the plain one."""
        quantized = self._quantized(slots)
        if not any(quantized):
            return PlainGather(plan, slots, param_dtype, device, shared)
        return FP8UnitGather(
            plan, [s.fqn for s in slots], [s.shape for s in slots], quantized,
            [s.requires_grad for s in slots], self.quant, param_dtype, device,
        )


class FP8UnitGather:
    """The FP8 all-gather buffers of one unit and its unsharded tensors (see the module doc).

    A segmented plan (several flat layouts, :func:`~ragged_placement.planner.plan_segmented`)
    gets one :class:`FP8GatherLayout` per segment; a rank sends the concatenation of its
    per-segment send buffers, so the unit still issues one all-gather.

    Args:
        plan: the unit's ``Plan`` or ``SegmentedPlan``.
        names, shapes: the unit's parameters (names as in ``plan``).
        quantized: per parameter, whether it trains in FP8.
        requires_grad: per parameter, for the unsharded ``nn.Parameter``.
        quant: block size and kernel choice.
        raw_dtype: ``param_dtype``: dtype of the other parameters and of the gradient sinks.
        device: where the buffers live.

    Attributes:
        layouts: one :class:`FP8GatherLayout` per plan segment.
        send_starts: ``W + 1`` byte offsets of the ranks' sends in ``gathered``.
        send_nbytes: the largest send (every rank's, when the gather is equal).
        segment: the all-gather of the sends as a plan
            :class:`~ragged_placement.planner.Segment` of bytes (uneven: ``rank_starts``).
        gathered: the uint8 all-gather output, ``send_starts[-1]`` bytes.
        params: the unsharded ``nn.Parameter`` per parameter (gradient sinks for FP8 weights).
        weights: ``(q, s)`` per FP8 weight (``None`` for the others), for ``FP8Linear.weight_fp8``.

    It has the interface of :class:`~ragged_placement.fsdp.gather.PlainGather` (built in its
    place for a flat buffer holding FP8 weights by :class:`FP8Gathers`).
    """

    def __init__(
        self,
        plan,
        names: Sequence[str],
        shapes: Sequence[torch.Size],
        quantized: Sequence[bool],
        requires_grad: Sequence[bool],
        quant: BlockFP8Config,
        raw_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.quant = quant
        self.world_size = plan.world_size
        self.segments = plan.segments
        self.layouts = segment_layouts(plan, dict(zip(names, quantized)), quant.block, raw_dtype)
        self._send_offsets = list(
            itertools.accumulate([lay.send_nbytes for lay in self.layouts], initial=0)
        )
        if len(self.layouts) == 1:
            self.send_starts = self.layouts[0].send_starts
        else:  # equal segments, each padded to its largest rank: sends back to back
            self.send_starts = tuple(r * self._send_offsets[-1] for r in range(self.world_size + 1))
        self.send_nbytes = max(b - a for a, b in itertools.pairwise(self.send_starts))
        uneven = len(self.layouts) == 1 and self.layouts[0].uneven
        self.segment = Segment(0, 0, self.send_nbytes, self.send_starts if uneven else None)
        index = {n: i for i, n in enumerate(names)}
        # per parameter: (byte offset of the holding rank's segment send buffer, its piece)
        parts: list[list[tuple[int, object]]] = [[] for _ in names]
        for k, layout in enumerate(self.layouts):
            for rank, pieces in enumerate(layout.pieces):
                base = self.send_starts[rank] + self._send_offsets[k]
                for pc in pieces:
                    parts[index[layout.params[pc.param].name]].append((base, pc))
        # byte regions of the split parameters in ``assembled`` and the copies that fill them
        self._copies: list[tuple[int, int, int]] = []  # (gathered offset, assembled offset, n)
        regions: list[dict[str, int]] = []
        end = 0
        for i, q in enumerate(quantized):
            region = {}
            if len(parts[i]) > 1:
                numel = shapes[i].numel()
                region["data"] = end
                end = align_bytes(end + numel * (1 if q else raw_dtype.itemsize))
                if q:
                    region["scale"] = end
                    end = align_bytes(end + 4 * math.prod(scale_shape(shapes[i], quant.block)))
            regions.append(region)
        self.gathered = torch.empty(self.gathered_nbytes, dtype=torch.uint8, device=device)
        self.assembled = torch.empty(end, dtype=torch.uint8, device=device)
        self.params: list[nn.Parameter] = []
        self.weights: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for i, (shape, q) in enumerate(zip(shapes, quantized)):
            split = len(parts[i]) > 1
            buf = self.assembled if split else self.gathered
            if split:
                self._plan_copies(parts[i], regions[i], shape, q, raw_dtype)
            data, scale = self._offsets(parts[i], regions[i], split)
            if q:
                sink = torch.zeros((), dtype=raw_dtype, device=device).expand(shape)
                self.params.append(nn.Parameter(sink, requires_grad=requires_grad[i]))
                self.weights.append(
                    (
                        byte_view(buf, data, FP8_DTYPE, tuple(shape)),
                        byte_view(buf, scale, torch.float32, scale_shape(shape, quant.block)),
                    )
                )
            else:
                t = byte_view(buf, data, raw_dtype, tuple(shape))
                self.params.append(nn.Parameter(t, requires_grad=requires_grad[i]))
                self.weights.append(None)
        self.send_segments = [self.segment]
        self._storages = [self.gathered.untyped_storage(), self.assembled.untyped_storage()]
        self._nbytes = [s.nbytes() for s in self._storages]
        self.free()

    @staticmethod
    def _offsets(parts, region: dict[str, int], split: bool) -> tuple[int, int]:
        """Byte offsets of a parameter's data and scales in ``assembled`` or ``gathered``."""
        if split:
            return region["data"], region.get("scale", 0)
        if not parts:  # an empty parameter: any in-bounds offset
            return 0, 0
        base, pc = parts[0]
        return base + pc.data_offset, base + pc.scale_offset

    def _plan_copies(self, parts, region, shape, quantized: bool, raw_dtype) -> None:
        itemsize = 1 if quantized else raw_dtype.itemsize
        for base, pc in parts:
            n = (pc.end - pc.start) * itemsize
            self._copies.append((base + pc.data_offset, region["data"] + pc.start * itemsize, n))
            if quantized:
                cols, rows, bm = shape[-1], shape[-2], self.quant.block[0]
                block_row0 = first_block_row(pc.start // cols, rows, bm)
                nb = scale_shape(shape, self.quant.block)[-1]
                self._copies.append(
                    (
                        base + pc.scale_offset,
                        region["scale"] + 4 * block_row0 * nb,
                        4 * pc.scale_numel,
                    )
                )

    @property
    def gathered_nbytes(self) -> int:
        """Bytes of the unit's all-gather (what every rank receives)."""
        return self.send_starts[-1]

    @property
    def padding_nbytes(self) -> int:
        """Gathered bytes that carry no payload (planner padding, alignment, equal sizes)."""
        return self.gathered_nbytes - sum(
            lay.fp8_nbytes + lay.scale_nbytes + lay.raw_nbytes for lay in self.layouts
        )

    @property
    def assembled_nbytes(self) -> int:
        """Bytes of the buffer that split parameters are assembled in (0 if none is split)."""
        return self._nbytes[1]

    def allocate(self) -> None:
        """Give ``gathered`` and ``assembled`` their storage (before the all-gather)."""
        for storage, nbytes in zip(self._storages, self._nbytes):
            storage.resize_(nbytes)

    def free(self) -> None:
        """Release both storages (the aliases stay, pointing at empty storage)."""
        for storage in self._storages:
            storage.resize_(0)

    def stage_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """:meth:`pack` quantizes the sharded chunk from its own ``dtype`` (a CPU-offload
        staging copy keeps it)."""
        return dtype

    def register_weights(self, slots, *, sharded: bool) -> None:
        """Point each FP8 weight's ``FP8Linear.weight_fp8`` (a stack's ``fp8_weights[name]``)
        at its gathered ``(q, s)`` (none while ``sharded``): the module reads them, not the
        parameter."""
        for slot, w in zip(slots, self.weights):
            if w is not None:
                for module, attr in slot.owners:
                    _set_fp8_weight(module, attr, None if sharded else w)

    def pack(self, rank: int, sharded: torch.Tensor) -> torch.Tensor:
        """Quantize ``rank``'s blocks of its flat master chunk (all segments) into a new send
        buffer of ``send_starts[rank + 1] - send_starts[rank]`` bytes."""
        nbytes = self.send_starts[rank + 1] - self.send_starts[rank]
        send = torch.empty(nbytes, dtype=torch.uint8, device=sharded.device)
        for seg, layout, lo, hi in zip(
            self.segments, self.layouts, self._send_offsets, self._send_offsets[1:]
        ):
            chunk = sharded[seg.chunk_offset : seg.chunk_offset + seg.chunk_numel]
            layout.pack(rank, chunk, send[lo : min(hi, nbytes)], kernel=self.quant.kernel)
        return send

    def assemble(self) -> None:
        """After the all-gather: copy the pieces of split parameters into ``assembled``."""
        for src, dst, n in self._copies:
            self.assembled[dst : dst + n].copy_(self.gathered[src : src + n])


def segment_layouts(
    plan, quantized: Mapping[str, bool], block: tuple[int, int], raw_dtype: torch.dtype
) -> list[FP8GatherLayout]:
    """One :class:`FP8GatherLayout` per segment of ``plan`` (a ``Plan`` or an ``UnevenPlan`` is
    one segment), with ``quantized[name]`` telling which parameters train in FP8. A plan of one
    segment gathers equal or uneven sends (:func:`~ragged_placement.planner.gather_starts`
    decides); the segments of a ``SegmentedPlan`` are each padded to their largest rank."""
    parts = getattr(plan, "parts", (plan,))
    return [
        FP8GatherLayout(
            [FlatParam(n, part.shapes[n], part.offsets[n], quantized[n]) for n in part.names],
            part.chunk_numel,
            part.world_size,
            block=block,
            raw_dtype=raw_dtype,
            rank_starts=part.segments[0].rank_starts,
            equal=None if len(parts) == 1 else True,
        )
        for part in parts
    ]
