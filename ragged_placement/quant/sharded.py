"""FP8 all-gather of a sharded FSDP unit: quantize own blocks locally, gather FP8 + scales once.

An FSDP unit keeps its parameters in one flat fp32 buffer; rank ``r`` holds elements
``[r * S, (r + 1) * S)`` (``S`` = ``chunk_numel``), or ``[rank_starts[r], rank_starts[r + 1])``
with uneven per-rank chunks (:class:`~ragged_placement.planner.UnevenPlan`). When every cut
falls on a ``block[0]``-row boundary of each 2-D weight it crosses (what the planner guarantees
with a 128-row granularity, i.e. ``RaggedShard`` runs of whole 128-row bands), each rank owns
whole quantization blocks: it quantizes them with no communication (no cross-rank amax), and
one all-gather per unit moves

* 1 byte per element of every quantized weight (e4m3),
* one fp32 scale per ``block`` (each block is owned by exactly one rank),

(a quantized weight is a 2-D matrix or a stack ``[*stack, m, n]`` of matrices, e.g. the experts
of an MoE layer, each matrix quantized in its own blocks: a block never holds rows of two
matrices, and a cut may fall between matrices or on a ``block[0]``-row boundary of one),
* the non-quantized parameters (norms, biases, ...) in ``raw_dtype``,
* and, in an equal all-gather, padding up to the largest rank's send size. Where that padding
  exceeds 1% of the payload (:func:`~ragged_placement.planner.gather_starts`) the gather is
  uneven instead: rank ``r``'s bytes land at ``send_starts[r]``, with no padding but 16-byte
  alignment.

:class:`FP8GatherLayout` computes, from shapes and offsets only (identical on every rank), the
byte layout of each rank's send buffer::

    [ scales (fp32) | raw params (raw_dtype) | fp8 weights | padding ]   -> send_sizes[r]

with every region aligned to 16 bytes, and offers :meth:`~FP8GatherLayout.pack` (rank side)
and :meth:`~FP8GatherLayout.unpack` (gathered side). A weight whose cut does not fall on a block
boundary raises ``ValueError`` when the layout is built: never a silently wrong scale.

On the gathered side a weight held by one rank is a zero-copy view of the gathered buffer; a
weight split over several ranks is assembled by one copy of its FP8 bytes (1 byte/element; the
per-rank scale regions sit between the pieces).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ragged_placement.planner.uneven import gather_starts

from .blockwise import Kernel, quantize_blockwise_into
from .reference import FP8_DTYPE, check_block, scale_shape

__all__ = [
    "FP8GatherLayout", "FP8Piece", "FlatParam", "align_bytes", "byte_view", "first_block_row",
    "quantize_run",
]

_ALIGN = 16


def align_bytes(n: int) -> int:
    """``n`` bytes rounded up to the send buffers' alignment (16 bytes: every region of a send
    buffer starts where any dtype's tensor may)."""
    return -(-n // _ALIGN) * _ALIGN


def quantize_run(
    local: torch.Tensor,
    row_start: int,
    full_shape: Sequence[int],
    block: tuple[int, int] = (128, 128),
    *,
    q_out: torch.Tensor | None = None,
    s_out: torch.Tensor | None = None,
    kernel: Kernel = "auto",
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a rank's row run ``local = full[row_start:row_start + len(local)]`` of a 2-D weight.

    The result is bitwise equal to the matching rows of ``quantize_blockwise(full, block)``
    and its scales to the matching block-rows, because the run holds whole blocks:
    ``row_start`` must be a multiple of ``block[0]`` and the run must end on a multiple of
    ``block[0]`` or at the last row. Otherwise a block would be split between ranks and its
    scale would need a cross-rank amax: ``ValueError``. ``q_out`` / ``s_out`` may be views of a
    send buffer (written in place); they are allocated when omitted. Returns ``(q, s)``.
    ``check_finite`` as in :func:`quantize_blockwise_into`.
    """
    block = check_block(block)
    if len(full_shape) != 2:
        raise ValueError(f"full_shape must be 2-D, got {tuple(full_shape)}")
    m, n = (int(d) for d in full_shape)
    if local.dim() != 2 or local.shape[1] != n:
        raise ValueError(
            f"local must be [rows, {n}] for full_shape {(m, n)}, got {tuple(local.shape)}"
        )
    row_end = row_start + local.shape[0]
    _check_run_aligned(row_start, row_end, m, block, what=f"the run of a {(m, n)} weight")
    if q_out is None:
        q_out = torch.empty(local.shape, dtype=FP8_DTYPE, device=local.device)
    if s_out is None:
        s_out = torch.empty(
            scale_shape(local.shape, block), dtype=torch.float32, device=local.device
        )
    quantize_blockwise_into(local, q_out, s_out, block, kernel=kernel, check_finite=check_finite)
    return q_out, s_out


def _check_run_aligned(
    row_start: int, row_end: int, rows: int, block: tuple[int, int], what: str,
    matrix_rows: int | None = None,
) -> None:
    """``ValueError`` unless rows ``[row_start, row_end)`` of ``rows`` hold whole blocks: both
    ends on a ``block[0]``-row boundary of one matrix (of ``matrix_rows`` rows, stacked; the
    whole ``rows`` by default) or at the end of one."""
    bm = block[0]
    m = max(matrix_rows or rows, 1)
    if not 0 <= row_start <= row_end <= rows:
        raise ValueError(f"row range [{row_start}, {row_end}) is outside [0, {rows}) for {what}")
    if (row_start % m) % bm or (row_end % m) % bm:
        per = f" of each {m}-row matrix" if m != rows else ""
        raise ValueError(
            f"{what} holds rows [{row_start}, {row_end}), which cuts a {block} quantization block "
            f"(runs must start on a multiple of {bm} rows{per} and end on one or at the end of "
            f"a matrix); shard this weight at {bm}-row granularity"
        )


def first_block_row(row: int, m: int, bm: int) -> int:
    """The index of the first block row at or after flat row ``row`` of a stack of ``m``-row
    matrices, each with ``ceil(m / bm)`` block rows (``row``: a block boundary)."""
    return (row // m) * -(-m // bm) + -(-(row % m) // bm)


def _matrix_runs(
    shape: Sequence[int], row_start: int, row_end: int, bm: int
) -> list[tuple[int, int, int, int]]:
    """Rows ``[row_start, row_end)`` of the flat ``[prod(shape[:-1]), n]`` view of a stack of
    matrices, as runs that each quantize as one 2-D weight: ``(first, last, row, rows)``, rows
    ``[first, last)`` of the range being rows ``[row, row + last - first)`` of a ``rows``-row
    matrix. Where ``bm`` divides the matrices' rows no block can straddle two of them and the
    whole range is one run; otherwise one run per matrix."""
    m = shape[-2]
    group = math.prod(shape[:-1]) if m % bm == 0 else m
    runs, row = [], row_start
    while row < row_end:
        end = min(row_end, (row // group + 1) * group)
        runs.append((row - row_start, end - row_start, row % group, group))
        row = end
    return runs


@dataclass(frozen=True)
class FlatParam:
    """One parameter of an FSDP unit in its flat buffer.

    Args:
        name: for error messages.
        shape: the parameter's shape.
        offset: element offset in the unit's (global, unsharded) flat buffer.
        quantize: quantize to block FP8 (a 2-D weight, or a stack ``[*stack, m, n]`` of
            matrices, each in its own blocks); otherwise gathered in ``raw_dtype``.
    """

    name: str
    shape: tuple[int, ...]
    offset: int
    quantize: bool

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if self.quantize and len(self.shape) < 2:
            raise ValueError(
                f"{self.name}: only matrices (or stacks of them) are block-quantized, got shape "
                f"{self.shape}"
            )
        if self.offset < 0:
            raise ValueError(f"{self.name}: offset must be >= 0, got {self.offset}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class FP8Piece:
    """The part of one parameter a rank holds, and where it sits in the rank's send buffer.

    ``start`` / ``end`` are element offsets inside the parameter (for a quantized weight they
    are whole rows: ``rows = (start // n, end // n)``). ``data_offset`` is the byte offset of
    the piece's FP8 (or raw) bytes in the send buffer, ``scale_offset`` that of its scales.
    """

    param: int
    start: int
    end: int
    chunk_offset: int
    data_offset: int
    scale_offset: int
    scale_numel: int


class FP8GatherLayout:
    """Byte layout of the single FP8 all-gather of one FSDP unit (see the module doc).

    Args:
        params: the unit's parameters with their flat offsets (non-overlapping).
        chunk_numel: ``S``, the per-rank element count of the flat buffer (with
            ``rank_starts``: the largest chunk, the size of every rank's sharded buffer).
        world_size: ranks in the gather; the flat buffer has ``world_size * S`` elements
            (``rank_starts[-1]`` with ``rank_starts``).
        block: weight quantization block.
        raw_dtype: dtype non-quantized parameters are gathered in (e.g. bf16 for mixed precision).
        rank_starts: uneven per-rank chunks: rank ``r`` holds ``[rank_starts[r],
            rank_starts[r + 1])`` of the flat buffer (the first elements of its chunk).
        equal: whether every rank sends ``send_nbytes`` (``True``, the default: one equal
            all-gather), its own aligned size (``False``: an uneven one), or as
            :func:`~ragged_placement.planner.gather_starts` decides (``None``).

    Attributes:
        send_sizes: bytes rank ``r`` sends.
        send_starts: ``W + 1`` byte offsets of the ranks' sends in the gathered buffer.
        send_nbytes: the largest send.
        uneven: whether the send sizes differ (the all-gather is uneven).

    Raises ``ValueError`` if a parameter does not fit in the flat buffer, parameters overlap, or
    a cut splits a quantization block of a weight.
    """

    def __init__(
        self,
        params: Sequence[FlatParam],
        chunk_numel: int,
        world_size: int,
        *,
        block: tuple[int, int] = (128, 128),
        raw_dtype: torch.dtype = torch.bfloat16,
        rank_starts: Sequence[int] | None = None,
        equal: bool | None = True,
    ) -> None:
        if chunk_numel <= 0 or world_size <= 0:
            raise ValueError(
                f"chunk_numel and world_size must be positive, got {chunk_numel}, {world_size}"
            )
        if raw_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"raw_dtype must be float32, bfloat16 or float16, got {raw_dtype}")
        self.params = tuple(params)
        self.chunk_numel = chunk_numel
        self.world_size = world_size
        self.block = check_block(block)
        self.raw_dtype = raw_dtype
        self.rank_starts = self._check_starts(rank_starts)
        self._by_offset = sorted(range(len(self.params)), key=lambda i: self.params[i].offset)
        self._check_params()
        self.pieces: list[list[FP8Piece]] = [self._rank_pieces(r) for r in range(world_size)]
        self.rank_nbytes = [self._rank_nbytes(ps) for ps in self.pieces]
        aligned = [align_bytes(n) for n in self.rank_nbytes]
        self.send_nbytes = max(aligned)
        if equal is None:
            starts = gather_starts(aligned)
        else:
            starts = None if equal else tuple(itertools.accumulate(aligned, initial=0))
        self.uneven = starts is not None
        self.send_starts: tuple[int, ...] = starts or tuple(
            r * self.send_nbytes for r in range(world_size + 1)
        )
        self.send_sizes = [b - a for a, b in itertools.pairwise(self.send_starts)]

    # -- construction ------------------------------------------------------------------------
    def _check_starts(self, rank_starts: Sequence[int] | None) -> tuple[int, ...]:
        if rank_starts is None:
            return tuple(r * self.chunk_numel for r in range(self.world_size + 1))
        starts = tuple(int(x) for x in rank_starts)
        sizes = [b - a for a, b in itertools.pairwise(starts)]
        if len(starts) != self.world_size + 1 or starts[0] != 0 or min(sizes) < 0 \
                or max(sizes) > self.chunk_numel:
            raise ValueError(
                f"rank_starts must be {self.world_size + 1} non-decreasing offsets from 0 with "
                f"chunks of at most chunk_numel={self.chunk_numel} elements, got {rank_starts!r}"
            )
        return starts

    def _check_params(self) -> None:
        total = self.rank_starts[-1]
        spans = [
            (p.offset, p.offset + p.numel, p.name)
            for p in (self.params[i] for i in self._by_offset)
        ]
        for (_, e0, n0), (s1, _, n1) in itertools.pairwise(spans):
            if s1 < e0:
                raise ValueError(
                    f"params {n0!r} and {n1!r} overlap in the flat buffer ({s1} < {e0})"
                )
        for s, e, name in spans:
            if e > total:
                raise ValueError(
                    f"param {name!r} ends at element {e}, past the flat buffer ({total})"
                )

    def _rank_pieces(self, rank: int) -> list[FP8Piece]:
        lo, hi = self.rank_starts[rank], self.rank_starts[rank + 1]
        # params in offset order: the ones overlapping [lo, hi) start at most one before the
        # first whose offset is >= lo (parameters do not overlap)
        first = bisect.bisect_left(self._by_offset, lo, key=lambda i: self.params[i].offset)
        held = []
        for i in self._by_offset[max(0, first - 1) :]:
            p = self.params[i]
            if p.offset >= hi:
                break
            start, end = max(lo, p.offset) - p.offset, min(hi, p.offset + p.numel) - p.offset
            if start >= end:
                continue
            if p.quantize:
                n = p.shape[-1]
                if start % n or end % n:
                    raise ValueError(
                        f"{p.name!r} {p.shape}: rank {rank}'s chunk cuts it inside a row (elements "
                        f"[{start}, {end})); shard it at {self.block[0]}-row granularity"
                    )
                _check_run_aligned(
                    start // n, end // n, p.numel // n, self.block,
                    f"rank {rank}'s part of {p.name!r}", matrix_rows=p.shape[-2],
                )
            held.append((i, start, end))
        # regions: scales, then raw, then fp8; each 16-byte aligned
        scale_off = 0
        pieces_scale = {}
        for i, start, end in held:
            p = self.params[i]
            if p.quantize:
                numel = self._scale_rows(p, start, end) * scale_shape(p.shape, self.block)[-1]
                pieces_scale[i] = (scale_off, numel)
                scale_off += 4 * numel
        raw_off = align_bytes(scale_off)
        data_offsets = {}
        for i, start, end in held:
            if not self.params[i].quantize:
                raw_off = -(-raw_off // self.raw_dtype.itemsize) * self.raw_dtype.itemsize
                data_offsets[i] = raw_off
                raw_off += (end - start) * self.raw_dtype.itemsize
        fp8_off = align_bytes(raw_off)
        for i, start, end in held:
            if self.params[i].quantize:
                data_offsets[i] = fp8_off
                fp8_off += end - start
        return [
            FP8Piece(
                i,
                start,
                end,
                self.params[i].offset + start - lo,
                data_offsets[i],
                *pieces_scale.get(i, (0, 0)),
            )
            for i, start, end in held
        ]

    def _scale_rows(self, p: FlatParam, start: int, end: int) -> int:
        """Block rows of a quantized ``p``'s elements ``[start, end)`` (whole blocks)."""
        n, m, bm = p.shape[-1], p.shape[-2], self.block[0]
        return first_block_row(end // n, m, bm) - first_block_row(start // n, m, bm)

    def _rank_nbytes(self, pieces: list[FP8Piece]) -> int:
        ends = [0]
        for pc in pieces:
            itemsize = 1 if self.params[pc.param].quantize else self.raw_dtype.itemsize
            ends.append(pc.data_offset + (pc.end - pc.start) * itemsize)
        return max(ends)

    # -- byte accounting ---------------------------------------------------------------------
    @property
    def gathered_nbytes(self) -> int:
        """Bytes of the gathered buffer (what every rank receives): ``send_starts[-1]``
        (``world_size * send_nbytes`` when the gather is equal)."""
        return self.send_starts[-1]

    @property
    def fp8_nbytes(self) -> int:
        """FP8 payload: one byte per element of every quantized weight."""
        return sum(p.numel for p in self.params if p.quantize)

    @property
    def scale_nbytes(self) -> int:
        """Scale payload: 4 bytes per block of every quantized weight."""
        return sum(
            4 * math.prod(scale_shape(p.shape, self.block)) for p in self.params if p.quantize
        )

    @property
    def raw_nbytes(self) -> int:
        """Payload of the non-quantized parameters in ``raw_dtype``."""
        return sum(p.numel * self.raw_dtype.itemsize for p in self.params if not p.quantize)

    @property
    def padding_nbytes(self) -> int:
        """Gathered bytes that carry no payload (alignment and equal-size padding)."""
        return self.gathered_nbytes - self.fp8_nbytes - self.scale_nbytes - self.raw_nbytes

    # -- rank side ---------------------------------------------------------------------------
    def pack(
        self,
        rank: int,
        local_chunk: torch.Tensor,
        send: torch.Tensor | None = None,
        *,
        kernel: Kernel = "auto",
    ) -> torch.Tensor:
        """Quantize ``rank``'s blocks of ``local_chunk`` (its ``S`` flat fp32/bf16 elements) into
        ``send``.

        ``send`` is a ``uint8`` tensor of ``send_sizes[rank]`` bytes (allocated when omitted) and is what
        the rank passes to the all-gather. Padding bytes are zeroed (deterministic buffers).
        An inf/NaN in a quantized weight is not raised here (one rank raising before the
        collective would leave the others waiting in it): it makes that block's scale
        non-finite, which :meth:`unpack` detects on every rank alike.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        if local_chunk.dim() != 1 or local_chunk.numel() != self.chunk_numel:
            raise ValueError(
                f"local_chunk must be 1-D with {self.chunk_numel} elements, got "
                f"{tuple(local_chunk.shape)}"
            )
        nbytes = self.send_sizes[rank]
        if send is None:
            send = torch.empty(nbytes, dtype=torch.uint8, device=local_chunk.device)
        elif send.dtype != torch.uint8 or send.shape != (nbytes,) or not send.is_contiguous():
            raise ValueError(
                f"send must be a contiguous uint8 tensor of {nbytes} bytes, got "
                f"{send.dtype} {tuple(send.shape)}"
            )
        for pc in self.pieces[rank]:
            p = self.params[pc.param]
            src = local_chunk[pc.chunk_offset : pc.chunk_offset + pc.end - pc.start]
            if p.quantize:
                self._pack_quantized(p, pc, src, send, kernel)
            else:
                nbytes = (pc.end - pc.start) * self.raw_dtype.itemsize
                send[pc.data_offset : pc.data_offset + nbytes].view(self.raw_dtype).copy_(src)
        self._zero_gaps(rank, send)
        return send

    def _pack_quantized(
        self, p: FlatParam, pc: FP8Piece, src: torch.Tensor, send: torch.Tensor, kernel: Kernel
    ) -> None:
        """Quantize the rows ``src`` of piece ``pc`` into its FP8 bytes and scales in ``send``,
        each matrix of a stack in its own blocks (:func:`_matrix_runs`)."""
        n = p.shape[-1]
        rows = (pc.end - pc.start) // n
        q_out = send[pc.data_offset : pc.data_offset + rows * n].view(FP8_DTYPE).view(rows, n)
        s_out = send[pc.scale_offset : pc.scale_offset + 4 * pc.scale_numel].view(torch.float32)
        s_out = s_out.view(-1, scale_shape(p.shape, self.block)[-1])
        x = src.view(rows, n)
        for first, last, row, full_rows in _matrix_runs(
            p.shape, pc.start // n, pc.end // n, self.block[0]
        ):
            s_first = self._scale_rows(p, pc.start, pc.start + first * n)
            s_last = self._scale_rows(p, pc.start, pc.start + last * n)
            quantize_run(
                x[first:last],
                row,
                (full_rows, n),
                self.block,
                q_out=q_out[first:last],
                s_out=s_out[s_first:s_last],
                kernel=kernel,
                check_finite=False,
            )

    def _zero_gaps(self, rank: int, send: torch.Tensor) -> None:
        used = []
        for pc in self.pieces[rank]:
            itemsize = 1 if self.params[pc.param].quantize else self.raw_dtype.itemsize
            used.append((pc.data_offset, pc.data_offset + (pc.end - pc.start) * itemsize))
            if pc.scale_numel:
                used.append((pc.scale_offset, pc.scale_offset + 4 * pc.scale_numel))
        pos = 0
        for a, b in sorted(used):
            if a > pos:
                send[pos:a].zero_()
            pos = max(pos, b)
        send[pos:].zero_()

    # -- gathered side -----------------------------------------------------------------------
    def unpack(
        self, gathered: torch.Tensor, *, check_finite: bool = True
    ) -> list[torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
        """View the gathered buffer as every parameter, in ``params`` order.

        Quantized weights come back as ``(q, s)`` (``float8_e4m3fn`` of the weight's shape and
        fp32 ``[*stack, ceil(m / bm), ceil(n / bn)]``), equal bitwise to ``quantize_blockwise``
        of the full weight (of each matrix of a stack); other parameters as ``raw_dtype`` tensors of their shape. A parameter held
        by one rank aliases ``gathered``'s storage (with its own version counter, so refilling
        the buffer does not trip autograd's saved-tensor check); one split over ranks is
        concatenated (a copy).

        ``check_finite`` checks every gathered scale at once (one reduction and one host sync)
        and raises ``ValueError`` naming the weight whose shard held an inf/NaN; all ranks see
        the same bytes, so all raise together. A runtime that checks for non-finite values
        elsewhere (e.g. the gradient norm) can pass ``False`` to avoid the sync.
        """
        if gathered.dtype != torch.uint8 or gathered.shape != (self.gathered_nbytes,):
            raise ValueError(
                f"gathered must be uint8 of {self.gathered_nbytes} bytes, got {gathered.dtype} "
                f"{tuple(gathered.shape)}"
            )
        if check_finite:
            self._check_finite_scales(gathered)
        by_param: dict[int, list[tuple[int, FP8Piece]]] = {}
        for rank, pieces in enumerate(self.pieces):
            for pc in pieces:
                by_param.setdefault(pc.param, []).append((rank, pc))
        out: list[torch.Tensor | tuple[torch.Tensor, torch.Tensor]] = []
        for i, p in enumerate(self.params):
            parts = sorted(by_param.get(i, []), key=lambda rp: rp[1].start)
            if not parts:  # an empty parameter
                dtype = FP8_DTYPE if p.quantize else self.raw_dtype
                empty = torch.empty(p.shape, dtype=dtype, device=gathered.device)
                if p.quantize:
                    sshape = scale_shape(p.shape, self.block)
                    empty = (empty, torch.empty(sshape, device=gathered.device))
                out.append(empty)
            elif p.quantize:
                qs, ss = zip(*(self._view_quantized(gathered, r, pc, p) for r, pc in parts))
                sshape = scale_shape(p.shape, self.block)
                out.append((_cat(qs).view(p.shape), _cat(ss).view(sshape)))
            else:
                raws = [self._view_raw(gathered, r, pc) for r, pc in parts]
                out.append(_cat(raws).view(p.shape))
        return out

    def _check_finite_scales(self, gathered: torch.Tensor) -> None:
        # each rank's scales sit at the front of its segment: one masked check over [W, max]
        counts = [sum(pc.scale_numel for pc in pieces) for pieces in self.pieces]
        most = max(counts)
        if most == 0:
            return
        starts = torch.tensor(self.send_starts[:-1], device=gathered.device)
        index = starts.unsqueeze(1) + torch.arange(4 * most, device=gathered.device)
        scales = gathered[index.clamp_(max=gathered.numel() - 1)].view(torch.float32)
        valid = torch.arange(most, device=gathered.device) < torch.tensor(
            counts, device=gathered.device
        ).unsqueeze(1)
        if bool((torch.isfinite(scales) | ~valid).all()):
            return
        bad = []
        for rank, pieces in enumerate(self.pieces):
            for pc in pieces:
                s = scales[rank, pc.scale_offset // 4 : pc.scale_offset // 4 + pc.scale_numel]
                if pc.scale_numel and not bool(torch.isfinite(s).all()):
                    bad.append(f"{self.params[pc.param].name!r} (rank {rank})")
        raise ValueError(f"inf or NaN in the FP8 weights {', '.join(bad)}; cannot quantize")

    def _view_quantized(self, gathered: torch.Tensor, rank: int, pc: FP8Piece, p: FlatParam):
        base = self.send_starts[rank]
        n = p.shape[-1]
        rows = (pc.end - pc.start) // n
        nb = scale_shape(p.shape, self.block)[-1]
        q = byte_view(gathered, base + pc.data_offset, FP8_DTYPE, (rows, n))
        s = byte_view(gathered, base + pc.scale_offset, torch.float32, (pc.scale_numel // nb, nb))
        return q, s

    def _view_raw(self, gathered: torch.Tensor, rank: int, pc: FP8Piece) -> torch.Tensor:
        return byte_view(
            gathered, self.send_starts[rank] + pc.data_offset, self.raw_dtype, (pc.end - pc.start,)
        )


def byte_view(
    buf: torch.Tensor, byte_offset: int, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """A contiguous ``dtype`` tensor over ``buf``'s storage at ``byte_offset`` with its own version
    counter: refilling ``buf`` (the next all-gather into the same storage) does not invalidate
    tensors autograd saved from it, as FSDP's free-and-refill of unsharded storage requires."""
    start = buf.storage_offset() + byte_offset  # buf is uint8: offsets are bytes
    if start % dtype.itemsize:
        raise ValueError(
            f"gathered buffer offset {start} is not aligned to {dtype} ({dtype.itemsize} bytes)"
        )
    out = torch.empty(0, dtype=dtype, device=buf.device)
    out.set_(
        buf.untyped_storage(),
        start // dtype.itemsize,
        shape,
        torch.empty(shape, device="meta").stride(),
    )
    return out


def _cat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(list(parts))
