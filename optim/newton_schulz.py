"""Newton-Schulz orthogonalization, the inner kernel of Muon.

Keller Jordan's quintic iteration (https://kellerjordan.github.io/posts/muon/): in bf16 (or
``dtype``), scale
``X`` by ``1 / (||X||_F + eps)`` so its spectral norm is at most one, then apply
``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` for ``steps`` iterations. Tall matrices are
transposed first so ``A`` is the smaller Gram matrix. The result is approximately ``U V^T`` of the
SVD ``U S V^T`` of the input (singular values land in roughly [0.7, 1.2], by design).
"""

from __future__ import annotations

import torch

__all__ = ["DEFAULT_NS_COEFFICIENTS", "newton_schulz", "newton_schulz_flops"]

DEFAULT_NS_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)


def newton_schulz(
    x: torch.Tensor,
    steps: int = 5,
    coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Orthogonalize every matrix in the last two dims of ``x``; returns ``dtype`` (Muon's bf16
    by default; ``torch.float32`` for exact comparisons) of ``x``'s shape.

    Leading dims are a batch: each matrix is normalized by its own Frobenius norm.
    """
    if x.ndim < 2:
        raise ValueError(
            f"x must have at least 2 dims (a matrix or a batch of them), got shape {tuple(x.shape)}"
        )
    if steps < 0:
        raise ValueError(f"steps must be non-negative, got {steps}")
    a, b, c = coefficients
    tall = x.size(-2) > x.size(-1)
    y = x.to(dtype)
    if tall:
        y = y.mT
    y = y / (y.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        gram = y @ y.mT
        poly = b * gram + c * (gram @ gram)
        y = a * y + poly @ y
    return y.mT if tall else y


def newton_schulz_flops(rows: int, cols: int, steps: int = 5) -> int:
    """Multiply-add FLOPs of :func:`newton_schulz` on one ``rows x cols`` matrix.

    Per step with ``s = min(rows, cols)``, ``l = max(rows, cols)``: ``X X^T`` (``2 s^2 l``),
    ``A A`` (``2 s^3``) and ``B X`` (``2 s^2 l``).
    """
    short, long = min(rows, cols), max(rows, cols)
    return steps * (4 * short * short * long + 2 * short**3)
