"""The small Llama the composition tests (TP, PP, 3-D: ``tests/compose/``) train: its config,
batches and initial state, the training loop, the pipeline-parallel losses, and the full state
and mean loss over ranks to compare with one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage

from ragged_placement.fsdp import fully_shard
from ragged_placement.models.llama import Llama, LlamaConfig, pipeline_stage
from ragged_placement.parallelize import parallelize_llama

CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, hidden_dim=64)
STEPS, BATCH, SEQ, LR = 10, 4, 8, 1e-2


def llama_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def llama_init_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return Llama(CFG).state_dict()


def llama_model(state: dict[str, torch.Tensor]) -> Llama:
    model = Llama(CFG)
    model.load_state_dict(state)
    return model


def llama_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, CFG.vocab_size), targets.reshape(-1))


def train_llama(model, batches, clip: bool) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for b in batches:
        loss = llama_loss(model(b[:, :-1]), b[:, 1:])
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def mean_over_ranks(losses: list[float], group=None) -> list[float]:
    t = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return (t / dist.get_world_size(group)).tolist()


def full_state_of(model) -> dict[str, torch.Tensor]:
    return {
        k: v.full_tensor() if hasattr(v, "full_tensor") else v
        for k, v in model.state_dict().items()
    }


def pipeline_losses(
    mesh, state, schedule_cls, lr: float, tp_mesh=None, deferred: bool = False,
    first_grads: dict | None = None, counts: list | None = None,
) -> list[float]:
    """Two pipeline stages on ``mesh["pp"]``, each ``fully_shard``ed on ``mesh["dp"]`` (after the
    tensor-parallel plan on ``tp_mesh``, if given); the last stage's losses, averaged over dp.
    With ``deferred``, the micro-batches run with gradient sync off and one
    ``reduce_gradients()`` follows each step. ``counts`` (a list) receives (reduce-scatters,
    units) per step, ``first_grads`` the full gradients of the first step."""
    s, d = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    part = pipeline_stage(llama_model(state), s, 2)
    if tp_mesh is not None:
        parallelize_llama(part, tp_mesh)
    for block in part.layers.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(part, mesh=mesh["dp"])
    n_micro, half = 2, BATCH // 2
    mb = half // n_micro
    x_example = (
        torch.zeros(mb, SEQ, dtype=torch.long)
        if s == 0
        else torch.zeros(mb, SEQ, CFG.dim, requires_grad=True)
    )
    y_example = torch.zeros(mb, SEQ, CFG.dim if s == 0 else CFG.vocab_size, requires_grad=True)
    stage = PipelineStage(
        part,
        s,
        2,
        torch.device("cpu"),
        input_args=(x_example,),
        output_args=(y_example,),
        group=mesh["pp"].get_group(),
    )
    schedule = schedule_cls(stage, n_micro, loss_fn=llama_loss)
    opt = torch.optim.AdamW(part.parameters(), lr=lr)
    losses = []
    for b in llama_batches():
        b = b[d * half : (d + 1) * half]
        mb_losses: list[torch.Tensor] = []
        before = sum(u.stats.reduce_scatters for _, u in part.fsdp_units())
        if deferred:
            part.set_requires_gradient_sync(False)
        if s == 0:
            schedule.step(b[:, :-1])
        else:
            schedule.step(target=b[:, 1:], losses=mb_losses)
        if deferred:
            part.reduce_gradients(scale=1 / n_micro)  # a no-op: the schedule reduced already
        if counts is not None:
            after = sum(u.stats.reduce_scatters for _, u in part.fsdp_units())
            counts.append((after - before, len(list(part.fsdp_units()))))
        if first_grads is not None and not first_grads:
            first_grads.update((n, p.grad.full_tensor()) for n, p in part.named_parameters())
        opt.step()
        opt.zero_grad()
        losses.append(sum(x.item() for x in mb_losses) / n_micro if s == 1 else 0.0)
    return mean_over_ranks(losses, mesh["dp"].get_group()) if s == 1 else []
