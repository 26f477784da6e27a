"""The mixture-of-experts model and data the MoE tests share (``tests/moe/``): the config, the
seeded model, the batches, the loss and the full state to compare with one process.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from ragged_placement.fsdp import StateSharding
from ragged_placement.models.moe import MoEConfig, MoETransformer, TopKRouter

CFG = MoEConfig(
    vocab_size=64, dim=32, n_layers=3, n_dense_layers=1, n_heads=4, hidden_dim=48,
    moe_hidden_dim=16, num_experts=8, top_k=2, num_shared_experts=1,
)


WORLD = 4
BATCH, SEQ = 8, 8
STEPS = 5


def make_model(cfg: MoEConfig = CFG, seed: int = 0) -> MoETransformer:
    """The model with a router whose scores are far apart (gate std 0.3 instead of 0.02; seeds
    chosen for the routing margin, asserted by :func:`train_reference`)."""
    torch.manual_seed(seed)
    model = MoETransformer(cfg)
    for m in model.modules():
        if isinstance(m, TopKRouter):
            nn.init.normal_(m.gate.weight, std=0.3)
    return model


def batches(steps: int = STEPS, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=g),
            torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=g),
        )
        for _ in range(steps)
    ]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }


# 2x2 (inter, intra), EP over intra: AMSP for the dense units (parameters over intra, gradients
# and optimizer state over both), its projection for the experts (ZeRO-2 over inter), and ZeRO-1
# / ZeRO-3 over inter for the experts beside it.
AMSP = StateSharding(params=("intra",), grads=("inter", "intra"), optim=("inter", "intra"))
