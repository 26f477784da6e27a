"""Two ranks sharing one GPU over gloo: the runtime's CUDA paths with collectives in flight
across processes (prefetched all-gathers, reduce-scatters waited on a backward later; gloo
stages each CUDA collective through pinned host memory on a stream of its own and orders it
against the caller's stream with events). NCCL refuses two ranks on one device; why gloo can,
and which of its collectives take CUDA tensors: CONTRIBUTING.md, "Several ranks on one GPU".
Skipped without a GPU (``-m cuda``; ``scripts/gpu_check.sh`` runs it)."""

from __future__ import annotations

import copy

import pytest
import torch
from dist_utils import run_gloo

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.multiprocess,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

STEPS = 3


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randint(256, (2, 32), generator=g), torch.randint(256, (2, 32), generator=g)
    return x.cuda(), y.cuda()


def _reference(plain, ws: int) -> list[list[torch.Tensor]]:
    """One process on the same GPU: each step the gradient of every rank's batch, summed over
    the ranks and divided by their number (what the reduce-scatter and the average compute; a
    sum of two is exact in either order), then the same AdamW step."""
    model = copy.deepcopy(plain)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    params = []
    for step in range(STEPS):
        grads = []
        for r in range(ws):
            model.zero_grad()
            model(*_batch(r, step)).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *gs in zip(model.parameters(), *grads):
            p.grad = (gs[0] + gs[1]) / ws
        opt.step()
        params.append([p.detach().cpu() for p in model.parameters()])
    return params


def _two_ranks_one_gpu(rank: int, ws: int) -> tuple:
    from torch.distributed.device_mesh import init_device_mesh

    from ragged_placement.fsdp import fully_shard
    from ragged_placement.models import GPT, GPTConfig

    torch.cuda.set_device(0)
    mesh = init_device_mesh("cuda", (ws,))
    torch.manual_seed(0)
    plain = GPT(GPTConfig(n_layer=3, n_embd=64, n_head=2, block_size=32)).cuda()
    model = copy.deepcopy(plain)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    layers = list(model.layers)
    for i, block in enumerate(layers):  # all-gathers issued a block ahead, both directions
        block.set_modules_to_forward_prefetch(layers[i + 1:i + 2])
        block.set_modules_to_backward_prefetch(layers[max(i - 1, 0):i])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ours = []
    for step in range(STEPS):
        model(*_batch(rank, step)).backward()
        opt.step()
        opt.zero_grad()
        ours.append([p.full_tensor().cpu() for p in model.parameters()])
    return ours, _reference(plain, ws)


def test_two_ranks_sharing_one_gpu_train_exactly_as_one_process():
    """2 gloo ranks on GPU 0, a GPT's blocks and root sharded, all-gathers prefetched a block
    ahead in forward and backward: 3 AdamW steps give, bitwise, the parameters of one process
    that sums the two ranks' gradients, halves them and steps."""
    for ours, ref in run_gloo(_two_ranks_one_gpu, 2):
        for step, (a, b) in enumerate(zip(ours, ref)):
            for x, y in zip(a, b):
                assert torch.equal(x, y), step
