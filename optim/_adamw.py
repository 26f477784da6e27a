"""The AdamW update on local tensors (any placement: it is elementwise)."""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["adamw_math", "adamw_update"]


def adamw_math(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """``torch.optim.AdamW``'s step ``step`` (no amsgrad) on ``param`` and its moments, in
    place: element-wise, so one call on a run of flat shards is the calls on its parameters."""
    beta1, beta2 = betas
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = math.sqrt(1 - beta2**step)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


def adamw_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, Any],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One ``torch.optim.AdamW`` step (no amsgrad) on ``param`` in place; fills ``state`` lazily."""
    if "step" not in state:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(param)
        state["exp_avg_sq"] = torch.zeros_like(param)
    state["step"] += 1
    adamw_math(param, grad, state["exp_avg"], state["exp_avg_sq"], int(state["step"].item()),
               lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
