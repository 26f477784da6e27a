"""Draw the figures of the docs (``docs/figures/*.svg``) from the project's own code.

Every number in a figure is computed here by the code it illustrates: the rows each rank holds
come from the ``RaggedShard`` placements the planner gives a unit (``plan_segmented``, what
``fully_shard`` calls) and, for FSDP2, from ``torch.chunk`` on dim 0 (what FSDP2's ``Shard(0)``
cuts); the cuts at several world sizes are the planner's choice on shapes of
``planner/models.json``; the memory per rank by state is ``plan_state_sharding``'s model. The SVG
is written as text (no plotting library), deterministically, so
``tests/test_figures.py`` can check that the checked-in files are what this script draws now.

    .venv/bin/python scripts/draw_figures.py            # rewrite docs/figures/*.svg
    .venv/bin/python scripts/draw_figures.py --check    # exit 1 if a checked-in figure is stale
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from xml.sax.saxutils import escape

import torch

from ragged_placement.planner import Granularity, StateSharding, plan_segmented, plan_state_sharding
from ragged_placement.planner.models import fsdp_units, load_configs

FIGURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "figures")

# Rank colors (Tableau 10) and a lighter set for parameters.
RANK_COLORS = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1",
               "#ff9da7", "#9c755f", "#bab0ac")
PARAM_COLORS = ("#c6dbef", "#fdd0a2", "#c7e9c0", "#dadaeb", "#fcbba1", "#d9d9d9", "#fee391",
                "#a1d99b", "#9ecae1", "#fdae6b")
STATE_COLORS = {"params": "#4e79a7", "grads": "#f28e2b", "optim": "#59a14f", "buffers": "#bab0ac"}
FONT = "font-family='DejaVu Sans, Arial, sans-serif'"

# The unit of figures 1 and 2 and the planner's policy for it: 128 x 128 blocks (FP8's, and the
# README's example policy for experts) on every matrix, 1-D norms cut anywhere.
POLICY = {"*norm*": Granularity.element(), "*": Granularity.block(128, 128)}
BLOCK_ROWS = 128


class Svg:
    """An SVG document as a list of elements; coordinates rounded to 0.1 so output is stable."""

    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.items: list[str] = []

    def rect(self, x: float, y: float, w: float, h: float, fill: str, stroke: str | None = None,
             title: str | None = None) -> None:
        s = f" stroke='{stroke}' stroke-width='0.5'" if stroke else ""
        body = f"<title>{escape(title)}</title>" if title else ""
        self.items.append(f"<rect x='{x:.1f}' y='{y:.1f}' width='{max(w, 0.0):.1f}' "
                          f"height='{h:.1f}' fill='{fill}'{s}>{body}</rect>")

    def line(self, x1: float, y1: float, x2: float, y2: float, stroke: str = "#000",
             width: float = 1.0, dash: bool = False) -> None:
        d = " stroke-dasharray='3,3'" if dash else ""
        self.items.append(f"<line x1='{x1:.1f}' y1='{y1:.1f}' x2='{x2:.1f}' y2='{y2:.1f}' "
                          f"stroke='{stroke}' stroke-width='{width}'{d}/>")

    def text(self, x: float, y: float, s: str, size: int = 12, anchor: str = "start",
             weight: str = "normal", fill: str = "#222") -> None:
        self.items.append(f"<text x='{x:.1f}' y='{y:.1f}' font-size='{size}' {FONT} "
                          f"text-anchor='{anchor}' font-weight='{weight}' fill='{fill}'>"
                          f"{escape(s)}</text>")

    def render(self) -> str:
        head = (f"<svg xmlns='http://www.w3.org/2000/svg' width='{self.width}' "
                f"height='{self.height}' viewBox='0 0 {self.width} {self.height}'>")
        bg = f"<rect width='{self.width}' height='{self.height}' fill='#fff'/>"
        return "\n".join([head, bg, *self.items, "</svg>"]) + "\n"


def _short(name: str) -> str:
    """``layers.0.self_attn.q_proj.weight`` -> ``q_proj``."""
    parts = [p for p in name.split(".") if p not in ("weight", "bias") and not p.isdigit()]
    return parts[-1] if parts else name


def _layer(model: str, index: int = 1) -> tuple[str, list[tuple[str, tuple[int, ...]]]]:
    units = fsdp_units(model, load_configs()[model])
    return units[index]


def _offsets(named_shapes: Sequence[tuple[str, tuple[int, ...]]]) -> dict[str, int]:
    """Each parameter's start in the unit's parameters laid end to end in module order."""
    out, at = {}, 0
    for name, shape in named_shapes:
        out[name] = at
        at += math.prod(shape)
    return out


def ragged_runs(named_shapes, plan, world_size: int) -> list[list[tuple[int, int, str]]]:
    """Per rank, the ``(begin, end, name)`` element runs it holds under the plan's RaggedShard
    placements, in the module-order coordinates of :func:`_offsets`."""
    offsets = _offsets(named_shapes)
    out: list[list[tuple[int, int, str]]] = [[] for _ in range(world_size)]
    for name, shape in named_shapes:
        placement = plan.placements[name]
        row = math.prod(placement.row_shape(shape))
        for rank, (s, e) in enumerate(placement.row_ranges(shape)):
            if e > s:
                out[rank].append((offsets[name] + s * row, offsets[name] + e * row, name))
    return out


def shard0_runs(named_shapes, world_size: int) -> tuple[list[list[tuple[int, int, str]]], list[int]]:
    """Per rank, the element runs FSDP2's ``Shard(0)`` gives it (``torch.chunk`` on dim 0) and
    the padding it allocates (every rank's chunk padded to the first chunk's rows)."""
    offsets = _offsets(named_shapes)
    out: list[list[tuple[int, int, str]]] = [[] for _ in range(world_size)]
    pad = [0] * world_size
    for name, shape in named_shapes:
        row = math.prod(shape[1:])
        sizes = [c.shape[0] for c in torch.chunk(torch.empty(shape[0], 0), world_size)]
        sizes += [0] * (world_size - len(sizes))
        start = 0
        for rank, n in enumerate(sizes):
            if n:
                out[rank].append((offsets[name] + start * row, offsets[name] + (start + n) * row, name))
            pad[rank] += (sizes[0] - n) * row
            start += n
    return out, pad


def cut_blocks(named_shapes, runs: list[list[tuple[int, int, str]]]) -> int:
    """How many 128-row blocks of the matrices (of each expert's matrix, for a stacked
    ``[E, out, in]`` tensor) have a rank boundary inside them."""
    offsets = _offsets(named_shapes)
    shapes = dict(named_shapes)
    cut = set()
    for rank_runs in runs:
        for begin, end, name in rank_runs:
            shape = shapes[name]
            if len(shape) < 2:
                continue
            row, rows = shape[-1], math.prod(shape[:-1])  # a stacked [E, out, in]: E*out rows
            for at in (begin, end):
                r = (at - offsets[name]) // row
                if 0 < r < rows and (r % shape[-2]) % BLOCK_ROWS:
                    cut.add((name, r // BLOCK_ROWS))
    return len(cut)


def _lanes(svg: Svg, y0: float, x0: float, width: float, total: int, runs, lane_h: float,
           right: Sequence[str]) -> None:
    for rank, rank_runs in enumerate(runs):
        y = y0 + rank * lane_h
        svg.rect(x0, y, width, lane_h - 2, "#f4f4f4")
        for begin, end, name in rank_runs:
            svg.rect(x0 + width * begin / total, y, width * (end - begin) / total, lane_h - 2,
                     RANK_COLORS[rank % len(RANK_COLORS)],
                     title=f"rank {rank}: {name} [{begin:,}, {end:,})")
        svg.text(x0 - 6, y + lane_h / 2 + 2, f"rank {rank}", 11, "end")
        svg.text(x0 + width + 8, y + lane_h / 2 + 2, right[rank], 11)


def _param_ticks(svg: Svg, named_shapes, x0: float, width: float, total: int, y_top: float,
                 y_bottom: float, label_y: float) -> None:
    offsets = _offsets(named_shapes)
    last_label = -1e9
    for name, shape in named_shapes:
        x = x0 + width * offsets[name] / total
        svg.line(x, y_top, x, y_bottom, "#999", 0.6, dash=True)
        if len(shape) >= 2 and x - last_label > 38:
            svg.text(x + 2, label_y, _short(name), 10, fill="#555")
            last_label = x
    svg.line(x0 + width, y_top, x0 + width, y_bottom, "#999", 0.6, dash=True)


def figure_rows_per_rank(model: str = "llama-3.1-8b", world_size: int = 6) -> str:
    """Figure 1: who holds which rows of one unit under FSDP2's Shard(0) and under RaggedShard."""
    name, named = _layer(model)
    total = sum(math.prod(s) for _, s in named)
    plan = plan_segmented(named, world_size, POLICY, uneven=True)
    ragged = ragged_runs(named, plan, world_size)
    shard0, pad0 = shard0_runs(named, world_size)
    held = lambda runs: [sum(e - b for b, e, _ in r) for r in runs]  # noqa: E731
    h_ragged, h_shard0 = held(ragged), held(shard0)
    lane_h, x0, width = 18, 70, 640
    panel_h = world_size * lane_h
    svg = Svg(x0 + width + 190, 0)
    svg.text(10, 22, f"One FSDP unit ({model} {name}, {len(named)} parameters, {total / 1e6:.1f} M "
                     f"elements) over {world_size} ranks: who holds which rows", 14, weight="bold")
    svg.text(10, 40, "x: the unit's parameters end to end in module order, to scale; a bar is the "
                     "rows a rank holds", 11, fill="#555")
    y1 = 78
    svg.text(10, y1 - 14, f"FSDP2 Shard(0): every parameter cut on dim 0 over all ranks, "
                          f"{sum(len(r) for r in shard0)} pieces, {cut_blocks(named, shard0)} "
                          f"128-row blocks cut, {sum(pad0) / 1e6:.3f} M elements of padding", 12)
    _param_ticks(svg, named, x0, width, total, y1 - 4, y1 + panel_h, y1 - 2)
    _lanes(svg, y1 + 4, x0, width, total, shard0, lane_h,
           [f"{h / 1e6:.2f} M + {p / 1e6:.3f} M pad" for h, p in zip(h_shard0, pad0)])
    y2 = y1 + panel_h + 52
    kind = "uneven chunks" if any(s.uneven for s in plan.segments) else "equal chunks"
    mean = total / world_size
    svg.text(10, y2 - 14, f"RaggedShard (the planner's plan, {kind}): one contiguous run per rank, "
                          f"{cut_blocks(named, ragged)} blocks cut, {plan.padding_numel / 1e6:.3f} M "
                          f"padding, largest shard {max(h_ragged) / mean:.3f} x the mean", 12)
    _param_ticks(svg, named, x0, width, total, y2 - 4, y2 + panel_h, y2 - 2)
    _lanes(svg, y2 + 4, x0, width, total, ragged, lane_h, [f"{h / 1e6:.2f} M" for h in h_ragged])
    svg.height = int(y2 + panel_h + 44)
    svg.text(10, y2 + panel_h + 30, "Under RaggedShard a rank's shard is one slice of the "
             "all-gather's output, which every parameter views: no copy-in/out, no padding.", 11,
             fill="#555")
    return svg.render()


def figure_planner_cuts(model: str = "mixtral-8x7b", sizes: Sequence[int] = (8, 16, 32, 64)) -> str:
    """Figure 2: where the planner cuts one unit of a real model at several world sizes."""
    name, named = _layer(model)
    total = sum(math.prod(s) for _, s in named)
    offsets = _offsets(named)
    lane_h, x0, width = 34, 60, 700
    svg = Svg(x0 + width + 250, 90 + lane_h * len(sizes) + 40)
    svg.text(10, 22, f"The planner's cuts of one unit ({model} {name}, {total / 1e9:.2f} B "
                     f"elements) at several world sizes", 14, weight="bold")
    svg.text(10, 40, "x: parameters end to end in module order, to scale; a black tick: a rank "
                     "boundary (always between 128-row blocks)", 11, fill="#555")
    y0 = 70
    last_label = -1e9
    for i, (pname, shape) in enumerate(named):
        x = x0 + width * offsets[pname] / total
        if math.prod(shape) / total > 0.02 and x - last_label > 60:
            svg.text(x + 2, y0 - 6, _short(pname), 10, fill="#555")
            last_label = x
    for k, world_size in enumerate(sizes):
        plan = plan_segmented(named, world_size, POLICY, uneven=True)
        y = y0 + k * lane_h
        for i, (pname, shape) in enumerate(named):
            svg.rect(x0 + width * offsets[pname] / total, y, width * math.prod(shape) / total,
                     lane_h - 10, PARAM_COLORS[i % len(PARAM_COLORS)], title=pname)
        runs = ragged_runs(named, plan, world_size)
        cuts = sorted({at for r in runs for b, e, _ in r for at in (b, e)} - {0, total})
        for at in cuts:
            x = x0 + width * at / total
            svg.line(x, y - 2, x, y + lane_h - 8, "#000", 0.8)
        held = [sum(e - b for b, e, _ in r) for r in runs]
        segments = plan.segments
        kind = "uneven" if any(s.uneven for s in segments) else "equal"
        svg.text(x0 - 6, y + lane_h / 2, f"W={world_size}", 12, "end", "bold")
        svg.text(x0 + width + 8, y + lane_h / 2 - 4,
                 f"{len(segments)} segment{'s' if len(segments) > 1 else ''}, {kind} chunks", 11)
        svg.text(x0 + width + 8, y + lane_h / 2 + 9,
                 f"padding {100 * plan.padding_fraction:.2f} %, largest {max(held) * world_size / total:.3f} x mean",
                 11, fill="#555")
    svg.text(10, y0 + lane_h * len(sizes) + 20, "Equal chunks where they pad at most 1 %; "
             "otherwise uneven chunks with no padding, each within one block of the mean.", 11,
             fill="#555")
    return svg.render()


def figure_state_memory(model: str = "llama-3.1-70b", mesh: dict[str, int] | None = None) -> str:
    """Figure 3: per-rank memory by state under FSDP2 full shard, HSDP and AMSP."""
    mesh = mesh or {"inter": 4, "intra": 8}
    units = fsdp_units(model, load_configs()[model])
    result = plan_state_sharding(units, mesh, memory_budget=1e15, optimizer="adamw",
                                 param_dtype=torch.bfloat16)
    rows = [
        ("FSDP2 full shard (zero3)", StateSharding.zero3(mesh)),
        ("FSDP2 HSDP (shard intra)", StateSharding.hsdp(mesh, "intra")),
        ("AMSP: params intra, grads + optim all", StateSharding(
            params=("intra",), grads=("inter", "intra"), optim=("inter", "intra"))),
    ]
    cands = [(label, result.find(s)) for label, s in rows]
    top = max(c.memory_total for _, c in cands)
    scale_gb = math.ceil(top / 1e9 / 10) * 10
    x0, width, bar_h = 250, 520, 30
    svg = Svg(x0 + width + 120, 110 + len(cands) * (bar_h + 16) + 60)
    world = math.prod(mesh.values())
    svg.text(10, 22, f"Memory per rank by state: {model}, AdamW, bf16 compute, fp32 storage, "
                     f"{mesh['inter']} nodes x {mesh['intra']} GPUs ({world} ranks)", 14, weight="bold")
    svg.text(10, 40, "as plan_state_sharding's memory model counts it (activations not included)", 11,
             fill="#555")
    xl = 10
    for state, color in STATE_COLORS.items():
        svg.rect(xl, 52, 12, 12, color)
        svg.text(xl + 16, 62, {"params": "parameters", "grads": "gradients", "optim": "optimizer state",
                               "buffers": "unsharded buffers"}[state], 11)
        xl += 140
    y0 = 84
    for k, (label, c) in enumerate(cands):
        y = y0 + k * (bar_h + 16)
        svg.text(x0 - 8, y + bar_h / 2 + 4, label, 12, "end")
        x = x0
        for state in STATE_COLORS:
            w = width * c.memory_per_rank[state] / 1e9 / scale_gb
            svg.rect(x, y, w, bar_h, STATE_COLORS[state],
                     title=f"{state}: {c.memory_per_rank[state] / 1e9:.2f} GB")
            if w > 34:
                svg.text(x + w / 2, y + bar_h / 2 + 4, f"{c.memory_per_rank[state] / 1e9:.1f}", 10,
                         "middle", fill="#fff")
            x += w
        svg.text(x + 6, y + bar_h / 2 + 4, f"{c.memory_total / 1e9:.1f} GB", 12, weight="bold")
    ya = y0 + len(cands) * (bar_h + 16)
    svg.line(x0, ya, x0 + width, ya, "#555")
    for g in range(0, scale_gb + 1, 10):
        x = x0 + width * g / scale_gb
        svg.line(x, ya, x, ya + 4, "#555")
        svg.text(x, ya + 16, f"{g}", 10, "middle")
    svg.text(x0 + width / 2, ya + 32, "GB per rank", 11, "middle")
    return svg.render()


def draw_all() -> dict[str, str]:
    """``{file name: SVG text}`` of every figure."""
    return {
        "rows_per_rank.svg": figure_rows_per_rank(),
        "planner_cuts.svg": figure_planner_cuts(),
        "state_memory.svg": figure_state_memory(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a checked-in figure differs")
    ap.add_argument("--out", default=FIGURES, help="the folder to write (default docs/figures)")
    args = ap.parse_args(argv)
    stale = []
    os.makedirs(args.out, exist_ok=True)
    for fname, text in draw_all().items():
        path = os.path.join(args.out, fname)
        old = open(path).read() if os.path.exists(path) else None
        if args.check:
            if old != text:
                stale.append(fname)
        elif old != text:
            with open(path, "w") as fh:
                fh.write(text)
            print(f"wrote {path}")
    if stale:
        print(f"stale: {', '.join(stale)}; run scripts/draw_figures.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
