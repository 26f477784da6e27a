"""Public block-wise FP8 API: quantize / dequantize weights (blocks) and activations (tiles).

Every function takes ``kernel``: ``"auto"`` (Triton for CUDA tensors when Triton is importable,
the pure-torch reference otherwise), ``"triton"`` (always the Triton kernel: on CPU tensors this
needs ``TRITON_INTERPRET=1`` set before Triton is imported) or ``"torch"`` (the reference). Both
produce bitwise-identical FP8 bytes and scales; see :mod:`.reference` for the conventions.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Literal

import torch

from .reference import (
    FP8_DTYPE,
    check_block,
    check_dequant_args,
    check_finite_scales,
    check_quantizable,
    dequantize_blockwise_reference,
    quantize_blockwise_reference,
    scale_shape,
)

__all__ = [
    "BlockFP8Config",
    "Kernel",
    "dequantize_blockwise",
    "dequantize_tiles",
    "quantize_blockwise",
    "quantize_blockwise_into",
    "quantize_tiles",
    "triton_available",
]

Kernel = Literal["auto", "triton", "torch"]
_KERNELS = ("auto", "triton", "torch")


def triton_available() -> bool:
    """Whether ``triton`` can be imported (without importing it)."""
    return importlib.util.find_spec("triton") is not None


@dataclass(frozen=True)
class BlockFP8Config:
    """DeepSeek-V3-style block-wise FP8 training of ``nn.Linear`` weights.

    Args:
        block: weight quantization block ``(rows, cols)``; one fp32 scale per block. With
            RaggedShard sharding at ``block[0]``-row granularity every rank owns whole blocks
            and quantizes them with no communication.
        activation_tile: activations (and output gradients) are quantized in ``1 x tile``
            groups along the contraction dim.
        kernel: ``"auto"``, ``"triton"`` or ``"torch"`` (see the module doc).
    """

    block: tuple[int, int] = (128, 128)
    activation_tile: int = 128
    kernel: Kernel = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "block", check_block(self.block))
        check_block((1, self.activation_tile), "activation_tile")
        _check_kernel(self.kernel)


def _check_kernel(kernel: object) -> None:
    if kernel not in _KERNELS:
        raise ValueError(f"kernel must be one of {_KERNELS}, got {kernel!r}")


def _use_triton(kernel: Kernel, x: torch.Tensor) -> bool:
    _check_kernel(kernel)
    if kernel == "torch":
        return False
    if kernel == "triton":
        if not triton_available():
            raise ValueError("kernel='triton' was requested but triton is not installed")
        return True
    return x.is_cuda and triton_available()


def _check_out(
    t: torch.Tensor | None, name: str, shape: tuple[int, ...], dtype: torch.dtype, device
) -> None:
    if t is None:
        return
    if (
        not isinstance(t, torch.Tensor)
        or tuple(t.shape) != shape
        or t.dtype != dtype
        or t.device != device
    ):
        raise ValueError(
            f"{name} must be a {dtype} tensor of shape {shape} on {device}, got "
            f"{getattr(t, 'dtype', type(t).__name__)} of shape {tuple(getattr(t, 'shape', ()))} "
            f"on {getattr(t, 'device', None)}"
        )


def quantize_blockwise_into(
    w: torch.Tensor,
    q_out: torch.Tensor,
    s_out: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    *,
    kernel: Kernel = "auto",
    check_finite: bool = True,
) -> None:
    """Quantize 2-D ``w`` into caller-provided (possibly strided) ``q_out`` and ``s_out``.

    This is the FSDP send-buffer path: ``w`` is a rank's row run (a view of its sharded fp32
    flat buffer), ``q_out`` / ``s_out`` are views of the packed send buffer. Raises
    ``ValueError`` on inf/NaN input (after writing). ``check_finite=False`` skips that check
    (and its host sync): the tile's scale is then non-finite, for the caller to check later.
    """
    check_quantizable(w, "w", ndim=2)
    block = check_block(block)
    shape = tuple(w.shape)
    _check_out(q_out, "q_out", shape, FP8_DTYPE, w.device)
    _check_out(s_out, "s_out", scale_shape(shape, block), torch.float32, w.device)
    if _use_triton(kernel, w):
        from .triton_kernels import quantize_into

        quantize_into(w, q_out, s_out, block)
        if check_finite:
            check_finite_scales(s_out, "w")
    else:
        q, s = quantize_blockwise_reference(w, block, check_finite=check_finite)
        q_out.copy_(q)
        s_out.copy_(s)


def quantize_blockwise(
    w: torch.Tensor, block: tuple[int, int] = (128, 128), *, kernel: Kernel = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D fp32 or bf16 ``w`` to e4m3 with one fp32 scale per ``block``.

    Returns ``(q, s)``: ``q`` has ``w``'s shape and dtype ``float8_e4m3fn``; ``s`` is fp32 of
    shape ``[ceil(m / block[0]), ceil(n / block[1])]`` with ``s = max(amax / 448, FLT_MIN)``
    per block (ragged edge blocks use the elements they hold) and ``w ~= q.float() * s``.
    Raises ``ValueError`` on inf/NaN input.
    """
    check_quantizable(w, "w", ndim=2)
    block = check_block(block)
    if not _use_triton(kernel, w):
        return quantize_blockwise_reference(w, block)
    q = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
    s = torch.empty(scale_shape(w.shape, block), dtype=torch.float32, device=w.device)
    quantize_blockwise_into(w, q, s, block, kernel="triton")
    return q, s


def dequantize_blockwise(
    q: torch.Tensor,
    s: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    *,
    dtype: torch.dtype = torch.float32,
    kernel: Kernel = "auto",
) -> torch.Tensor:
    """``q.float() * s`` broadcast over ``block`` tiles, cast to ``dtype`` (fp32 or bf16)."""
    block = check_block(block)
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype}")
    if not _use_triton(kernel, q):
        return dequantize_blockwise_reference(q, s, block, dtype)
    from .triton_kernels import dequantize_into

    check_dequant_args(q, s, scale_shape(q.shape, block) if q.dim() == 2 else None)
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    dequantize_into(q, s, out, block)
    return out


def quantize_tiles(
    x: torch.Tensor, tile: int = 128, *, kernel: Kernel = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` (any rank >= 1) in ``1 x tile`` groups along its last dim.

    Returns ``(q, s)`` with ``q`` of ``x``'s shape and ``s`` fp32 of shape
    ``[*x.shape[:-1], ceil(x.shape[-1] / tile)]`` (DeepSeek-V3's activation recipe).
    """
    check_quantizable(x, "x")
    tile = check_block((1, tile), "tile")[1]
    q, s = quantize_blockwise(x.reshape(-1, x.shape[-1]), (1, tile), kernel=kernel)
    return q.view(x.shape), s.view(*x.shape[:-1], s.shape[-1])


def dequantize_tiles(
    q: torch.Tensor,
    s: torch.Tensor,
    tile: int = 128,
    *,
    dtype: torch.dtype = torch.float32,
    kernel: Kernel = "auto",
) -> torch.Tensor:
    """Inverse of :func:`quantize_tiles` (up to the quantization error)."""
    tile = check_block((1, tile), "tile")[1]
    if not isinstance(q, torch.Tensor) or q.dim() == 0:
        raise ValueError(f"q must be a tensor with at least one dim, got {q!r}")
    k = q.shape[-1]
    out = dequantize_blockwise(
        q.reshape(-1, k), s.reshape(-1, s.shape[-1]), (1, tile), dtype=dtype, kernel=kernel
    )
    return out.view(q.shape)
