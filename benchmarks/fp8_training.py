"""Validation loss after a few hundred steps of block-wise FP8 training against bf16.

The tests check the same property over 30 steps (``tests/quant/test_quant_linear.py``,
``tests/quant/test_fsdp_fp8.py``); this runs it long enough for differences in the recipe to show. A
1-layer GPT (width 128, 4 heads, sequence 64) from ``ragged_placement.models`` on the stdlib byte
corpus, AdamW (lr 1e-3, no weight decay), batch 8, the same initialization and batches for
every run:

* one process: fp32; bf16 autocast; FP8 (``convert_to_fp8_linear`` on the transformer blocks:
  128x128 weight blocks, 1x128 activation tiles, the CPU emulation of the GEMMs).
* ``fully_shard`` on ``--world`` gloo ranks, bf16 parameters and fp32 reduction for both: bf16;
  FP8 (``quant=BlockFP8Config((128, 128))``).

Validation loss is the mean over 8 batches of 32 sequences of the validation split. Usage:
``.venv/bin/python benchmarks/fp8_training.py [--steps 200] [--world 4]``.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ragged_placement.fsdp import MixedPrecisionPolicy, fully_shard
from ragged_placement.testing.launch import run_gloo
from ragged_placement.models import GPT, GPTConfig, StdlibCorpus
from ragged_placement.quant import BlockFP8Config, convert_to_fp8_linear

CFG = GPTConfig(n_layer=1, n_embd=128, n_head=4, block_size=64)
BATCH, LR, VAL_BATCHES, VAL_SIZE = 8, 1e-3, 8, 32
QUANT = BlockFP8Config(block=(128, 128))
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


@functools.cache
def _corpus() -> StdlibCorpus:
    return StdlibCorpus(max_bytes=1 << 20)


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def _rows(x: torch.Tensor, rank: int, ws: int) -> torch.Tensor:
    per = x.shape[0] // ws
    return x[rank * per : (rank + 1) * per]


def _train(model: GPT, steps: int, rank: int = 0, ws: int = 1, autocast: bool = False) -> float:
    """Train ``steps`` steps on rank ``rank``'s rows of each batch; the validation loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    for step in range(steps):
        x, y = _corpus().batch(step, BATCH, CFG.block_size)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(_rows(x, rank, ws), _rows(y, rank, ws))
        loss.backward()
        opt.step()
        opt.zero_grad()
    total = torch.zeros(())
    with torch.no_grad():
        for i in range(VAL_BATCHES):
            x, y = _corpus().batch(10_000 + i, VAL_SIZE, CFG.block_size, split="val")
            total += model(_rows(x, rank, ws), _rows(y, rank, ws)).float()
    if ws > 1:
        dist.all_reduce(total)
    return total.item() / (VAL_BATCHES * ws)


def one_process(mode: str, steps: int) -> float:
    model = _model()
    if mode == "fp8":  # the blocks' Linears; embeddings, norms and the tied head stay fp32
        convert_to_fp8_linear(model.layers)
    return _train(model, steps, autocast=mode == "bf16")


def _sharded_rank(rank: int, ws: int, steps: int) -> dict[str, float]:
    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    for name, quant in (("bf16", None), ("fp8", QUANT)):
        model = _model()
        for block in model.layers:
            fully_shard(block, mesh=mesh, quant=quant, mp_policy=BF16)
        fully_shard(model, mesh=mesh, quant=quant, mp_policy=BF16)
        out[name] = _train(model, steps, rank, ws)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--world", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)  # small matmuls: one thread is fastest
    t0 = time.perf_counter()
    rows = [(f"one process, {m}", one_process(m, args.steps)) for m in ("fp32", "bf16", "fp8")]
    sharded = run_gloo(_sharded_rank, args.world, args.steps)[0]
    rows += [(f"fully_shard x {args.world} ranks, {m}", sharded[m]) for m in ("bf16", "fp8")]
    ref = {"one process": rows[1][1], "fully_shard": rows[3][1]}
    print(f"{args.steps} steps; validation loss (ln 256 = 5.545 at initialization)\n")
    print("| run | validation loss | vs bf16 |\n|---|---|---|")
    for label, loss in rows:
        bf16 = ref[label.split(",")[0].split(" x ")[0]]
        print(f"| {label} | {loss:.4f} | {(loss - bf16) / bf16:+.2%} |")
    print(f"\nwall time {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
