"""Training on uneven per-rank chunks (issue 16): 4 spawned gloo ranks, fp32, against one process
on the whole batch and against torch FSDP2 on the same model and data, in one spawn; also with
``reshard_after_forward=2`` (backward gathers each pair's coarsened uneven chunks)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

from dist_utils import run_gloo
from ragged_placement.fsdp import fully_shard
from ragged_placement.planner import Granularity, UnevenPlan

pytestmark = pytest.mark.multiprocess

STEPS, BATCH, WORLD = 4, 8, 4
# 8-row bands: equal chunks would pad 36% (the Linear) and 42% (the expert block) at 4 ranks,
# so both units get uneven chunks; the stacked experts have 12 rows (1.5 bands) per expert
POLICY = {"*weight": Granularity.rows(8), "*experts": Granularity.block(8, 8)}


class ExpertBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Parameter(torch.randn(3, 12, 44) * 0.2)
        self.out = nn.Linear(12, 20)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(torch.einsum("bi,eoi->bo", x, self.experts)))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 44), nn.Tanh(), ExpertBlock())


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 20, generator=g), torch.randn(BATCH, 20, generator=g)


def _train(m: nn.Module, rank: int, world: int) -> list[float]:
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    per = BATCH // world
    losses = []
    for s in range(STEPS):
        x, y = _data(s)
        loss = nn.functional.mse_loss(m(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if world > 1:
            torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _full(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in m.state_dict().items()}


def _ours(reshard_after_forward: bool | int = True) -> nn.Sequential:
    ours = _model()
    fully_shard(ours[0], granularity=POLICY, reshard_after_forward=reshard_after_forward)
    fully_shard(ours[2], granularity=POLICY, reshard_after_forward=reshard_after_forward)
    fully_shard(ours, granularity=POLICY)
    return ours


def _pairs(rank: int, world: int) -> tuple[list[float], dict[str, torch.Tensor], list, int]:
    """``reshard_after_forward=2``: losses, parameters, each block's post-forward shard size
    between forward and backward (elements) and the bytes gathered over the pairs."""
    ours = _ours(2)
    units = [ours[0].fsdp_unit, ours[2].fsdp_unit]
    x, _ = _data(0)
    out = ours(x[rank * 2:(rank + 1) * 2])
    held = [u.buffers[0].post_forward_shard.numel() for u in units]
    out.sum().backward()
    ours.zero_grad()
    for u in units:
        u.stats.reset()
    losses = _train(ours, rank, world)
    return losses, _full(ours), held, sum(u.stats.post_forward_all_gather_bytes for u in units)


def _ranks(rank: int, world: int):
    ours = _ours()
    units = [u for _, u in ours.fsdp_units() if u.buffers]
    plans = [b.plan for u in units for b in u.buffers]
    layout = [(isinstance(p, UnevenPlan), [p.rank_numel(r) for r in range(world)],
               p.padding_numel, p.numel) for p in plans]
    for u in units:
        u.stats.reset()
    losses = _train(ours, rank, world)
    gathered = sum(u.stats.all_gather_bytes for u in units)
    reduced = sum(u.stats.reduce_scatter_bytes for u in units)
    theirs = _model()
    fsdp2_fully_shard(theirs[0])
    fsdp2_fully_shard(theirs[2])
    fsdp2_fully_shard(theirs)
    fsdp2_losses = _train(theirs, rank, world)
    return losses, fsdp2_losses, _full(ours), layout, gathered, reduced, _pairs(rank, world)


def test_uneven_chunks_train_like_one_process_and_fsdp2():
    ref_model = _model()
    ref_losses = _train(ref_model, 0, 1)
    ref_state = _full(ref_model)
    results = run_gloo(_ranks, WORLD)
    losses, fsdp2_losses, state, layout, gathered, reduced, pairs = results[1]
    # both units are uneven, really (chunks of different sizes), and pad nothing
    assert len(layout) == 2
    for uneven, sizes, padding, numel in layout:
        assert uneven and len(set(sizes)) > 1 and padding == 0 and sum(sizes) == numel
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    assert fsdp2_losses == pytest.approx(ref_losses, abs=1e-5)
    for k, v in ref_state.items():
        torch.testing.assert_close(state[k], v, atol=1e-5, rtol=1e-5)
    # the wire carries exactly the parameters: forward + backward gathers, one reduce-scatter
    numel = sum(n for *_, n in layout)
    assert gathered == 2 * STEPS * 4 * numel
    assert reduced == STEPS * 4 * numel
    # FSDP2 pads dim 0 of every parameter to a multiple of the world size
    fsdp2 = sum(-(-p.shape[0] // WORLD) * WORLD * p[0].numel() for p in _model().parameters())
    assert numel <= fsdp2
    # reshard_after_forward=2: the same training; between forward and backward each rank holds
    # its pair place (ranks 2j, 2j+1 of rank_starts[::2]: the largest place's size, so 1/2 of
    # the unit up to the unevenness), and backward gathers each block's buffer over the pair
    for r, (pair_losses, pair_state, held, pair_bytes) in enumerate(p[-1] for p in results):
        assert pair_losses == pytest.approx(ref_losses, abs=1e-5)
        for k, v in ref_state.items():
            torch.testing.assert_close(pair_state[k], v, atol=1e-5, rtol=1e-5)
        for (_, sizes, _, unit_numel), kept in zip(layout, held):
            assert kept == max(sizes[0] + sizes[1], sizes[2] + sizes[3])
            assert abs(kept - unit_numel / 2) < max(sizes)
        assert pair_bytes == STEPS * 4 * numel
