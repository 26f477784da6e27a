"""Shard a Hugging Face ``transformers`` Llama with ``ragged_placement.fsdp.fully_shard``.

Builds ``LlamaForCausalLM`` from a tiny config (random init, nothing downloaded), wraps every
decoder layer and then the root, trains a few steps on 4 gloo CPU ranks with AdamW on the
RaggedShard DTensor parameters, and checks the losses against the same training on one process.

Run: ``.venv/bin/python examples/hf_llama.py`` (needs ``.venv/bin/pip install -e '.[examples]'``).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

from ragged_placement.testing.launch import run_gloo
from ragged_placement.models import StdlibCorpus

try:
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError:
    LlamaForCausalLM = None

SEQ = 32
BATCH = 8  # global batch, split over the ranks


def _build() -> torch.nn.Module:
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2 * SEQ,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _step(model, opt, corpus, step: int, rows: slice) -> torch.Tensor:
    x, _ = corpus.batch(step, BATCH, SEQ)
    loss = model(input_ids=x[rows], labels=x[rows]).loss  # the model shifts the labels
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _worker(rank: int, ws: int, steps: int) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh

    from ragged_placement.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (ws,))
    model = _build()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if rank == 0:
        print(model.fsdp_unit.buffers[0].plan.summary())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    corpus = StdlibCorpus(max_bytes=1 << 20)
    per = BATCH // ws
    losses = []
    for s in range(steps):
        loss = _step(model, opt, corpus, s, slice(rank * per, (rank + 1) * per))
        dist.all_reduce(loss)
        losses.append(loss.item() / ws)
    return losses


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    if LlamaForCausalLM is None:
        print("examples/hf_llama.py needs Hugging Face transformers: .venv/bin/pip install -e '.[examples]'")
        return 0
    model = _build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    corpus = StdlibCorpus(max_bytes=1 << 20)
    # One process on the whole batch: the mean of per-rank means equals it for equal splits.
    reference = [_step(model, opt, corpus, s, slice(None)).item() for s in range(args.steps)]
    sharded = run_gloo(_worker, args.world, args.steps)[0]
    print(f"{'step':>4s} {'fully_shard x' + str(args.world):>16s} {'one process':>12s}")
    for s, (a, b) in enumerate(zip(sharded, reference)):
        print(f"{s:4d} {a:16.5f} {b:12.5f}")
    diff = max(abs(a - b) for a, b in zip(sharded, reference))
    print(f"largest loss difference: {diff:.2e}")
    return 0 if diff < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
