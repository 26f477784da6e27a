"""Triton kernels for block-wise FP8 quantize / dequantize (memory-bound parts of the recipe).

Each kernel is bitwise equal to its pure-torch twin in :mod:`.reference`:

* ``_quantize_kernel`` reads a ``[rows, cols]`` strided fp32 or bf16 matrix (for FSDP: a
  rank's row run, a view straight into its sharded flat buffer), and writes e4m3 values into a
  provided strided FP8 output and one fp32 scale per ``BLOCK_M x BLOCK_N`` tile into a provided
  strided scale output. One program handles ``GROUPS`` tiles stacked along the rows, so the
  ``1 x 128`` activation recipe (``BLOCK_M = 1``) still gives each program a useful amount of work.
* ``_dequantize_kernel`` is the inverse: ``q.float() * s`` cast to the output dtype (fp32 or
  bf16; the bf16 rounding is also done in fp32 first, for the same interpreter reason).

Rounding onto the e4m3 grid happens in fp32 *before* the cast (``_round_to_e4m3``): the cast
then only sees exactly representable values. Triton 3.9's interpreter rounds fp32 ->
``float8e4nv`` wrongly (it drops the carry of a mantissa round-up, 7.78 -> 4.0, and rounds ties
and subnormals differently from torch), while the GPU's ``cvt.rn.satfinite`` is correct; rounding
first makes both paths bitwise equal to ``torch.Tensor.to(torch.float8_e4m3fn)``. Division uses
``div_rn`` (IEEE round-to-nearest), as torch does, not Triton's default approximate division.

This module imports ``triton``; :mod:`.blockwise` imports it only when a kernel is requested.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import E4M3_MAX, FP8_DTYPE, SCALE_MIN

__all__ = ["dequantize_into", "quantize_into"]

_E4M3_MAX = tl.constexpr(E4M3_MAX)
_SCALE_MIN = tl.constexpr(SCALE_MIN)

# A program covers about this many elements (64 KiB of fp32 reads): enough to saturate HBM
# without spilling registers at num_warps=8.
_ELEMS_PER_PROGRAM = 16384


@triton.jit
def _round_to_e4m3(y):
    """Round fp32 ``y`` (``|y| <= 448``) to the nearest e4m3 value, ties to even, in fp32.

    The grid spacing (ulp) of e4m3 at ``|y|`` is ``2**(max(e, -6) - 3)`` where ``e`` is the
    binary exponent of ``|y|`` (normal e4m3 below 2**-6 become subnormal with a fixed ulp of
    2**-9). Adding and subtracting ``ulp * 2**23`` makes the fp32 adder round ``|y|`` to a
    multiple of ``ulp`` with round-to-nearest-even; a carry into the next binade is kept. The
    sign is copied back bitwise, so ``-0.0`` stays ``-0.0``.
    """
    bits = y.to(tl.int32, bitcast=True)
    sign = bits & -2147483648  # 0x80000000
    mag = (bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) - 127
    ulp_exp = tl.maximum(exp, -6) - 3
    magic = ((ulp_exp + 23 + 127) << 23).to(tl.float32, bitcast=True)
    rounded = (mag + magic) - magic
    rounded = tl.minimum(rounded, 448.0)
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _round_to_bf16(y):
    """Round fp32 ``y`` to the nearest bfloat16, ties to even, in fp32 (exactly castable).

    The interpreter's fp32 -> bf16 cast does not round to nearest-even like torch and the GPU.
    """
    bits = y.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _tile(rows, cols, stride_sm, stride_sn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          GROUPS: tl.constexpr):
    """This program's tile, ``GROUPS`` scale rows of ``BLOCK_M`` rows by ``BLOCK_N`` columns:
    the element rows (``[G, BM, 1]``, int64: a stacked expert weight's row * stride can exceed
    2**31) and columns (``[1, 1, BN]``), their mask, and the offsets and mask of the tile's
    scales (``[G]``)."""
    pid_n = tl.program_id(1)
    offs_g = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)  # scale-row index of each group
    offs_r = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row = offs_g[:, None, None].to(tl.int64) * BLOCK_M + offs_r[None, :, None]
    col = offs_n[None, None, :]
    mask = (row < rows) & (col < cols)
    s_off = offs_g * stride_sm + pid_n * stride_sn
    s_mask = offs_g < (rows + BLOCK_M - 1) // BLOCK_M
    return row, col, mask, s_off, s_mask


@triton.jit
def _quantize_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    rows,
    cols,
    stride_xm,
    stride_xn,
    stride_qm,
    stride_qn,
    stride_sm,
    stride_sn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUPS: tl.constexpr,
):
    row, col, mask, s_off, s_mask = _tile(
        rows, cols, stride_sm, stride_sn, BLOCK_M, BLOCK_N, GROUPS
    )
    x = tl.load(x_ptr + row * stride_xm + col * stride_xn, mask=mask, other=0.0).to(tl.float32)
    # NaN -> inf before the max (Triton's max need not propagate NaN): any non-finite input
    # gives a non-finite scale, which the host checks once.
    ax = tl.where(x != x, float("inf"), tl.abs(x))  # noqa: PLR0124 - x != x is the NaN test
    amax = tl.max(tl.max(ax, axis=2), axis=1)  # [G]
    s = tl.maximum(tl.math.div_rn(amax, _E4M3_MAX), _SCALE_MIN)
    y = tl.math.div_rn(x, s[:, None, None])
    y = tl.minimum(tl.maximum(y, -_E4M3_MAX), _E4M3_MAX)
    q = _round_to_e4m3(y).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + row * stride_qm + col * stride_qn, q, mask=mask)
    tl.store(s_ptr + s_off, s, mask=s_mask)


@triton.jit
def _dequantize_kernel(
    q_ptr,
    s_ptr,
    out_ptr,
    rows,
    cols,
    stride_qm,
    stride_qn,
    stride_sm,
    stride_sn,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUPS: tl.constexpr,
):
    row, col, mask, s_off, s_mask = _tile(
        rows, cols, stride_sm, stride_sn, BLOCK_M, BLOCK_N, GROUPS
    )
    q = tl.load(q_ptr + row * stride_qm + col * stride_qn, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + s_off, mask=s_mask, other=1.0)
    out = q * s[:, None, None]
    if out_ptr.dtype.element_ty == tl.bfloat16:
        out = _round_to_bf16(out)
    out = out.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_om + col * stride_on, out, mask=mask)


def _launch_shape(rows: int, cols: int, block: tuple[int, int]) -> tuple[tuple[int, int], int]:
    bm, bn = block
    for v, what in ((bm, "rows"), (bn, "cols")):
        if v & (v - 1):
            raise ValueError(
                f"the Triton kernels need power-of-two block {what}, got block={block}"
            )
    groups = max(1, _ELEMS_PER_PROGRAM // (bm * bn))
    # no more groups than there are tiles (keeps tiny matrices to one small program)
    groups = min(groups, triton.next_power_of_2(triton.cdiv(rows, bm)))
    return (triton.cdiv(rows, bm * groups), triton.cdiv(cols, bn)), groups


def _launch(
    kernel, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, block: tuple[int, int]
) -> None:
    """Run ``kernel`` (``_quantize_kernel`` or ``_dequantize_kernel``) over ``a``'s 2-D shape in
    ``block`` tiles: its three tensors, the shape, each tensor's two strides; nothing when
    ``a`` is empty."""
    rows, cols = a.shape
    if rows == 0 or cols == 0:
        return
    grid, groups = _launch_shape(rows, cols, block)
    kernel[grid](
        a,
        b,
        c,
        rows,
        cols,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        c.stride(1),
        BLOCK_M=block[0],
        BLOCK_N=block[1],
        GROUPS=groups,
        num_warps=8,
    )


def quantize_into(
    x: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor, block: tuple[int, int]
) -> None:
    """Quantize 2-D ``x`` into the provided ``q_out`` (e4m3, ``x``'s shape) and ``s_out``.

    All three may be strided views (e.g. a row run of a flat buffer and slices of a send
    buffer). Shapes and dtypes are the caller's responsibility (:mod:`.blockwise` checks them).
    """
    _launch(_quantize_kernel, x, q_out, s_out, block)


def dequantize_into(
    q: torch.Tensor, s: torch.Tensor, out: torch.Tensor, block: tuple[int, int]
) -> None:
    """Write ``q.float() * s`` (broadcast over ``block`` tiles) into ``out`` (its dtype)."""
    if q.dtype != FP8_DTYPE:
        raise ValueError(f"q must be float8_e4m3fn, got {q.dtype}")
    _launch(_dequantize_kernel, q, s, out, block)
