"""The small Llama's grouped-query attention (``LlamaConfig.n_kv_heads``)."""

from __future__ import annotations

import pytest
import torch

from ragged_placement.models.llama import Attention, LlamaConfig


def test_grouped_query_attention_equals_multi_head_with_shared_key_value_heads():
    """With 2 key/value heads for 4 query heads the attention equals multi-head attention
    whose key/value projections repeat each key/value head's rows for its group of 2."""
    gqa_cfg = LlamaConfig(dim=32, n_heads=4, n_kv_heads=2)
    torch.manual_seed(0)
    gqa = Attention(gqa_cfg)
    assert gqa.wk.weight.shape == (16, 32) and gqa.wv.weight.shape == (16, 32)
    mha = Attention(LlamaConfig(dim=32, n_heads=4))
    hd = gqa.head_dim
    with torch.no_grad():
        mha.wq.weight.copy_(gqa.wq.weight)
        mha.wo.weight.copy_(gqa.wo.weight)
        for name in ("wk", "wv"):
            rows = getattr(gqa, name).weight.view(2, hd, 32).repeat_interleave(2, dim=0)
            getattr(mha, name).weight.copy_(rows.reshape(32, 32))
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(gqa(x), mha(x))


@pytest.mark.parametrize("kv", [3, 0, 8])
def test_bad_n_kv_heads_raise_value_error(kv):
    with pytest.raises(ValueError, match=f"n_kv_heads={kv} must be a positive int dividing"):
        LlamaConfig(dim=32, n_heads=4, n_kv_heads=kv)
