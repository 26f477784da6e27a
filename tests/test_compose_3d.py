"""3-D meshes on 8 gloo ranks, against one process: (pp=2, dp=2, tp=2) with ScheduleGPipe, and
HSDP x TP on (replicate=2, shard=2, tp=2). One spawn runs both (8 processes on a small machine)."""

from __future__ import annotations

import torch
from dist_utils import run_gloo
from test_compose import BATCH, CFG, SEQ, _batches, _init_state, _loss, _mean_over, _model, _train
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor import Replicate, Shard

from ragged_placement.fsdp import fully_shard
from ragged_placement.models.llama import parallelize_llama, pipeline_stage
from ragged_placement.placement import RaggedShard


def _pp_dp_tp(rank: int, state) -> list[float]:
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    s, d = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    part = pipeline_stage(_model(state), s, 2)
    parallelize_llama(part, mesh["tp"])
    for block in part.layers.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(part, mesh=mesh["dp"])
    n_micro, half = 2, BATCH // 2
    mb = half // n_micro
    x_example = (
        torch.zeros(mb, SEQ, dtype=torch.long)
        if s == 0
        else torch.zeros(mb, SEQ, CFG.dim, requires_grad=True)
    )
    y_example = torch.zeros(mb, SEQ, CFG.dim if s == 0 else CFG.vocab_size, requires_grad=True)
    stage = PipelineStage(
        part,
        s,
        2,
        torch.device("cpu"),
        input_args=(x_example,),
        output_args=(y_example,),
        group=mesh["pp"].get_group(),
    )
    schedule = ScheduleGPipe(stage, n_micro, loss_fn=_loss)
    opt = torch.optim.AdamW(part.parameters(), lr=1e-2)
    losses = []
    for b in _batches():
        b = b[d * half : (d + 1) * half]
        mb_losses: list[torch.Tensor] = []
        if s == 0:
            schedule.step(b[:, :-1])
        else:
            schedule.step(target=b[:, 1:], losses=mb_losses)
        opt.step()
        opt.zero_grad()
        losses.append(sum(x.item() for x in mb_losses) / n_micro if s == 1 else 0.0)
    return _mean_over(losses, mesh["dp"].get_group()) if s == 1 else []


def _hsdp_tp(rank: int, state) -> dict:
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    model = _model(state)
    parallelize_llama(model, mesh["tp"])
    dp = mesh["replicate", "shard"]
    for block in model.layers.values():
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    r = dp.get_local_rank(0) * 2 + dp.get_local_rank(1)
    wq = model.layers["0"].attention.wq.weight
    return {
        "placements": tuple(wq.placements),
        "mesh": wq.device_mesh.mesh_dim_names,
        # Both tp ranks of a dp rank see its sample: the world mean is the mean over dp.
        "losses": _mean_over(_train(model, [b[r : r + 1] for b in _batches()], clip=True)),
    }


def _worker(rank: int, world_size: int, state) -> dict:
    torch.set_num_threads(1)
    return {"pp_dp_tp": _pp_dp_tp(rank, state), "hsdp_tp": _hsdp_tp(rank, state)}


def test_pp_dp_tp_and_hsdp_tp_equal_one_process():
    state = _init_state()
    ref_clip = _train(_model(state), _batches(), clip=True)
    ref_noclip = _train(_model(state), _batches(), clip=False)
    ranks = run_gloo(_worker, 8, state)
    last = [r["pp_dp_tp"] for r in ranks if r["pp_dp_tp"]]
    assert len(last) == 4  # the (dp, tp) ranks of the last stage
    for losses in last:
        assert max(abs(a - b) for a, b in zip(losses, ref_noclip)) < 1e-5, (losses, ref_noclip)
    for r in ranks:
        h = r["hsdp_tp"]
        assert h["mesh"] == ("replicate", "shard", "tp")
        assert h["placements"][0] == Replicate() and h["placements"][2] == Shard(0)
        assert isinstance(h["placements"][1], RaggedShard) and h["placements"][1].split_factor == 2
        assert max(abs(a - b) for a, b in zip(h["losses"], ref_clip)) < 1e-5, (
            h["losses"],
            ref_clip,
        )
