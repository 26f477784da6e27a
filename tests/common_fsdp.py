"""What the FSDP tests share, as ``torch/testing/_internal/common_fsdp.py`` serves torch's.

Most tests here check one property: a model sharded over ``world_size`` ranks, each rank training
on its rows of every global batch, follows the same trajectory as one process training the same
model on the whole (concatenated) batch, and as torch FSDP2 side by side on the same model and
data. The pieces of that check live here, once:

* :func:`train_steps`: the loop. On each rank: forward and backward on the rank's rows of the
  batch, the optimizer step, then the global loss (the ranks' losses all-reduced and divided by
  the world size: each rank's loss is the mean over its equal share of rows, so this is the mean
  over the whole batch). With ``rank=0, world_size=1`` the same loop is the one-process reference
  on the whole batch and issues no collective.
* :func:`global_loss` and :func:`rows`: the two steps of that loop, for tests whose loop has
  more in it (gradient accumulation, a meter around the step).
* :func:`full` and :func:`full_params`: a parameter (or all of a module's) as the full tensor one
  process would hold, to compare after training.
* :func:`fully_shard_of`: ``"ours"`` or torch FSDP2's ``fully_shard``, so one test body runs
  both runtimes; :func:`shard_blocks`: torchtitan's recipe with either, each block then the root.
* :func:`mse_loss`: the regression loss of the small MLP tests, as :func:`train_steps` takes it.
* :class:`ResidualMLP`: a pre-norm residual MLP block, the unit most tests shard.
* :class:`Routed` and :func:`routed`: a model with a parameter some ranks use in a step and
  one no rank uses, with weights drawn once per width, the same in every rank thread.
* :func:`trainer_reference`: the trainer's (``ragged_placement.train``) step in one process on
  the whole global batch: its loss, AdamW, clipping and schedule.

A test keeps its own model, data, optimizer and tolerances; what it compares stays in the test.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import DTensor

from ragged_placement.fsdp import fully_shard

__all__ = ["ResidualMLP", "Routed", "full", "full_params", "fully_shard_of", "global_loss",
           "mse_loss", "routed", "rows", "shard_blocks", "train_steps", "trainer_reference"]


class ResidualMLP(nn.Module):
    """``x + fc2(act(fc1(norm(x))))`` with a ``width -> hidden -> width`` MLP."""

    def __init__(self, width: int, hidden: int,
                 act: Callable[[torch.Tensor], torch.Tensor] = torch.relu) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class Routed(nn.Module):
    """An input layer and a block, an ``expert`` used only where ``route`` is true, a layer
    ``unused`` that no forward reaches, and a ``dim -> 3`` head."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.block = nn.Sequential(nn.Linear(dim, dim), nn.Tanh())
        self.expert = nn.Linear(dim, dim)
        self.unused = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor, route: bool) -> torch.Tensor:
        h = self.block(self.inp(x))
        if route:
            h = h + self.expert(h)
        return self.head(h)


_ROUTED_LOCK = threading.Lock()
_ROUTED_WEIGHTS: dict[int, dict[str, torch.Tensor]] = {}


def routed(dim: int) -> Routed:
    """A :class:`Routed` of width ``dim`` holding weights drawn once (seed 0) for that width,
    by one thread at a time: rank threads drawing together would interleave their draws from
    the one global generator and get different weights."""
    with _ROUTED_LOCK:
        if dim not in _ROUTED_WEIGHTS:
            with torch.random.fork_rng():
                torch.manual_seed(0)
                _ROUTED_WEIGHTS[dim] = Routed(dim).state_dict()
        m = Routed(dim)  # its init draws from the global generator too
    m.load_state_dict(_ROUTED_WEIGHTS[dim])
    return m


def fully_shard_of(runtime: str) -> Callable[..., nn.Module]:
    """``fully_shard`` of ``runtime``: ``"ours"`` (ragged_placement's) or ``"fsdp2"`` (torch's;
    ``"torch"`` is a synonym)."""
    if runtime == "ours":
        return fully_shard
    if runtime in ("fsdp2", "torch"):
        return fsdp2_fully_shard
    raise ValueError(f"runtime={runtime!r}: expected 'ours' or 'fsdp2'")


def shard_blocks(
    model: nn.Module,
    runtime: str | Callable[..., nn.Module],
    blocks: Iterable[nn.Module] | None = None,
    *,
    block_kwargs: dict | None = None,
    **kwargs,
) -> nn.Module:
    """torchtitan's recipe: ``fully_shard`` (of ``runtime``, :func:`fully_shard_of`, or the
    function itself) on each of ``blocks`` (default ``model.layers``), then on ``model``, each
    with ``kwargs`` (the blocks also with ``block_kwargs``). Returns ``model``."""
    shard = fully_shard_of(runtime) if isinstance(runtime, str) else runtime
    for block in model.layers if blocks is None else blocks:
        shard(block, **kwargs, **(block_kwargs or {}))
    shard(model, **kwargs)
    return model


def mse_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``F.mse_loss(model(x), y)``: :func:`train_steps`'s ``loss_fn`` for a regression model."""
    return torch.nn.functional.mse_loss(model(x), y)


def rows(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s equal share of ``t``'s rows (dim 0), in rank order; all of it on one
    process."""
    per = t.shape[0] // world_size
    return t[rank * per : (rank + 1) * per]


def global_loss(loss: torch.Tensor, world_size: int) -> float:
    """The mean of the ranks' ``loss`` (one all-reduce of a copy; with ``world_size=1`` the loss
    itself and no collective)."""
    total = loss.detach().clone()
    if world_size > 1:
        dist.all_reduce(total)
    return total.item() / world_size


def train_steps(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batches: Iterable[Sequence[torch.Tensor]],
    rank: int = 0,
    world_size: int = 1,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    after_backward: Callable[[nn.Module], None] | None = None,
    step_context: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> list[float]:
    """One training step per batch of ``batches``; the global mean loss of each step.

    Each batch is a sequence of tensors whose dim 0 is the global batch; this rank runs
    ``loss_fn(model, *its_rows)`` (see :func:`rows`; default ``model(*its_rows)``, for a model
    that returns its loss), backward, ``after_backward(model)`` if
    given, ``opt.step()`` and ``opt.zero_grad()``. ``step_context``: a context manager factory
    entered around each forward and backward. ``rank=0, world_size=1`` (the default) is the
    one-process reference on the whole batch.
    """
    losses = []
    for batch in batches:
        local = tuple(rows(t, rank, world_size) for t in batch)
        with step_context() if step_context is not None else contextlib.nullcontext():
            loss = model(*local) if loss_fn is None else loss_fn(model, *local)
            loss.backward()
        if after_backward is not None:
            after_backward(model)
        opt.step()
        opt.zero_grad()
        losses.append(global_loss(loss, world_size))
    return losses


def full(t: torch.Tensor) -> torch.Tensor:
    """``t`` as one process holds it: a DTensor gathered (``full_tensor()``), a copy detached
    from autograd."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def full_params(model: nn.Module, drop: str = "") -> dict[str, torch.Tensor]:
    """``model``'s parameters by name as full tensors (:func:`full`); ``drop``: a substring
    removed from each name (a wrapper's prefix, e.g. ``"_checkpoint_wrapped_module."``)."""
    return {
        (name.replace(drop, "") if drop else name): full(p) for name, p in model.named_parameters()
    }


def trainer_reference(cfg, model: nn.Module, steps: int) -> list[float]:
    """``steps`` steps of the trainer's options ``cfg`` (a ``TrainConfig`` whose ``batch`` is the
    whole global batch) on ``model`` in one process: the trainer's loss, ``torch.optim.AdamW``,
    gradient clipping and schedule; the loss of each step."""
    from ragged_placement.trainer.build import TokenData, build_scheduler, loss_fn

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = build_scheduler(cfg, opt)
    data, losses = TokenData(cfg), []
    for step in range(steps):
        loss = loss_fn(model, *data.batch(step, 0, 1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def routed_reference(
    cfg, model: nn.Module, steps: int, margins: list[float], minimum: float,
) -> tuple[tuple[float, ...], dict[str, torch.Tensor]]:
    """:func:`trainer_reference` of a mixture of experts whose router hooks append to
    ``margins`` the smallest gap between the k-th and (k+1)-th score of each call; asserts no
    top-k decision was within ``minimum`` of a tie (so a distributed run must route the same
    tokens). The losses and the final weights."""
    losses = trainer_reference(cfg, model, steps)
    assert min(margins) >= minimum, f"a top-k decision is a near tie: margin {min(margins)}"
    return tuple(losses), {k: v.detach().clone() for k, v in model.state_dict().items()}
