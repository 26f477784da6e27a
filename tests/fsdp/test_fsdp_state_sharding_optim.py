"""Muon and Shampoo (``ragged_placement.optim``) stepping on state-sharded parameters, on 4 gloo
ranks as a 2x2 mesh: AMSP and zero1 (``optim`` spans both dims, so the parameters are
RaggedShard DTensors on the 1-D ``(O,)`` mesh) train to one process with the same optimizer,
and every matrix (Muon) and every row slab (Shampoo) is computed by one rank of the whole world;
with a granularity that keeps them whole in the optimizer shards (``Granularity.matrix()``,
``Granularity.rows(B)``) a step exchanges nothing.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from common.state_sharding import (
    BATCH,
    BOTH,
    MLP,
    MUON_ATOL,
    OPTIMIZERS,
    SHAMPOO_ATOL,
    SHARDINGS,
    STEPS,
    B,
    OptimizerWorkCounter,
    mlp_data,
    mlp_reference,
)
from dist_utils import run_gloo
from ragged_placement.optim import Muon, Shampoo
from ragged_placement.planner import Granularity
from torch.distributed.device_mesh import init_device_mesh

from ragged_placement.fsdp import fully_shard

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


# fully_shard's granularity by optimizer: the default, and one that keeps each Muon matrix and
# each Shampoo row slab whole on one optimizer rank ("*weight": a unit's own parameter names are
# relative to it, "weight" in m.a)
LAYOUTS = {
    "default": {"muon": None, "shampoo": None},
    "whole": {
        "muon": {"*weight": Granularity.matrix()},
        "shampoo": {"*weight": Granularity.rows(B)},
    },
}
RUNS = [
    *((point, optimizer, "default") for point in ("amsp", "zero1") for optimizer in OPTIMIZERS),
    *(("amsp", optimizer, "whole") for optimizer in OPTIMIZERS),
]


def _all_to_alls(opt: Muon | Shampoo) -> int:
    """The all-to-alls of the optimizer's last step."""
    if isinstance(opt, Muon):
        return opt.last_step_info.all_to_all_calls
    return opt.last_step_all_to_all_calls


def _train(rank: int, ws: int, mesh, run: tuple[str, str, str], count: OptimizerWorkCounter):
    """``STEPS`` steps of ``run = (point, optimizer, layout)`` on this rank's share of the
    batch: the full parameters, the parameters' mesh dims and, per step, the work this rank's
    optimizer did (Newton-Schulz matrices, Shampoo slabs, all-to-alls)."""
    point, optimizer, layout = run
    init, x, y = mlp_data()
    m = MLP()
    m.load_state_dict(init)
    for sub in (m.a, m.b, m):
        fully_shard(sub, mesh=mesh, state_sharding=SHARDINGS[point],
                    granularity=LAYOUTS[layout][optimizer])
    opt = OPTIMIZERS[optimizer](m)
    per = BATCH // ws
    rows = slice(rank * per, (rank + 1) * per)
    work, meshes = [], {p.device_mesh.ndim for p in m.parameters()}
    for s in range(STEPS):
        F.mse_loss(m(x[s, rows]), y[s, rows]).backward()
        before = (count.ns, count.slabs)
        opt.step()
        opt.zero_grad()
        work.append((count.ns - before[0], count.slabs - before[1], _all_to_alls(opt)))
    full = {k: v.full_tensor() for k, v in m.named_parameters()}
    return full, work, meshes


def _every_run(rank: int, ws: int):
    with pytest.MonkeyPatch.context() as mp:
        count = OptimizerWorkCounter(mp)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=BOTH)
        return {run: _train(rank, ws, mesh, run, count) for run in RUNS}


@pytest.mark.multiprocess
def test_muon_and_shampoo_on_state_sharded_parameters_match_one_process():
    refs = {name: mlp_reference(optimizer=OPTIMIZERS[name])[0] for name in OPTIMIZERS}
    ranks = run_gloo(_every_run, 4)
    matrices = [p for p in refs["muon"].values() if p.ndim == 2]
    slabs = sum(-(-p.shape[0] // B) for p in matrices)
    atols = {"muon": MUON_ATOL, "shampoo": SHAMPOO_ATOL}
    for run in RUNS:
        _, optimizer, layout = run
        for rank, results in enumerate(ranks):
            full, _, meshes = results[run]
            assert meshes == {1}, f"{run}: optim spans every dim, the (O,) mesh"
            for k, v in refs[optimizer].items():
                torch.testing.assert_close(full[k], v, atol=atols[optimizer], rtol=0,
                                           msg=f"{run} {k} rank {rank}")
        # one owner in the whole world: per step, the ranks together orthogonalize each matrix
        # once (Muon) or update each row slab once (Shampoo)
        work = [[r[run][1][s] for r in ranks] for s in range(STEPS)]
        done = [sum(w[0 if optimizer == "muon" else 1] for w in step) for step in work]
        assert done == [len(matrices) if optimizer == "muon" else slabs] * STEPS, (run, done)
        # the default layout cuts matrices here: one batched all-to-all each way per step; whole
        # matrices / slabs on one rank: nothing to exchange
        calls = 0 if layout == "whole" else 2
        assert all(w[2] == calls for step in work for w in step), (run, work)
