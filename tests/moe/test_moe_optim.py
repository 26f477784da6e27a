"""Muon and Shampoo (``ragged_placement.optim``) on the MoE model's 3-D expert stacks under
expert parallelism x FSDP, against one process with the same optimizer.

The expert stacks (``[E, ffn, dim]``, ``[E, dim, ffn]``) are DTensors sharded by whole experts
over ``ep`` (``Shard(0)``) and cut by a RaggedShard on each ep rank's block over the
data-parallel dim beside it; each matrix of a stack is its own matrix. The optimizers take each
ep rank's block as its own problem over the data-parallel group (``optim._sharding.
stack_layout``): Newton-Schulz runs once per expert matrix in the world, Shampoo updates each
expert's row slabs once, and an expert held whole on a rank sends nothing. The rest of the
model is stepped by ``torch.optim.AdamW`` beside them (the same in the reference).

Precision: Muon runs Newton-Schulz in fp32 here (``ns_dtype=torch.float32``). In bf16 (Muon's
default) the distributed gradients, which differ from one process's by fp32 rounding (~1e-8, the
tokens of an expert summed in another order), flip bf16 roundings of the Newton-Schulz input,
and the parameters then differ by up to 1.5e-3 after 5 steps (measured on EP 2 x FSDP 2); in
fp32 by 2.3e-7 (experts) and 4e-6 (the AdamW-stepped rest, lr 0.02).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from common.moe import AMSP, BATCH, WORLD, batches, full_state, loss_of, make_model
from common.state_sharding import OptimizerWorkCounter  # Newton-Schulz matrices, Shampoo slabs
from dist_utils import run_gloo
from ragged_placement.optim import Muon, Shampoo
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

from ragged_placement.parallelize import parallelize_moe

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

STEPS = 5
ATOL = 1e-5
B = 8  # Shampoo's preconditioner block: each expert matrix has 16 or 32 rows, 2 or 4 slabs
# 2 MoE layers x 3 stacks of 8 experts: Newton-Schulz matrices per step in the whole world
EXPERT_MATRICES = 2 * 3 * 8
EXPERT_SLABS = 2 * 8 * (16 // B + 16 // B + 32 // B)  # w1, w3: 16 rows; w2: 32 rows
RUNS = ["ep2", "ep4", "amsp"]


def _is_expert(name: str) -> bool:
    return ".experts." in name


def _optimizers(model: torch.nn.Module, name: str) -> tuple[torch.optim.Optimizer, ...]:
    """``name`` (Muon or Shampoo) on the expert stacks, AdamW on everything else."""
    experts = [p for n, p in model.named_parameters() if _is_expert(n)]
    rest = [p for n, p in model.named_parameters() if not _is_expert(n)]
    if name == "muon":
        opt = Muon(experts, lr=0.02, weight_decay=0.1, adjust_lr="match_rms_adamw",
                   ns_dtype=torch.float32)
    else:
        opt = Shampoo(experts, lr=1e-2, max_preconditioner_dim=B, precondition_frequency=2,
                      epsilon=1e-6, weight_decay=0.05)
    return opt, torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.1, eps=1e-6, foreach=False)


def _train(model: torch.nn.Module, name: str, rank: int, ws: int, count: OptimizerWorkCounter) -> tuple:
    """``STEPS`` steps on this rank's rows: the global losses, the full state and, per step,
    the work of the experts' optimizer (matrices or slabs done here, its collectives by op,
    Muon's bytes and matrices moved by redistribution)."""
    opt, adamw = _optimizers(model, name)
    per = BATCH // ws
    losses, work = [], []
    for x, y in batches(STEPS):
        rows = slice(rank * per, (rank + 1) * per)
        loss = loss_of(model, x[rows], y[rows])
        loss.backward()
        before = count.ns + count.slabs
        with CommDebugMode() as comm:
            opt.step()
        info = opt.last_step_info if name == "muon" else None
        work.append((
            count.ns + count.slabs - before,
            {str(op): n for op, n in comm.get_comm_counts().items()},
            (info.bytes_sent, info.nd_matrices) if info else (0, 0),
        ))
        adamw.step()
        opt.zero_grad()
        adamw.zero_grad()
        loss = loss.detach()
        if ws > 1:
            dist.all_reduce(loss)
        losses.append(loss.item() / ws)
    return losses, full_state(model), work, _slab_keys(model, opt)


def _slab_keys(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, list[int]]:
    """Shampoo: the offsets in the whole parameter under which this rank keeps expert slabs'
    state (what DCP saves them under, from their owner)."""
    return {n: sorted(opt.state[p].get("blocks", {})) for n, p in model.named_parameters()
            if _is_expert(n) and isinstance(opt, Shampoo)}


def _reference(name: str) -> tuple:
    with pytest.MonkeyPatch.context() as mp:
        return _train(make_model(), name, 0, 1, OptimizerWorkCounter(mp))


def _runs(rank: int, ws: int, name: str) -> list:
    """Every run of ``RUNS`` with the experts' optimizer ``name``: EP 2 x FSDP 2, EP 4, and
    AMSP on 2x2 ``(inter, intra)`` with EP over ``intra`` (experts ZeRO-2 over ``inter``)."""
    out = []
    with pytest.MonkeyPatch.context() as mp:
        count = OptimizerWorkCounter(mp)
        for run in RUNS:
            model = make_model()
            if run == "amsp":
                mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("inter", "intra"))
                parallelize_moe(model, mesh, ep_dim="intra", state_sharding=AMSP)
            else:
                ep = int(run[2:])
                mesh = init_device_mesh("cpu", (ws // ep, ep), mesh_dim_names=("dp_mod_ep", "ep"))
                parallelize_moe(model, mesh)
            out.append(_train(model, name, rank, ws, count))
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["muon", "shampoo"])
def test_optimizer_on_expert_stacks_matches_one_process_and_sends_nothing(name):
    """Muon / Shampoo on the expert stacks, 5 steps, EP 2 x FSDP 2, EP 4, and AMSP with EP over
    ``intra``: every rank's full parameters and the losses within 1e-5 of one process; per step
    the ranks together run Newton-Schulz once per expert matrix (48: 2 layers x 3 stacks x 8
    experts, as one process) or update each expert row slab once (its state kept by one rank,
    under its offset in the whole stack, as in one process); the experts, each whole on a
    rank, send nothing (no collective in the optimizer's step but, under AMSP, the runtime's
    refresh all-gathers of the 2 expert units it stepped)."""
    ref_losses, ref_state, ref_work, ref_keys = _reference(name)
    expected = EXPERT_MATRICES if name == "muon" else EXPERT_SLABS
    assert [w[0] for w in ref_work] == [expected] * STEPS
    results = run_gloo(_runs, WORLD, name)
    for r, run in enumerate(RUNS):
        ranks = [res[r] for res in results]
        done = [sum(res[2][s][0] for res in ranks) for s in range(STEPS)]
        assert done == [expected] * STEPS, (run, done)
        refresh = {"c10d._allgather_base_": 2} if run == "amsp" else {}
        for k, keys in ref_keys.items():  # each slab's state once in the world, at its offset
            assert sorted(o for res in ranks for o in res[3][k]) == keys, (run, k)
        for rank, (losses, state, work, _) in enumerate(ranks):
            assert all(w[1] == refresh and w[2] == (0, 0) for w in work), (run, rank, work)
            assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < ATOL
            for k, v in ref_state.items():
                torch.testing.assert_close(state[k], v, atol=ATOL, rtol=0,
                                           msg=f"{run} rank {rank} {k}")
