"""A small Llama-like model and its pipeline split.

Pre-norm blocks (RMSNorm, causal multi-head attention without bias, SwiGLU MLP) between a token
embedding and an output head. :func:`pipeline_stage` keeps the part of the model one pipeline
stage runs (torchtitan's split by pruning). Its tensor-parallel plan is
:func:`ragged_placement.parallelize.parallelize_llama` (without sequence parallel: ``wq``/``wk``/
``wv``/``w1``/``w3`` column-wise, ``wo``/``w2`` row-wise, the embedding row-wise and the head
column-wise with a replicated output), re-exported here.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ragged_placement.parallelize import parallelize_llama  # re-exported

__all__ = ["Llama", "LlamaConfig", "parallelize_llama", "pipeline_stage"]


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a :class:`Llama`: ``n_heads`` must divide ``dim``; ``n_kv_heads`` (``None``:
    ``n_heads``) key/value heads must divide ``n_heads`` (grouped-query attention, as Llama 3);
    under tensor parallelism the TP size must divide ``n_kv_heads``, ``hidden_dim`` and
    ``vocab_size``."""

    vocab_size: int = 64
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    hidden_dim: int = 64
    norm_eps: float = 1e-5
    n_kv_heads: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "hidden_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"n_heads={self.n_heads} must divide dim={self.dim}")
        kv = self.n_kv_heads
        if kv is not None and (not isinstance(kv, int) or kv <= 0 or self.n_heads % kv):
            raise ValueError(
                f"n_kv_heads={kv!r} must be a positive int dividing n_heads={self.n_heads}"
            )


class Attention(nn.Module):
    """Causal multi-head attention without bias; ``cfg`` needs ``dim`` and ``n_heads``, and may
    give ``n_kv_heads`` (grouped-query attention; none or ``None``: ``n_heads``)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        kv_dim = (getattr(cfg, "n_kv_heads", None) or cfg.n_heads) * self.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: the local head count under tensor parallelism.
        q, k, v = (
            w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        if k.shape[1] != q.shape[1]:  # grouped-query attention: each key/value head serves a group
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """``forward(tokens)`` returns logits. A pipeline stage (:func:`pipeline_stage`) without the
    embedding takes hidden states; one without the head returns them."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def pipeline_stage(model: Llama, stage: int, num_stages: int) -> Llama:
    """A copy of ``model`` keeping stage ``stage`` of ``num_stages``: an equal share of the layers
    (in order), the embedding on the first stage, the norm and head on the last."""
    n = model.config.n_layers
    if not isinstance(num_stages, int) or not 1 <= num_stages <= n or n % num_stages:
        raise ValueError(f"num_stages must divide n_layers={n}, got {num_stages!r}")
    if not isinstance(stage, int) or not 0 <= stage < num_stages:
        raise ValueError(f"stage must be an int in [0, {num_stages}), got {stage!r}")
    part = copy.deepcopy(model)
    per = n // num_stages
    keep = {str(i) for i in range(stage * per, (stage + 1) * per)}
    for name in list(part.layers):
        if name not in keep:
            del part.layers[name]
    if stage > 0:
        part.tok_embeddings = None
    if stage < num_stages - 1:
        part.norm = None
        part.output = None
    return part
