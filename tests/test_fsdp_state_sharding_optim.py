"""Muon and Shampoo (``ragged_placement.optim``) stepping on state-sharded parameters, on 4 gloo
ranks as a 2x2 mesh: AMSP and zero1 (``optim`` spans both dims, so the parameters are
RaggedShard DTensors on the 1-D ``(O,)`` mesh) train to one process with the same optimizer,
and every matrix (Muon) and every row slab (Shampoo) is computed by one rank of the whole world.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_gloo
from ragged_placement.optim import Muon, Shampoo
from test_fsdp_state_sharding import BATCH, BOTH, MLP, SHARDINGS, STEPS, _data
from test_optim_muon import DIST_ATOL as MUON_DIST_ATOL
from test_optim_shampoo import ATOL as SHAMPOO_REF_ATOL
from torch.distributed.device_mesh import init_device_mesh

from ragged_placement.fsdp import StateSharding, fully_shard

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

B = 8  # Shampoo's preconditioner block: slabs of 8 rows
POINTS = ("amsp", "zero1")
# Differences from one process: the gradients are averaged over 4 ranks instead of computed on
# the whole batch (fp32 rounding), which Newton-Schulz (bf16) and Shampoo's inverse roots carry
# into the update. Measured max |dW| after 5 steps: Muon 3.0e-8, Shampoo 6.0e-7. Bounds: Muon,
# test_optim_muon's DIST_ATOL (1e-6, sharded vs single device); Shampoo, test_optim_shampoo's
# ATOL (1e-5, against its fp32 reference; its DIST_ATOL of 1e-6 is for identical gradients).
MUON_ATOL = MUON_DIST_ATOL
SHAMPOO_ATOL = SHAMPOO_REF_ATOL


def _muon(m: torch.nn.Module) -> Muon:
    """Muon on the weights, its AdamW on the biases."""
    weights = [p for p in m.parameters() if p.ndim == 2]
    biases = [p for p in m.parameters() if p.ndim < 2]
    return Muon([{"params": weights}, {"params": biases, "algorithm": "adamw"}], lr=0.02,
                weight_decay=0.1, adjust_lr="match_rms_adamw")


def _shampoo(m: torch.nn.Module) -> Shampoo:
    return Shampoo(m.parameters(), lr=1e-2, max_preconditioner_dim=B, precondition_frequency=2,
                   epsilon=1e-6, weight_decay=0.05)


OPTIMIZERS = {"muon": _muon, "shampoo": _shampoo}


def _reference(optimizer: str) -> dict[str, torch.Tensor]:
    """One process on the whole batch, the same optimizer: the parameters after ``STEPS``."""
    init, x, y = _data()
    m = MLP()
    m.load_state_dict(init)
    opt = OPTIMIZERS[optimizer](m)
    for s in range(STEPS):
        F.mse_loss(m(x[s]), y[s]).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in m.named_parameters()}


class _Counter:
    """Counts the matrices Muon's Newton-Schulz and Shampoo's slab updates run on this rank."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from ragged_placement.optim import muon

        self.ns = 0
        self.slabs = 0
        ns, slab = muon.newton_schulz, Shampoo._slab_update

        def counted_ns(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            self.ns += math.prod(x.shape[:-2])
            return ns(x, *args, **kwargs)

        def counted_slab(opt: Shampoo, *args, **kwargs) -> torch.Tensor:
            self.slabs += 1
            return slab(opt, *args, **kwargs)

        monkeypatch.setattr(muon, "newton_schulz", counted_ns)
        monkeypatch.setattr(Shampoo, "_slab_update", counted_slab)


def _train(rank: int, ws: int, mesh, sharding: StateSharding, optimizer: str, count: _Counter):
    """``STEPS`` steps on this rank's share of the batch; the full parameters, and the work
    this rank's optimizer did per step (Newton-Schulz matrices, Shampoo slabs)."""
    init, x, y = _data()
    m = MLP()
    m.load_state_dict(init)
    for sub in (m.a, m.b, m):
        fully_shard(sub, mesh=mesh, state_sharding=sharding)
    opt = OPTIMIZERS[optimizer](m)
    per = BATCH // ws
    rows = slice(rank * per, (rank + 1) * per)
    work, meshes = [], {p.device_mesh.ndim for p in m.parameters()}
    for s in range(STEPS):
        F.mse_loss(m(x[s, rows]), y[s, rows]).backward()
        before = (count.ns, count.slabs)
        opt.step()
        opt.zero_grad()
        work.append((count.ns - before[0], count.slabs - before[1]))
    full = {k: v.full_tensor() for k, v in m.named_parameters()}
    return full, work, meshes


def _every_point(rank: int, ws: int):
    with pytest.MonkeyPatch.context() as mp:
        count = _Counter(mp)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=BOTH)
        return {
            (point, optimizer): _train(rank, ws, mesh, SHARDINGS[point], optimizer, count)
            for point in POINTS
            for optimizer in OPTIMIZERS
        }


@pytest.mark.multiprocess
def test_muon_and_shampoo_on_state_sharded_parameters_match_one_process():
    refs = {name: _reference(name) for name in OPTIMIZERS}
    ranks = run_gloo(_every_point, 4)
    matrices = [p for p in refs["muon"].values() if p.ndim == 2]
    slabs = sum(-(-p.shape[0] // B) for p in matrices)
    for point in POINTS:
        for optimizer, atol in (("muon", MUON_ATOL), ("shampoo", SHAMPOO_ATOL)):
            for rank, results in enumerate(ranks):
                full, _, meshes = results[point, optimizer]
                assert meshes == {1}, f"{point}: optim spans every dim, the (O,) mesh"
                for k, v in refs[optimizer].items():
                    torch.testing.assert_close(full[k], v, atol=atol, rtol=0,
                                               msg=f"{point} {optimizer} {k} rank {rank}")
            # one owner in the whole world: per step, the ranks together orthogonalize each
            # matrix once (Muon) and update each row slab once (Shampoo)
            ns = [sum(r[point, "muon"][1][s][0] for r in ranks) for s in range(STEPS)]
            assert ns == [len(matrices)] * STEPS, (point, ns)
            done = [sum(r[point, "shampoo"][1][s][1] for r in ranks) for s in range(STEPS)]
            assert done == [slabs] * STEPS, (point, done)
