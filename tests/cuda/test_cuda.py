"""The CUDA paths of block-wise FP8 on a GPU: the Triton kernels compiled for the device against
their torch twin (bitwise), and ``F.scaled_mm``'s block-wise GEMM, forward and backward, against
the dequantize-then-matmul emulation the CPU runs. Skipped without a GPU (``-m cuda`` selects
them; ``scripts/cuda_train_check.sh`` runs them with the trainer on CUDA)."""

from __future__ import annotations

import pytest
import torch

from ragged_placement.quant import BlockFP8Config
from ragged_placement.quant.blockwise import (
    dequantize_blockwise,
    quantize_blockwise,
    quantize_tiles,
)
from ragged_placement.quant.linear import _gemm, fp8_linear

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def _value_grid(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """Values over 12 decades, both signs, zeros and one tile of constants, on the GPU."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(shape, generator=g) * 10.0 ** torch.randint(-6, 6, shape, generator=g)
    x[0, :64] = 0.0
    x[1, :] = 3.0
    return x.to(dtype).cuda()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,block", [((384, 640), (128, 128)), ((300, 200), (128, 128)),
                                         ((1002, 768), (1, 128)), ((257, 130), (1, 128))])
def test_triton_quantize_equals_torch_bitwise(shape, block, dtype):
    x = _value_grid(shape, dtype)
    q_t, s_t = quantize_blockwise(x, block, kernel="triton")
    q_r, s_r = quantize_blockwise(x, block, kernel="torch")
    assert torch.equal(s_t, s_r)
    assert torch.equal(q_t.view(torch.uint8), q_r.view(torch.uint8))
    for out in (torch.float32, torch.bfloat16):
        d_t = dequantize_blockwise(q_t, s_t, block, dtype=out, kernel="triton")
        d_r = dequantize_blockwise(q_r, s_r, block, dtype=out, kernel="torch")
        assert torch.equal(d_t, d_r)


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.skipif(not SM90, reason="needs a CUDA device of sm90 or newer (block-wise scaled_mm)")
@pytest.mark.parametrize("m,k,n", [(1002, 768, 768), (256, 768, 3072), (512, 3072, 768)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_scaled_mm_gemm_matches_dequantized_reference(m, k, n, out_dtype):
    """1x128 activations x 128x128 weights. Tolerance, relative: 1e-3 with fp32 out (Hopper's
    FP8 tensor cores accumulate with fewer bits than fp32: 1.6e-4 measured on an H100 at
    1002x768x768), 4e-3 with bf16 out (one more rounding). A scale in the wrong layout is an
    O(1) error."""
    cfg = BlockFP8Config()
    g = torch.Generator(device="cpu").manual_seed(1)
    a = (torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4).cuda()
    b = (torch.randn(n, k, generator=g) * torch.rand(1, k, generator=g)).cuda()
    a_q, a_s = quantize_tiles(a, 128)
    b_q, b_s = quantize_blockwise(b, (128, 128))
    out = _gemm(a_q, a_s, b_q, b_s, (128, 128), cfg, out_dtype)
    ref = (dequantize_blockwise(a_q, a_s, (1, 128)).double()
           @ dequantize_blockwise(b_q, b_s, (128, 128)).double().t())
    assert out.shape == (m, n) and out.dtype == out_dtype
    assert _relative_error(out, ref) < (1e-3 if out_dtype == torch.float32 else 4e-3)


@pytest.mark.skipif(not SM90, reason="needs a CUDA device of sm90 or newer (block-wise scaled_mm)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_on_cuda_matches_the_cpu_emulation(dtype):
    """Forward, dgrad (the transposed 128x128 blocks) and wgrad on the GPU against the same
    function on the CPU, where the GEMMs are dequantize + fp32 matmul."""
    g = torch.Generator(device="cpu").manual_seed(2)
    x0 = torch.randn(6, 167, 768, generator=g).to(dtype)  # 1002 tokens: not a multiple of 4
    w0 = (torch.randn(1536, 768, generator=g) * 0.02).to(dtype)
    b0 = torch.randn(1536, generator=g).to(dtype)
    dy = torch.randn(6, 167, 1536, generator=g).to(dtype)
    grads = {}
    for device in ("cpu", "cuda"):
        x, w, b = (t.detach().clone().to(device).requires_grad_() for t in (x0, w0, b0))
        y = fp8_linear(x, w, b, config=BlockFP8Config(kernel="torch"))
        y.backward(dy.to(device))
        grads[device] = [t.detach().cpu() for t in (y, x.grad, w.grad, b.grad)]
    tol = 1e-3 if dtype == torch.float32 else 1e-2  # as above
    for name, cpu, gpu in zip(("y", "dx", "dw", "db"), grads["cpu"], grads["cuda"]):
        assert _relative_error(gpu, cpu) < tol, name
