"""A small mixture-of-experts transformer in the DeepSeek-V3 / Kimi K2 shape (torchtitan's MoE).

``n_dense_layers`` Llama blocks (attention + SwiGLU) first, then MoE blocks whose feed-forward
is a :class:`MoE`: a shared expert (a SwiGLU every token goes through) plus ``num_experts``
routed experts, each token sent to its ``top_k`` experts by a :class:`TopKRouter` (softmax or
sigmoid scores; DeepSeek-V3's auxiliary-loss-free balancing with ``load_balance_coeff``: a
per-expert bias that only steers the top-k choice, updated from the token counts by
:func:`update_expert_bias`).

The routed experts are one :class:`GroupedExperts` module holding stacked tensors, torchtitan's
layout: ``w1``/``w3`` ``[E, ffn, dim]`` and ``w2`` ``[E, dim, ffn]``; expert ``e`` computes
``w2[e] @ (silu(w1[e] @ x) * (w3[e] @ x))``. Its forward takes the routed tokens sorted by
expert and the token count of each expert, so expert parallelism
(:class:`ragged_placement.expert_parallel.ExpertParallel`) can wrap it with its dispatch and
combine without touching the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from ragged_placement.models.llama import Attention, FeedForward
from ragged_placement.parallelize import parallelize_experts, parallelize_moe  # re-exported

if TYPE_CHECKING:
    from ragged_placement.quant import BlockFP8Config

__all__ = [
    "GroupedExperts", "MoE", "MoEBlock", "MoEConfig", "MoETransformer", "RouterGate", "TopKRouter",
    "parallelize_experts", "parallelize_moe", "run_experts", "update_expert_bias",
]

_SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEConfig:
    """Shape of a :class:`MoETransformer`.

    Args:
        vocab_size, dim, n_heads, norm_eps: as :class:`~ragged_placement.models.llama.LlamaConfig`.
        n_layers: blocks in all; the first ``n_dense_layers`` have a dense SwiGLU of
            ``hidden_dim``, the others a :class:`MoE`.
        moe_hidden_dim: the hidden size of each routed expert (and, times
            ``num_shared_experts``, of the shared expert; ``0`` shared experts: none).
        num_experts, top_k: routed experts per MoE layer and experts per token
            (``1 <= top_k <= num_experts``).
        score_func: ``"softmax"`` or ``"sigmoid"`` router scores (computed in fp32).
        route_norm: renormalize each token's top-k scores to sum to 1.
        route_scale: multiply the gate values by this.
        load_balance_coeff: ``None``, or the step of DeepSeek-V3's auxiliary-loss-free bias
            (:func:`update_expert_bias`).
        use_grouped_mm: ``None``: ``torch._grouped_mm`` on CUDA, the per-expert loop elsewhere;
            ``True``/``False`` force one (see :func:`run_experts`).
    """

    vocab_size: int = 64
    dim: int = 32
    n_layers: int = 3
    n_dense_layers: int = 1
    n_heads: int = 4
    hidden_dim: int = 64
    moe_hidden_dim: int = 16
    num_experts: int = 8
    top_k: int = 2
    num_shared_experts: int = 1
    score_func: str = "softmax"
    route_norm: bool = False
    route_scale: float = 1.0
    load_balance_coeff: float | None = None
    norm_eps: float = 1e-5
    use_grouped_mm: bool | None = None

    def __post_init__(self) -> None:
        for name in (
            "vocab_size", "dim", "n_layers", "n_heads", "hidden_dim", "moe_hidden_dim",
            "num_experts", "top_k",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"n_heads={self.n_heads} must divide dim={self.dim}")
        if not isinstance(self.n_dense_layers, int) or not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError(
                f"n_dense_layers must be an int in [0, n_layers={self.n_layers}], got "
                f"{self.n_dense_layers!r}"
            )
        if not isinstance(self.num_shared_experts, int) or self.num_shared_experts < 0:
            raise ValueError(
                f"num_shared_experts must be a non-negative int, got {self.num_shared_experts!r}"
            )
        _check_routing(self.num_experts, self.top_k, self.score_func)
        if self.load_balance_coeff is not None and not self.load_balance_coeff > 0:
            raise ValueError(
                f"load_balance_coeff must be None or > 0, got {self.load_balance_coeff!r}"
            )


def _check_routing(num_experts: int, top_k: int, score_func: str) -> None:
    if top_k > num_experts:
        raise ValueError(
            f"top_k={top_k} exceeds num_experts={num_experts}: a token cannot be routed to more "
            f"experts than exist; pass top_k <= num_experts"
        )
    if score_func not in _SCORE_FUNCS:
        raise ValueError(f"score_func must be one of {_SCORE_FUNCS}, got {score_func!r}")


def _grouped_mm_supported(device: torch.device) -> bool:
    return device.type == "cuda"


def run_experts(
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    x: torch.Tensor,
    counts: list[int],
    use_grouped_mm: bool | None = None,
    quant: BlockFP8Config | None = None,
    fp8_weights: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """SwiGLU experts on tokens sorted by expert: rows ``[sum(counts[:e]), sum(counts[:e+1]))``
    of ``x`` go through expert ``e`` of the stacked plain tensors ``w1``/``w3`` ``[E, ffn, dim]``
    and ``w2`` ``[E, dim, ffn]``.

    ``torch._grouped_mm`` (one kernel per matrix for all experts) or a loop of ``matmul`` per
    expert; both compute, per expert, ``x_e @ w[e].T`` (on CPU ``torch._grouped_mm``'s forward
    agrees with the loop to fp32 rounding, tests/moe/test_moe.py, but its backward does not run
    there, so ``None`` picks it only on CUDA; the CUDA path has not run here: no GPU).

    ``quant``: block-wise FP8 (DeepSeek-V3's recipe, :func:`~ragged_placement.quant.fp8_linear`)
    per expert, as ``FP8Linear`` computes a Linear: each expert's matrix quantized in its own
    ``quant.block`` blocks (never across experts), the activations in 1 x ``quant.tile`` tiles,
    FP8 forward and input gradient, high-precision weight gradient; always the loop (no FP8
    grouped GEMM here). ``fp8_weights``: ``{"w1": (q, s), ...}``, stacks already quantized so
    (what the FSDP FP8 all-gather gives, :mod:`ragged_placement.fsdp.fp8`: ``q`` of the stack's
    shape, ``s`` one scale per block of each expert's matrix); the others are quantized here."""
    if fp8_weights and quant is None:
        raise ValueError(
            f"fp8_weights for {sorted(fp8_weights)} without quant: the stacks are given as FP8 "
            f"blocks, so pass the quant (BlockFP8Config) they were quantized with"
        )
    if quant is not None:
        return _run_experts_fp8(w1, w2, w3, x, counts, quant, fp8_weights or {})
    if use_grouped_mm is None:
        use_grouped_mm = _grouped_mm_supported(x.device)
    if use_grouped_mm:
        offs = torch.tensor(counts, device=x.device, dtype=torch.int64).cumsum(0).to(torch.int32)
        h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)
    outs = []
    for e, x_e in enumerate(torch.split(x, counts, dim=0)):
        h = F.silu(torch.matmul(x_e, w1[e].transpose(-2, -1)))
        h = h * torch.matmul(x_e, w3[e].transpose(-2, -1))
        outs.append(torch.matmul(h, w2[e].transpose(-2, -1)))
    return torch.cat(outs, dim=0) if outs else x.new_zeros(0, w2.shape[1])


def _run_experts_fp8(
    w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor, counts: list[int],
    quant: BlockFP8Config, fp8_weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """:func:`run_experts`' loop with each matmul in block-wise FP8 (the stacks in
    ``fp8_weights`` taken quantized, each expert's ``(q[e], s[e])``)."""
    from ragged_placement.quant import fp8_linear

    # unbind: one gradient stack per weight in backward (indexing would add a zero-filled stack
    # per expert)
    stacks = {"w1": w1.unbind(0), "w2": w2.unbind(0), "w3": w3.unbind(0)}
    fp8 = {name: tuple(zip(q.unbind(0), s.unbind(0))) for name, (q, s) in fp8_weights.items()}

    def linear(inp: torch.Tensor, name: str, e: int) -> torch.Tensor:
        quantized = fp8[name][e] if name in fp8 else None
        return fp8_linear(inp, stacks[name][e], config=quant, weight_fp8=quantized)

    outs = []
    for e, x_e in enumerate(torch.split(x, counts, dim=0)):
        h = F.silu(linear(x_e, "w1", e)) * linear(x_e, "w3", e)
        outs.append(linear(h, "w2", e))
    return torch.cat(outs, dim=0) if outs else x.new_zeros(0, w2.shape[1])


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts as stacked parameters ``w1``/``w3`` ``[E, ffn, dim]`` and
    ``w2`` ``[E, dim, ffn]``. ``forward(x, counts)``: ``x`` sorted by expert, ``counts[e]``
    rows for expert ``e`` (a list of ints or a 1-D tensor). Parameters that are DTensors (expert
    parallelism's ``Shard(0)``) are used through their local tensors: ``counts`` then counts
    this rank's experts. ``quant``: block-wise FP8 compute (:func:`run_experts`), ``None``
    (the default) for the parameters' dtype.

    Under ``fully_shard(..., quant=)`` (which sets ``quant``) the three stacks are FP8 weights
    (``fp8_stacks``, :mod:`ragged_placement.fsdp.fp8`): all-gathered as FP8 blocks with one
    scale per block of each expert's matrix, which the runtime puts in ``fp8_weights`` while
    the module is unsharded; its parameters are then gradient sinks, not values."""

    quant: BlockFP8Config | None = None
    fp8_stacks = ("w1", "w2", "w3")

    def __init__(
        self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool | None = None
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.use_grouped_mm = use_grouped_mm
        self.fp8_weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, std=0.02)

    def forward(self, x: torch.Tensor, counts: torch.Tensor | list[int]) -> torch.Tensor:
        ws = [w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3)]
        if isinstance(counts, torch.Tensor):
            counts = counts.tolist()
        return run_experts(*ws, x, counts, self.use_grouped_mm, self.quant, self.fp8_weights)


class RouterGate(nn.Linear):
    """The router's ``nn.Linear(dim, E)``. A subclass so that block-wise FP8, which converts
    exactly ``nn.Linear`` (``fully_shard(quant=...)``, ``convert_to_fp8_linear``), leaves it in
    high precision, as DeepSeek-V3 keeps its gating modules: its scores choose the experts."""


class TopKRouter(nn.Module):
    """Token-choice top-k routing: ``forward(x, expert_bias)`` for ``x`` ``[T, dim]`` returns
    the gate values ``[T, k]`` (fp32), the chosen experts ``[T, k]`` and the token count of each
    expert ``[E]`` (int64). ``expert_bias`` only changes which experts are chosen, not the gate
    values (DeepSeek-V3)."""

    def __init__(
        self, dim: int, num_experts: int, top_k: int, score_func: str = "softmax",
        route_norm: bool = False, route_scale: float = 1.0,
    ) -> None:
        super().__init__()
        _check_routing(num_experts, top_k, score_func)
        self.gate = RouterGate(dim, num_experts, bias=False)
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.route_norm, self.route_scale = score_func, route_norm, route_scale

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """The fp32 router scores ``[T, E]`` before the bias."""
        logits = self.gate(x).float()
        return torch.sigmoid(logits) if self.score_func == "sigmoid" else logits.softmax(dim=-1)

    def forward(
        self, x: torch.Tensor, expert_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores = self.scores(x)
        choice = scores if expert_bias is None else scores + expert_bias
        selected = torch.topk(choice, self.top_k, dim=-1).indices
        top = scores.gather(-1, selected)
        if self.route_norm:
            top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
        counts = torch.bincount(selected.flatten(), minlength=self.num_experts)
        return top * self.route_scale, selected, counts


def _in_backward() -> bool:
    """Whether autograd is running a backward (where activation checkpointing recomputes)."""
    return torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    """A shared expert plus ``num_experts`` routed experts, ``top_k`` per token.

    ``tokens_per_expert`` (a buffer, not saved) sums the tokens each expert was chosen for
    since the last :func:`update_expert_bias` (forwards recomputed by activation checkpointing
    are not counted again); ``expert_bias`` (saved) exists with ``load_balance_coeff``."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.router = TopKRouter(
            cfg.dim, cfg.num_experts, cfg.top_k, cfg.score_func, cfg.route_norm, cfg.route_scale
        )
        self.experts = GroupedExperts(
            cfg.dim, cfg.moe_hidden_dim, cfg.num_experts, cfg.use_grouped_mm
        )
        self.shared_experts = (
            FeedForward(cfg.dim, cfg.moe_hidden_dim * cfg.num_shared_experts)
            if cfg.num_shared_experts else None
        )
        self.load_balance_coeff = cfg.load_balance_coeff
        self.register_buffer(
            "expert_bias",
            torch.zeros(cfg.num_experts) if cfg.load_balance_coeff is not None else None,
        )
        self.register_buffer(
            "tokens_per_expert", torch.zeros(cfg.num_experts, dtype=torch.int64), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        gates, selected, counts = self.router(x, self.expert_bias)
        if not _in_backward():
            with torch.no_grad():
                self.tokens_per_expert.add_(counts)
        order = torch.argsort(selected.flatten(), stable=True)
        token = order // self.top_k
        routed = self.experts(x[token], counts)
        routed = routed * gates.flatten()[order].unsqueeze(-1).to(routed.dtype)
        out = self.shared_experts(x) if self.shared_experts is not None else torch.zeros_like(x)
        return out.index_add(0, token, routed).reshape(shape)


@torch.no_grad()
def update_expert_bias(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing step for every :class:`MoE` of ``model``
    with ``load_balance_coeff``: sum ``tokens_per_expert`` over ``group`` (one all-reduce for
    all layers; none when ``dist`` is not initialized), then
    ``expert_bias += coeff * sign(mean count - count)`` and reset the counts. Call it on every
    rank of ``group`` before the optimizer step (after all gradient-accumulation steps)."""
    layers = [m for m in model.modules() if isinstance(m, MoE) and m.expert_bias is not None]
    if not layers:
        return
    counts = torch.stack([m.tokens_per_expert for m in layers]).float()
    if dist.is_initialized():
        dist.all_reduce(counts, group=group)
    for m, c in zip(layers, counts):
        m.expert_bias.add_(m.load_balance_coeff * torch.sign(c.mean() - c))
        m.tokens_per_expert.zero_()


class MoEBlock(nn.Module):
    """A pre-norm block: attention, then a dense SwiGLU (``feed_forward``) or a :class:`MoE`
    (``moe``)."""

    def __init__(self, cfg: MoEConfig, moe: bool) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.moe_enabled = moe
        if moe:
            self.moe = MoE(cfg)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return x + ffn(self.ffn_norm(x))


class MoETransformer(nn.Module):
    """``forward(tokens)`` returns logits ``[B, S, vocab]``. Blocks in ``layers`` (a
    ``ModuleDict`` keyed ``"0"``, ``"1"``, ..., as torchtitan's)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict(
            {str(i): MoEBlock(cfg, i >= cfg.n_dense_layers) for i in range(cfg.n_layers)}
        )
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Zero every MoE layer's ``tokens_per_expert`` and ``expert_bias`` (after
        ``to_empty`` on a model built on the meta device, with the weights)."""
        for m in self.modules():
            if isinstance(m, MoE):
                m.tokens_per_expert.zero_()
                if m.expert_bias is not None:
                    m.expert_bias.zero_()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))
