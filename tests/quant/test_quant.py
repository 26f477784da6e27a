"""Block-wise FP8: quantize/dequantize against an independent formula, errors, tiles."""

from __future__ import annotations

import math

import pytest
import torch
from common.quant import FP8, TINY, formula
from hypothesis import given, settings
from hypothesis import strategies as st

from ragged_placement.quant import (
    BlockFP8Config,
    dequantize_blockwise,
    dequantize_tiles,
    quantize_blockwise,
    quantize_blockwise_into,
    quantize_tiles,
)


def bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def assert_within_e4m3(w_hat: torch.Tensor, w: torch.Tensor, s_full: torch.Tensor) -> None:
    """``|w_hat - w|`` within e4m3's half-ulp: 2**-4 relative, or 2**-10 * s for subnormals."""
    err = (w_hat.float() - w.float()).abs()
    bound = torch.maximum(w.float().abs() * 2**-4, s_full * 2**-10) * (1 + 2**-8)
    assert bool((err <= bound).all()), float((err - bound).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (1, 5), (129, 127), (128, 1)])
def test_quantize_matches_formula_bitwise(shape, dtype):
    g = torch.Generator().manual_seed(hash(shape) % 1000)
    # rows of very different magnitude, so per-block scales differ by orders of magnitude
    w = (torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[0])[:, None]).to(dtype)
    q, s = quantize_blockwise(w)
    q_ref, s_ref = formula(w, (128, 128))
    assert q.shape == w.shape and q.dtype == FP8
    assert (
        s.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
        and s.dtype == torch.float32
    )
    assert torch.equal(bits(q), bits(q_ref))
    assert torch.equal(s, s_ref)
    # w ~= q * s within e4m3's half-ulp (2**-4 relative; 2**-10 * s absolute for subnormals)
    w_hat = dequantize_blockwise(q, s)
    s_full = s.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    assert_within_e4m3(w_hat, w, s_full)


@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(1, 160),
    n=st.integers(1, 160),
    block=st.sampled_from([(128, 128), (64, 32), (1, 128), (3, 5), (16, 16)]),
    log_scale=st.floats(-30, 30),
    seed=st.integers(0, 2**16),
)
def test_quantize_property(m, n, block, log_scale, seed):
    w = torch.randn(m, n, generator=torch.Generator().manual_seed(seed)) * 2.0**log_scale
    q, s = quantize_blockwise(w, block)
    q_ref, s_ref = formula(w, block)
    assert torch.equal(bits(q), bits(q_ref)) and torch.equal(s, s_ref)
    # every block's largest element maps to +-448 exactly (the scale uses the block's own amax)
    assert bool((dequantize_blockwise(q, s, block).abs() <= w.abs().amax() * (1 + 2**-4)).all())


def test_ragged_edge_scale_uses_only_the_edge_elements():
    w = torch.zeros(130, 260)
    w[:128, :256] = 1000.0  # interior blocks
    w[128:, 256:] = 0.5  # the 2x4 corner block
    w[:128, 256:] = 3.0  # right edge column of blocks (128x4)
    _, s = quantize_blockwise(w)
    assert s.shape == (2, 3)
    assert s[1, 2].item() == pytest.approx(0.5 / 448, rel=1e-7)
    assert s[0, 2].item() == pytest.approx(3.0 / 448, rel=1e-7)


def test_zero_and_tiny_blocks_dequantize_without_nan():
    w = torch.zeros(256, 256)
    w[128:, 128:] = 1e-42  # fp32 subnormal: amax / 448 underflows
    q, s = quantize_blockwise(w)
    assert torch.equal(s[0, 0], torch.tensor(TINY))  # all-zero block: smallest normal
    assert bool(torch.isfinite(s).all()) and bool((s > 0).all())
    w_hat = dequantize_blockwise(q, s)
    assert torch.equal(w_hat[:128], torch.zeros(128, 256))
    assert bool(torch.isfinite(w_hat).all())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_input_raises(bad, dtype):
    w = torch.randn(200, 300, dtype=dtype)
    w[150, 290] = bad
    with pytest.raises(ValueError, match="inf or NaN.*scale tile \\(1, 2\\)"):
        quantize_blockwise(w)
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_tiles(w)


def test_bad_arguments_raise_value_error():
    w = torch.randn(4, 4)
    with pytest.raises(ValueError, match="block"):
        quantize_blockwise(w, (0, 128))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        quantize_blockwise(w.half())
    with pytest.raises(ValueError, match="2-D"):
        quantize_blockwise(torch.randn(8))
    q, s = quantize_blockwise(w)
    with pytest.raises(ValueError, match="s must be float32 of shape \\(1, 1\\)"):
        dequantize_blockwise(q, s.repeat(2, 1))
    with pytest.raises(ValueError, match="kernel"):
        quantize_blockwise(w, kernel="cuda")
    with pytest.raises(ValueError, match="q_out"):
        quantize_blockwise_into(w, torch.empty(4, 5, dtype=FP8), torch.empty(1, 1))
    with pytest.raises(ValueError, match="block"):
        BlockFP8Config(block=(128,))
    with pytest.raises(ValueError, match="activation_tile"):
        BlockFP8Config(activation_tile=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiles_match_formula(dtype):
    x = (torch.randn(3, 5, 300, generator=torch.Generator().manual_seed(1)) * 7).to(dtype)
    q, s = quantize_tiles(x)
    assert q.shape == x.shape and s.shape == (3, 5, 3)
    for row in range(15):
        i, j = divmod(row, 5)
        q_ref, s_ref = formula(x[i, j][None], (1, 128))
        assert torch.equal(bits(q[i, j]), bits(q_ref[0])) and torch.equal(s[i, j], s_ref[0])
    back = dequantize_tiles(q, s, dtype=dtype)
    assert back.dtype == dtype
    assert_within_e4m3(back, x, s.repeat_interleave(128, -1)[..., :300])


def test_quantize_into_strided_views():
    """The send-buffer path: a row run of a flat buffer into strided FP8 / scale views."""
    flat = torch.randn(10_000)
    w = flat[1000 : 1000 + 260 * 30].view(260, 30)
    q_buf = torch.zeros(270, 40, dtype=torch.uint8)
    s_buf = torch.zeros(5, 2)
    quantize_blockwise_into(w, q_buf[5:265, 3:33].view(FP8), s_buf[1:4, 1:2], (128, 128))
    q_ref, s_ref = formula(w, (128, 128))
    assert torch.equal(q_buf[5:265, 3:33], bits(q_ref))
    assert torch.equal(s_buf[1:4, 1:2], s_ref)
    assert int(q_buf[:5].count_nonzero()) == 0 and float(s_buf[0].abs().sum()) == 0.0
