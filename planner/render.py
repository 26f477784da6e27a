"""Pictures of a plan: an ASCII map and a dependency-free PNG."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Mapping, Sequence
from typing import Protocol

from ragged_placement.placement import RaggedShard

__all__ = ["ascii_map", "save_png"]


class Plan(Protocol):
    """What a picture reads of a plan (:class:`~ragged_placement.planner.plan.Plan`,
    :class:`~ragged_placement.planner.UnevenPlan`): the parameters in buffer order, each one's
    run of each rank's chunk and the rows it holds."""

    names: Sequence[str]
    order: Sequence[str]
    world_size: int
    chunk_numel: int
    shapes: Mapping[str, tuple[int, ...]]
    placements: Mapping[str, RaggedShard]

    @property
    def padding_fraction(self) -> float: ...

    def local_slice(self, name: str, rank: int) -> tuple[int, int]: ...

_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
_PAD = "."


def _shown_ranks(world_size: int, max_ranks: int) -> list[int]:
    """All ranks, or the first and last ``max_ranks // 2`` of them."""
    if world_size <= max_ranks:
        return list(range(world_size))
    half = max(max_ranks // 2, 1)
    return list(range(half)) + list(range(world_size - half, world_size))


def _segments(plan: Plan, rank: int) -> list[tuple[int, int, str]]:
    """``(begin, end, name)`` of every non-empty local run in ``rank``'s chunk, in order."""
    out = []
    for name in plan.order:
        begin, end = plan.local_slice(name, rank)
        if end > begin:
            out.append((begin, end, name))
    return out


def ascii_map(plan: Plan, width: int = 64, max_ranks: int = 32) -> str:
    """One line per rank: a bar of ``width`` characters (a letter per parameter, ``.`` for
    padding) and the rows of each parameter the rank holds. Long worlds show the first and last
    ``max_ranks // 2`` ranks."""
    if width < 1 or max_ranks < 1:
        raise ValueError(f"width and max_ranks must be positive, got {width}, {max_ranks}")
    letter = {n: _LETTERS[i] if i < len(_LETTERS) else "#" for i, n in enumerate(plan.order)}
    s = plan.chunk_numel
    lines = [
        f"{len(plan.names)} params over {plan.world_size} ranks, chunk {s:,} elements, padding "
        f"{100 * plan.padding_fraction:.3f}%  ({_PAD} = padding)"
    ]
    shown = _shown_ranks(plan.world_size, max_ranks)
    rw = len(str(plan.world_size - 1))
    prev = -1
    for rank in shown:
        if rank != prev + 1:
            lines.append(f"{'':>{rw + 5}} ... {rank - prev - 1} ranks ...")
        prev = rank
        segs = _segments(plan, rank)
        bar = [_PAD] * width
        for begin, end, name in segs:
            lo = begin * width // s
            hi = max(-(-end * width // s), lo + 1)
            for k in range(lo, min(hi, width)):
                bar[k] = letter[name]
        parts = []
        for _, _, name in segs:
            row0, row1 = plan.placements[name].local_row_range(plan.shapes[name], rank)
            parts.append(f"{letter[name]}:{name}[{row0}:{row1}]")
        lines.append(f"rank {rank:>{rw}} |{''.join(bar)}| {' '.join(parts)}")
    return "\n".join(lines)


def _color(i: int) -> tuple[int, int, int]:
    """A distinct, deterministic color for parameter ``i`` (golden-ratio hue walk)."""
    import colorsys

    r, g, b = colorsys.hsv_to_rgb((i * 0.618033988749895) % 1.0, 0.65, 0.9)
    return int(r * 255), int(g * 255), int(b * 255)


def _png_chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))


def save_png(plan: Plan, path: str, width: int = 512, max_ranks: int = 1024) -> None:
    """Write the plan as an RGB PNG: one band of pixel rows per rank (rank 0 on top), ``width``
    pixels across its chunk, a color per parameter (in buffer order, as the ASCII map's
    letters), light grey for padding. Worlds larger than ``max_ranks`` show the first and last
    ``max_ranks // 2`` ranks."""
    if width < 1 or max_ranks < 1:
        raise ValueError(f"width and max_ranks must be positive, got {width}, {max_ranks}")
    colors = {n: _color(i) for i, n in enumerate(plan.order)}
    pad = (225, 225, 225)
    s = plan.chunk_numel
    shown = _shown_ranks(plan.world_size, max_ranks)
    height = max(1, min(16, 512 // len(shown)))  # pixel rows per rank
    sep = b"\x00" + bytes(255 for _ in range(3 * width))  # white line between ranks
    rows = []
    for rank in shown:
        px = [pad] * width
        for begin, end, name in _segments(plan, rank):
            lo = begin * width // s
            hi = max(-(-end * width // s), lo + 1)
            for k in range(lo, min(hi, width)):
                px[k] = colors[name]
        line = b"\x00" + bytes(v for p in px for v in p)
        rows += [line] * (height - 1 if height > 2 else height)
        if height > 2:
            rows.append(sep)
    header = struct.pack(">IIBBBBB", width, len(rows), 8, 2, 0, 0, 0)
    with open(path, "wb") as fh:
        fh.write(b"\x89PNG\r\n\x1a\n")
        fh.write(_png_chunk(b"IHDR", header))
        fh.write(_png_chunk(b"IDAT", zlib.compress(b"".join(rows), 9)))
        fh.write(_png_chunk(b"IEND", b""))
