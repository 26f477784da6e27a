"""The model, data and references of the per-state sharding tests (``fully_shard(state_sharding=
...)`` on a 2x2 ``(inter, intra)`` mesh: ``tests/fsdp/test_fsdp_state_sharding*.py`` and the MoE
optimizer test): the MLP, the named points, one process's training, and the optimizers with their
tolerances and work counter.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from common_fsdp import mse_loss, train_steps
from ragged_placement.optim import Muon, Shampoo
from torch import nn

from common.muon import DIST_ATOL as MUON_DIST_ATOL
from common.shampoo import ATOL as SHAMPOO_REF_ATOL
from ragged_placement.fsdp import StateSharding

D, H, BATCH, STEPS = 24, 40, 8, 5
TOL = 1e-5
BOTH = ("inter", "intra")
SHARDINGS = {
    "zero1": StateSharding(params=(), grads=(), optim=BOTH),
    "zero2": StateSharding(params=(), grads=BOTH, optim=BOTH),
    "zero3": StateSharding(params=BOTH, grads=BOTH, optim=BOTH),
    "hsdp": StateSharding(params=("intra",), grads=("intra",), optim=("intra",)),
    "hsdp_inter": StateSharding(params=("inter",), grads=("inter",), optim=("inter",)),
    "amsp": StateSharding(params=("intra",), grads=BOTH, optim=BOTH),
    # optim ranks out of mesh order (params-major: intra before inter), grads replicated on inter
    "amsp_zero1": StateSharding(params=("intra",), grads=("intra",), optim=BOTH),
    "grads_intra": StateSharding(params=(), grads=("intra",), optim=BOTH),
}


class MLP(nn.Module):
    """Three linears of shapes that do not split evenly over 4 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(D, H), nn.Linear(H, H), nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def mlp_data() -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(1)
    init = MLP().state_dict()
    x = torch.randn(STEPS + 1, BATCH, D, generator=g)
    return init, x, torch.randn(STEPS, BATCH, D, generator=g)


def mlp_adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def mlp_reference(
    init: dict[str, torch.Tensor] | None = None,
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One process on the whole batch from ``init`` (default: :func:`mlp_data`'s) with
    ``optimizer(model)`` (default :func:`mlp_adamw`): the parameters after ``STEPS`` steps and
    the eval output on ``x[STEPS]``."""
    default, x, y = mlp_data()
    m = MLP()
    m.load_state_dict(default if init is None else init)
    opt = mlp_adamw(m.parameters()) if optimizer is None else optimizer(m)
    train_steps(m, opt, zip(x, y), loss_fn=mse_loss)  # y: the STEPS training steps
    with torch.no_grad():
        return {k: v.detach().clone() for k, v in m.named_parameters()}, m(x[STEPS])


B = 8  # Shampoo's preconditioner block: slabs of 8 rows


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


class OptimizerWorkCounter:
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
