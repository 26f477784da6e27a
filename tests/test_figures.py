"""The figures in docs/figures are what scripts/draw_figures.py draws from the code now, and the
row assignments they show are right: every element of the unit held by exactly one rank, and
the planner's boundaries never inside a 128-row block."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("draw_figures", REPO / "scripts" / "draw_figures.py")
figures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(figures)


def test_checked_in_figures_are_what_the_script_draws():
    drawn = figures.draw_all()
    on_disk = {p.name for p in (REPO / "docs" / "figures").glob("*.svg")}
    assert on_disk == set(drawn), f"docs/figures holds {sorted(on_disk)}, the script draws {sorted(drawn)}"
    stale = [n for n, text in drawn.items() if (REPO / "docs" / "figures" / n).read_text() != text]
    assert not stale, f"{stale} differ from what the code gives now: run scripts/draw_figures.py"


def _covers_once(runs, total):
    spans = sorted((b, e) for rank_runs in runs for b, e, _ in rank_runs)
    at = 0
    for b, e in spans:
        assert b == at and e > b, (b, e, at)
        at = e
    assert at == total


@pytest.mark.parametrize("model,world_size", [("llama-3.1-8b", 6), *(("mixtral-8x7b", w) for w in (8, 16, 32, 64))])
def test_the_drawn_row_assignments_hold_every_element_once(model, world_size):
    _, named = figures._layer(model)
    total = sum(math.prod(s) for _, s in named)
    plan = figures.plan_segmented(named, world_size, figures.POLICY, uneven=True)
    ragged = figures.ragged_runs(named, plan, world_size)
    shard0, pad = figures.shard0_runs(named, world_size)
    _covers_once(ragged, total)
    _covers_once(shard0, total)
    assert [sum(e - b for b, e, _ in r) for r in ragged] == [plan.rank_numel(r) for r in range(world_size)] \
        or plan.padding_numel > 0
    assert figures.cut_blocks(named, ragged) == 0
    # FSDP2's Shard(0): torch.chunk's split, each rank padded to the first chunk.
    for rank in range(world_size):
        assert sum(e - b for b, e, _ in shard0[rank]) + pad[rank] == sum(
            -(-s[0] // world_size) * math.prod(s[1:]) for _, s in named)
