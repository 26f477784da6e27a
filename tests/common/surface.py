"""The model, data and reference of the FSDP surface tests (``test_fsdp_surface``,
``test_fsdp_offload``): a small residual MLP, its initial state and data, one process's
training, the sharded loop, and the comparison with it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from common_fsdp import ResidualMLP, train_steps
from torch import nn

STEPS = 5
BATCH = 8
D = 16
LR = 1e-2
TOL = 1e-5


class Net(nn.Module):
    def __init__(self, n_blocks: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(8, D)
        self.blocks = nn.ModuleList(ResidualMLP(D, 3 * D) for _ in range(n_blocks))
        self.head = nn.Linear(D, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


_GEN = torch.Generator().manual_seed(0)


with torch.random.fork_rng():
    torch.manual_seed(0)
    INIT = Net().state_dict()  # built once: threads must not race on the global RNG


X = torch.randn(STEPS, BATCH, 8, generator=_GEN)
Y = torch.randn(STEPS, BATCH, 5, generator=_GEN)


def surface_net() -> Net:
    m = Net()
    m.load_state_dict(INIT)
    return m


def surface_optimizer(params, sgd: bool) -> torch.optim.Optimizer:
    # SGD where the gradients' scale must show (AdamW's step nearly ignores it)
    return torch.optim.SGD(params, lr=LR) if sgd else torch.optim.AdamW(params, lr=LR)


def surface_reference(
    grad_scale: float = 1.0, sgd: bool = False
) -> tuple[list[float], dict[str, torch.Tensor]]:
    m = surface_net()
    opt = surface_optimizer(m.parameters(), sgd)
    losses = []
    for s in range(STEPS):
        loss = F.mse_loss(m(X[s]), Y[s])
        (loss * grad_scale).backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in m.named_parameters()}


def surface_steps(m: nn.Module, opt: torch.optim.Optimizer, rank: int, ws: int,
           after_backward=None) -> list[float]:
    """``STEPS`` steps of the sharded ``m`` on this rank's part of each batch
    (``after_backward(m)`` between backward and the optimizer step): the global mean losses."""
    return train_steps(m, opt, zip(X, Y), rank, ws, loss_fn=mse, after_backward=after_backward)


def mse(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(m(x), y)


def assert_matches(result, ref, what: str) -> None:
    """``result`` and ``ref``, each ``(losses, full parameters)``, agree within ``TOL``."""
    losses, params = result
    ref_losses, ref_params = ref
    assert losses == pytest.approx(ref_losses, abs=TOL), what
    assert params.keys() == ref_params.keys()
    for k, v in params.items():
        torch.testing.assert_close(v, ref_params[k], atol=TOL, rtol=0, msg=f"{what} {k}")
