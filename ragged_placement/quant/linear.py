"""FP8 ``nn.Linear`` with DeepSeek-V3-style block scaling.

Recipe (``y = x @ W^T + b``, ``x: [M, K]``, ``W: [N, K]``):

* forward: ``x`` quantized in ``1 x 128`` tiles along ``K``; ``W`` in ``128 x 128`` blocks (or
  taken pre-quantized from the FP8 all-gather); ``y = deq(x_q) @ deq(W_q)^T``.
* dgrad: ``dy`` quantized in ``1 x 128`` tiles along ``N`` (the contraction dim of dgrad) and
  the *same* block-quantized ``W_q``: ``dx = deq(dy_q) @ deq(W_q)``. 128 x 128 blocks are
  square, so ``W_q^T`` is the block quantization of ``W^T``: no re-quantization.
* wgrad: ``dW = dy^T @ x`` in the compute dtype (bf16 or fp32), not FP8. DeepSeek-V3 runs wgrad
  in FP8 too (``x`` and ``dy`` re-quantized along the token dim); we keep it in higher
  precision because ``dW`` feeds the optimizer directly and its FP8 error does not average out
  over steps, and because FP8 wgrad needs two more transposed quantization passes for a
  GEMM that is a third of the FLOPs. The communication saving (FP8 all-gather) is unaffected.
* bias (if any) and its gradient in the compute dtype.

Matmul back ends: on CUDA, ``torch.nn.functional.scaled_mm`` with ``ScalingType.BlockWise1x128``
(activations) x ``ScalingType.BlockWise128x128`` (weights), which needs ``K`` and ``N`` multiples
of 128 and sm90 (ValueError / torch's error otherwise, never a silent high-precision matmul).
Elsewhere (CPU) it is emulated by dequantize + fp32 matmul with the identical quantization, so
CPU numerics equal the FP8 GEMM's up to accumulation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .blockwise import (
    BlockFP8Config,
    dequantize_blockwise,
    dequantize_tiles,
    quantize_blockwise,
    quantize_tiles,
)
from .reference import FP8_DTYPE, scale_shape

__all__ = ["FP8Linear", "convert_to_fp8_linear", "fp8_linear"]

_DEFAULT_CONFIG = BlockFP8Config()


def _scaled_mm_available() -> bool:
    return hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")


def _pad_cols_to4(s: torch.Tensor) -> torch.Tensor:
    """cuBLAS wants the contraction-dim block count of 128x128 scales padded to a multiple of 4."""
    pad = -s.shape[1] % 4
    return F.pad(s, (0, pad)) if pad else s


def _gemm(
    a_q: torch.Tensor,
    a_s: torch.Tensor,
    b_q: torch.Tensor,
    b_s: torch.Tensor,
    b_block: tuple[int, int],
    cfg: BlockFP8Config,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``deq(a_q) @ deq(b_q)^T``: ``a: [M, K]`` in 1 x tile groups, ``b: [N, K]`` in ``b_block``."""
    if a_q.is_cuda:
        k, n = a_q.shape[1], b_q.shape[0]
        if not _scaled_mm_available():
            raise ValueError(
                "FP8 Linear on CUDA needs torch.nn.functional.scaled_mm (torch >= 2.10)"
            )
        if b_block != (128, 128) or cfg.activation_tile != 128 or k % 128 or n % 128:
            raise ValueError(
                f"scaled_mm's block-wise FP8 needs block=(128, 128), activation_tile=128 and both "
                f"dims multiples of 128; got block={b_block}, tile={cfg.activation_tile}, "
                f"K={k}, N={n}"
            )
        m = a_q.shape[0]
        pad_m = -m % 4  # cuBLAS: token count of 1x128 scales a multiple of 4
        if pad_m:
            a_q = F.pad(a_q.view(torch.uint8), (0, 0, 0, pad_m)).view(FP8_DTYPE)
            a_s = F.pad(a_s, (0, 0, 0, pad_m), value=1.0)
        out = F.scaled_mm(
            a_q,
            b_q.t(),
            a_s.t().contiguous().t(),  # [M, K/128], outer-dim-major
            F.ScalingType.BlockWise1x128,
            _pad_cols_to4(b_s).t(),  # [L4, N/128], L4-major
            F.ScalingType.BlockWise128x128,
            output_dtype=out_dtype,
        )
        return out[:m]
    a = dequantize_tiles(a_q, a_s, cfg.activation_tile, kernel=cfg.kernel)
    b = dequantize_blockwise(b_q, b_s, b_block, kernel=cfg.kernel)
    return (a @ b.t()).to(out_dtype)


class _FP8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, w_q, w_s, cfg):
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        x_q, x_s = quantize_tiles(x2, cfg.activation_tile, kernel=cfg.kernel)
        y = _gemm(x_q, x_s, w_q, w_s, cfg.block, cfg, x.dtype)
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(x2, w_q, w_s)
        ctx.cfg = cfg
        ctx.has_bias = bias is not None
        ctx.x_shape = x.shape
        ctx.weight_dtype = weight.dtype
        return y.view(*x.shape[:-1], w_q.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, w_q, w_s = ctx.saved_tensors
        cfg = ctx.cfg
        dy2 = dy.reshape(-1, dy.shape[-1]).to(x2.dtype)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dy_q, dy_s = quantize_tiles(dy2, cfg.activation_tile, kernel=cfg.kernel)
            # dgrad: contraction over N, so the weight operand is W^T = [K, N], whose blocks are
            # W's blocks transposed (the same q bytes and scales, no re-quantization).
            wt_q, wt_s = w_q.t().contiguous(), w_s.t().contiguous()
            dx = _gemm(dy_q, dy_s, wt_q, wt_s, cfg.block[::-1], cfg, x2.dtype).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            dw = (dy2.t() @ x2).to(ctx.weight_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db, None, None, None


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: BlockFP8Config = _DEFAULT_CONFIG,
    weight_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``x @ weight^T + bias`` in block-wise FP8 (see the module doc for the recipe).

    Args:
        x: ``[..., K]`` fp32 or bf16 activations.
        weight: ``[N, K]`` parameter. It receives the gradient; its values are read only when
            ``weight_fp8`` is not given (then it is quantized here).
        bias: optional ``[N]``.
        config: block / tile sizes and kernel choice.
        weight_fp8: the weight already quantized, ``(q, s)`` as returned by
            ``quantize_blockwise(weight, config.block)``: what the FSDP FP8 all-gather
            produces (:meth:`FP8GatherLayout.unpack`), so the unsharded high-precision weight
            never exists.
    """
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x [..., {x.shape[-1]}] does not match weight {tuple(weight.shape)} ([N, K])"
        )
    if weight_fp8 is None:
        with torch.no_grad():
            weight_fp8 = quantize_blockwise(weight.detach(), config.block, kernel=config.kernel)
    w_q, w_s = weight_fp8
    if (
        w_q.dtype != FP8_DTYPE
        or w_q.shape != weight.shape
        or tuple(w_s.shape) != scale_shape(weight.shape, config.block)
    ):
        raise ValueError(
            f"weight_fp8 must be (float8_e4m3fn {tuple(weight.shape)}, fp32 "
            f"{scale_shape(weight.shape, config.block)}), got ({w_q.dtype} {tuple(w_q.shape)}, "
            f"{w_s.dtype} {tuple(w_s.shape)})"
        )
    return _FP8LinearFunction.apply(x, weight, bias, w_q, w_s, config)


class FP8Linear(nn.Linear):
    """``nn.Linear`` whose matmuls run in block-wise FP8 (:func:`fp8_linear`).

    The FSDP runtime may set ``weight_fp8 = (q, s)`` (the gathered FP8 weight) before forward
    and clear it (``None``) after; otherwise the weight is quantized in each forward.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        config: BlockFP8Config = _DEFAULT_CONFIG,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.config = config
        self.weight_fp8: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, config=self.config, weight_fp8=self.weight_fp8)

    def extra_repr(self) -> str:
        cfg = self.config
        return f"{super().extra_repr()}, block={cfg.block}, activation_tile={cfg.activation_tile}"


def convert_to_fp8_linear(
    module: nn.Module, config: BlockFP8Config = _DEFAULT_CONFIG, *, filter_fn=None
) -> nn.Module:
    """Swap every ``nn.Linear`` in ``module`` (in place) for an :class:`FP8Linear` sharing its
    parameters.

    ``filter_fn(fqn, linear) -> bool`` selects which ones (default: all). Returns ``module``.
    """
    if type(module) is nn.Linear:
        raise ValueError(
            "convert_to_fp8_linear swaps children; pass the parent of a bare nn.Linear"
        )
    for fqn, child in list(module.named_modules()):
        for name, sub in list(child.named_children()):
            if type(sub) is not nn.Linear:
                continue
            full = f"{fqn}.{name}" if fqn else name
            if filter_fn is not None and not filter_fn(full, sub):
                continue
            new = FP8Linear(
                sub.in_features,
                sub.out_features,
                sub.bias is not None,
                config=config,
                device="meta",
            )
            new.weight = sub.weight
            new.bias = sub.bias
            setattr(child, name, new)
    return module
