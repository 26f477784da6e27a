"""Spawned gloo ranks: AdamW on the DTensor parameters, clip_grad_norm_, and a DCP checkpoint
saved on 4 ranks and resumed on 2 (by this runtime and by torch FSDP2)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor.debug import CommDebugMode
from common_fsdp import train_steps
from dist_utils import run_gloo
from ragged_placement.planner import Granularity
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

from ragged_placement.fsdp import fully_shard
from ragged_placement.models import GPT, GPTConfig, StdlibCorpus

pytestmark = pytest.mark.multiprocess

BATCH = 8
SEQ = 16
STEPS = 20
SAVE_AT = 10
LR = 1e-2
CFG = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=SEQ)
BLOCKS = {"*.weight": Granularity.rows(8)}


def _init_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return GPT(CFG).state_dict()


def _clip(m: torch.nn.Module) -> None:
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)


def _step(m, opt, corpus, step: int, rank: int, ws: int) -> float:
    batch = corpus.batch(step, BATCH, SEQ)
    return train_steps(m, opt, [batch], rank, ws, after_backward=_clip)[0]


def _sharded(runtime: str, mesh) -> tuple[GPT, torch.optim.Optimizer]:
    m = GPT(CFG)
    m.load_state_dict(_init_state())
    if runtime == "ours":
        for block in m.layers:
            fully_shard(block, mesh=mesh, granularity=BLOCKS)
        fully_shard(m, mesh=mesh, granularity=BLOCKS)
    else:
        for block in m.layers:
            fsdp2_fully_shard(block, mesh=mesh)
        fsdp2_fully_shard(m, mesh=mesh)
    return m, torch.optim.AdamW(m.parameters(), lr=LR, foreach=True)


def _train_and_save(rank: int, ws: int, ckpt: str):
    corpus = StdlibCorpus(max_bytes=1 << 18)
    m, opt = _sharded("ours", None)  # mesh=None: a 1-D cpu mesh over the default gloo group
    losses, counts = [], []
    segments = [len(b.plan.segments) for _, u in m.fsdp_units() for b in u.buffers]
    # an uneven segment (the root here: equal chunks would pad > 1%) is gathered on gloo by one
    # broadcast per rank holding part of it (NCCL: one grouped all_gather), reduced by one
    # list reduce_scatter; its unit gathers once per step
    uneven = [s for _, u in m.fsdp_units() for b in u.buffers for s in b.plan.segments if s.uneven]
    broadcasts = sum(sum(b > a for a, b in zip(s.rank_starts, s.rank_starts[1:])) for s in uneven)
    for s in range(STEPS):
        # the c10d ops gloo runs: a unit of several segments issues one coalesced op
        with CommDebugMode() as cdm:
            losses.append(_step(m, opt, corpus, s, rank, ws))
        ops = {str(k).rsplit(".", 1)[-1]: v for k, v in cdm.get_comm_counts().items()}
        uneven_gathers = ops.get("broadcast_", 0) / broadcasts if broadcasts else 0
        counts.append((ops.get("_allgather_base_", 0) + ops.get("allgather_into_tensor_coalesced_", 0)
                       + uneven_gathers,
                       # gloo's reduce-scatters (sums) run as all-to-alls (_compat)
                       ops.get("alltoall_base_", 0) + ops.get("reduce_scatter_", 0)))
        if s + 1 == SAVE_AT:
            dcp.save(
                {"model": m.state_dict(), "optim": get_optimizer_state_dict(m, opt)},
                checkpoint_id=ckpt,
            )
    counts.append(("segments", max(segments), len(uneven)))
    return losses, counts


def _resume(rank: int, ws: int, ckpt: str):
    mesh = init_device_mesh("cpu", (ws,))
    corpus = StdlibCorpus(max_bytes=1 << 18)
    out = {}
    for runtime in ("ours", "fsdp2"):
        m, opt = _sharded(runtime, mesh)
        state = {"model": m.state_dict(), "optim": get_optimizer_state_dict(m, opt)}
        dcp.load(state, checkpoint_id=ckpt)
        m.load_state_dict(state["model"])
        set_optimizer_state_dict(m, opt, state["optim"])
        out[runtime] = [_step(m, opt, corpus, s, rank, ws) for s in range(SAVE_AT, STEPS)]
    return out


def _reference() -> list[float]:
    m = GPT(CFG)
    m.load_state_dict(_init_state())
    opt = torch.optim.AdamW(m.parameters(), lr=LR)
    corpus = StdlibCorpus(max_bytes=1 << 18)
    return train_steps(m, opt, (corpus.batch(s, BATCH, SEQ) for s in range(STEPS)), after_backward=_clip)


def test_dtensor_adamw_training_and_dcp_resume_on_fewer_ranks(tmp_path):
    ref = _reference()
    ckpt = str(tmp_path / "ckpt")
    four = run_gloo(_train_and_save, 4, ckpt)
    losses, counts = four[0]
    assert losses == pytest.approx(ref, abs=1e-5)
    # per step: root 1 + 2 blocks x (forward + backward) all-gathers; one reduce-scatter per unit,
    # one collective each even when the planner split a unit into segments
    assert counts[:-1] == [(5, 3)] * STEPS
    assert counts[-1][1] > 1, "the block granularity here should give segmented units"
    assert counts[-1][2] >= 1, "the root unit here should have uneven chunks"
    two = run_gloo(_resume, 2, ckpt)
    assert two[0]["ours"] == pytest.approx(ref[SAVE_AT:], abs=1e-5)
    assert two[0]["fsdp2"] == pytest.approx(ref[SAVE_AT:], abs=1e-5)
