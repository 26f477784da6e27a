"""Pure-torch block-wise FP8 (e4m3) quantization: the reference twin of the Triton kernels.

Conventions (DeepSeek-V3's recipe):

* A weight ``w`` of shape ``[m, n]`` is cut into ``block = (bm, bn)`` tiles starting at ``(0, 0)``.
  Each tile gets one fp32 scale ``s = amax(|tile|) / 448`` (448 is e4m3's largest finite value)
  and its elements are stored as ``q = clamp(w / s, -448, 448).to(float8_e4m3fn)``; so
  ``w ~= q.float() * s``. Scales have shape ``[ceil(m / bm), ceil(n / bn)]``.
* Ragged edges: when ``m`` or ``n`` is not a multiple of the block, the last tile of that row or
  column is smaller; its ``amax`` is over the elements it actually holds (zero padding never
  changes an ``amax`` of absolute values).
* Tiny or all-zero tiles: the scale is clamped below at the smallest normal fp32,
  ``s = max(amax / 448, FLT_MIN)``, so an all-zero tile gets ``s = FLT_MIN`` and quantizes and
  dequantizes to exact zeros; no scale is ever zero, so no ``0 / 0`` and no ``inf``.
* Non-finite input raises ``ValueError``: an ``inf`` or ``NaN`` makes the tile's ``amax``
  non-finite, so the check runs once on the (small) scale tensor, not on the input.
* Activations use ``1 x tile`` groups along the last dim: ``block = (1, tile)`` on the input
  flattened to ``[-1, k]`` (``blockwise.quantize_tiles``).

The arithmetic is fp32 throughout: the input is upcast (exact for bf16), divided by the
scale with IEEE division, clamped, and cast with torch's round-to-nearest-even. The Triton
kernels reproduce each step bitwise.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "E4M3_MAX",
    "FP8_DTYPE",
    "SCALE_MIN",
    "check_block",
    "check_dequant_args",
    "check_finite_scales",
    "check_quantizable",
    "dequantize_blockwise_reference",
    "quantize_blockwise_reference",
    "scale_shape",
]

FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
SCALE_MIN = float(torch.finfo(torch.float32).tiny)  # smallest normal fp32, 2**-126
_INPUT_DTYPES = (torch.float32, torch.bfloat16)


def check_block(block: object, name: str = "block") -> tuple[int, int]:
    """Validate a ``(rows, cols)`` block and return it as a tuple of ints."""
    try:
        bm, bn = block  # type: ignore[misc]
    except (TypeError, ValueError):
        raise ValueError(
            f"{name} must be a pair of positive ints (rows, cols), got {block!r}"
        ) from None
    for v in (bm, bn):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a pair of positive ints (rows, cols), got {block!r}")
    return bm, bn


def check_quantizable(x: torch.Tensor, name: str, ndim: int | None = None) -> None:
    """Raise ``ValueError`` unless ``x`` is a floating tensor we quantize (fp32 or bf16)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INPUT_DTYPES:
        raise ValueError(f"{name} must be float32 or bfloat16, got dtype {x.dtype}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")
    if ndim is None and x.dim() == 0:
        raise ValueError(f"{name} must have at least one dim, got a scalar")


def scale_shape(shape: tuple[int, ...] | torch.Size, block: tuple[int, int]) -> tuple[int, ...]:
    """Shape of the scale tensor of a ``shape`` matrix quantized in ``block`` tiles; for a stack
    of matrices ``[*stack, m, n]`` (experts) each matrix has its own blocks: ``[*stack,
    ceil(m / block[0]), ceil(n / block[1])]``."""
    *stack, m, n = shape
    return (*stack, math.ceil(m / block[0]), math.ceil(n / block[1]))


def check_finite_scales(s: torch.Tensor, name: str) -> None:
    """Raise ``ValueError`` if a scale is not finite: its tile held an ``inf`` or ``NaN``."""
    if not bool(torch.isfinite(s).all()):
        bad = (~torch.isfinite(s)).nonzero()[0].tolist()
        raise ValueError(
            f"{name} contains inf or NaN (first in scale tile {tuple(bad)}); cannot quantize"
        )


def _blocks(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Zero-pad a 2-D fp32 tensor to whole blocks and view it as ``[mb, bm, nb, bn]``."""
    m, n = x.shape
    bm, bn = block
    mb, nb = scale_shape((m, n), block)
    if mb * bm != m or nb * bn != n:
        x = torch.nn.functional.pad(x, (0, nb * bn - n, 0, mb * bm - m))
    return x.reshape(mb, bm, nb, bn)


def _scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    # Divide by a tensor on amax's device: CUDA turns division by a Python scalar into a
    # multiplication by its (inexact) reciprocal, which would differ from the kernels' div_rn.
    return torch.clamp_min(amax / amax.new_tensor(E4M3_MAX), SCALE_MIN)


def _cast_e4m3(y: torch.Tensor) -> torch.Tensor:
    return y.clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def quantize_blockwise_reference(
    w: torch.Tensor, block: tuple[int, int] = (128, 128), *, check_finite: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D ``w`` to e4m3 with one fp32 scale per ``block`` tile (see module doc).

    With ``check_finite=False`` a tile holding inf/NaN gets a non-finite scale instead of a
    ``ValueError`` (for callers that check later, once, e.g. after a collective).
    """
    check_quantizable(w, "w", ndim=2)
    block = check_block(block)
    m, n = w.shape
    x = _blocks(w.float(), block)
    s = _scale_from_amax(x.abs().amax(dim=(1, 3)))
    if check_finite:
        check_finite_scales(s, "w")
    q = _cast_e4m3(x / s[:, None, :, None])
    mb, bm, nb, bn = x.shape
    return q.reshape(mb * bm, nb * bn)[:m, :n].contiguous(), s


def dequantize_blockwise_reference(
    q: torch.Tensor,
    s: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``q.float() * s`` broadcast over ``block`` tiles, cast to ``dtype``."""
    block = check_block(block)
    check_dequant_args(q, s, scale_shape(q.shape, block) if q.dim() == 2 else None)
    m, n = q.shape
    x = _blocks(q.float(), block) * s[:, None, :, None]
    mb, bm, nb, bn = x.shape
    return x.reshape(mb * bm, nb * bn)[:m, :n].to(dtype)


def check_dequant_args(
    q: torch.Tensor, s: torch.Tensor, expected_s: tuple[int, int] | None
) -> None:
    if not isinstance(q, torch.Tensor) or q.dtype != FP8_DTYPE or q.dim() != 2:
        raise ValueError(
            f"q must be a 2-D float8_e4m3fn tensor, got "
            f"{getattr(q, 'dtype', type(q).__name__)} of shape {tuple(getattr(q, 'shape', ()))}"
        )
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or tuple(s.shape) != expected_s:
        raise ValueError(
            f"s must be float32 of shape {expected_s} for q of shape {tuple(q.shape)}, got "
            f"{getattr(s, 'dtype', type(s).__name__)} of shape {tuple(getattr(s, 'shape', ()))}"
        )
