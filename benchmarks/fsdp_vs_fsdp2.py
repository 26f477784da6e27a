"""Our zero-copy FSDP runtime vs torch FSDP2 ``fully_shard``: same GPT, same data, same ranks.

Spawns ``--world`` gloo ranks on this machine (CPU). Both runtimes wrap every transformer block
and then the root, train with ``torch.optim.AdamW(foreach=True)`` on the DTensor parameters, and
are measured with the same instruments (:mod:`ragged_placement.testing.profiling`):

* collectives per step and their bytes (all-gather outputs, reduce-scatter inputs);
* layout-copy bytes per step: bytes written by FSDP2's ``all_gather_copy_in``,
  ``split_with_sizes_copy`` and ``_chunk_cat`` (its copy-in / copy-out), the same dispatch-level
  count on ours;
* peak memory per rank: the most heap bytes in use during any of 3 steps of a model built under
  :class:`~ragged_placement.testing.profiling.HeapPeakMeter`, above the heap in use before it was
  built (parameters, gradients, optimizer state, activations, communication buffers, whatever a
  runtime keeps across steps), max over ranks;
* step time: median over ``--steps`` timed steps of each of ``--runs`` alternating runs, then
  the median over runs.

The standard large-model recipe, applied the same way to both runtimes (torchtitan's order):
``--checkpoint`` wraps every block in ``checkpoint_wrapper`` (non-reentrant activation
checkpointing) before ``fully_shard``; ``--compile`` then compiles every block
(``block.compile(backend=--compile-backend)``, after ``fully_shard``). The warmup steps absorb the
compilation.

Run: ``.venv/bin/python benchmarks/fsdp_vs_fsdp2.py`` (``--help`` for the knobs).

``--device cpu|cuda`` runs both runtimes in one process instead, on Llama-3-8B-shaped blocks
(``--layers`` 4, ``--width`` 4096, ``--ffn`` 14336, ``--heads`` 32, ``--kv-heads`` 8, ``--seq``
4096, ``--batch`` 1; bf16 parameters, fp32 reduction), at world size ``--world`` through torch's
fake process group (collectives cost nothing; :mod:`_one_process`), and prints step time, the time
in copy kernels (torch profiler), peak memory and the bytes each rank would move::

    python benchmarks/fsdp_vs_fsdp2.py --device cuda --world 8 [--checkpoint] [--compile]
    python benchmarks/fsdp_vs_fsdp2.py --device cpu --world 8 --width 64 --ffn 128 --heads 4 \
        --kv-heads 2 --seq 32 --steps 2 --runs 1
    torchrun --nproc-per-node 1 benchmarks/fsdp_vs_fsdp2.py --device cuda --world 1
"""

from __future__ import annotations

import argparse
import sys

import torch

from ragged_placement.fsdp import MixedPrecisionPolicy, fully_shard
from ragged_placement.testing.launch import run_gloo

from _runtime_table import measure_runtime, print_runtime_table  # benchmarks/ is the script directory
from ragged_placement.models import GPT, GPTConfig, StdlibCorpus


def _shard(model: GPT, runtime: str, mesh, args) -> None:
    bf16 = args.bf16
    if runtime == "ours":
        kw = {"mp_policy": MixedPrecisionPolicy(torch.bfloat16, torch.float32)} if bf16 else {}
        wrap = fully_shard
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2Policy
        from torch.distributed.fsdp import fully_shard as wrap

        kw = {"mp_policy": FSDP2Policy(torch.bfloat16, torch.float32)} if bf16 else {}
    if args.checkpoint:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl,
            checkpoint_wrapper,
        )

        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    for block in model.layers:
        wrap(block, mesh=mesh, **kw)
        if args.compile:
            block.compile(backend=args.compile_backend)
    wrap(model, mesh=mesh, **kw)


def _trainer(rank: int, ws: int, runtime: str, args, cfg: GPTConfig, init: dict, corpus):
    """Builds the sharded model and its optimizer; returns ``step(i)``, one training step."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ws,))
    model = GPT(cfg)
    model.load_state_dict(init)
    _shard(model, runtime, mesh, args)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)
    per = args.batch

    def step(i: int) -> None:
        x, y = corpus.batch(i, per * ws, cfg.block_size)
        model(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]).backward()
        opt.step()
        opt.zero_grad()

    return step


def _measure(rank: int, ws: int, runtime: str, args, cfg: GPTConfig, init: dict, corpus) -> dict:
    return measure_runtime(
        lambda: _trainer(rank, ws, runtime, args, cfg, init, corpus), args.warmup, args.steps
    )


def _worker(rank: int, ws: int, args) -> dict:
    cfg = GPTConfig(
        n_layer=args.layers, n_embd=args.width, n_head=args.heads, block_size=args.seq
    )
    torch.manual_seed(0)
    init = GPT(cfg).state_dict()
    corpus = StdlibCorpus(max_bytes=1 << 20)
    results: dict[str, list[dict]] = {"fsdp2": [], "ours": []}
    for _ in range(args.runs):
        for runtime in ("fsdp2", "ours"):
            results[runtime].append(_measure(rank, ws, runtime, args, cfg, init, corpus))
    return results


# the size options' defaults: gloo ranks' GPT (no --device), one process's Llama-3-8B blocks
_DEFAULTS = {
    None: {"width": 128, "heads": 4, "seq": 64, "batch": 4},
    "device": {"width": 4096, "heads": 32, "seq": 4096, "batch": 1},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None,
                    help="one process on this device, fake process group for --world > 1 "
                         "(default: --world gloo ranks on the CPU, a GPT)")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=None, help="hidden size (128; --device: 4096)")
    ap.add_argument("--heads", type=int, default=None, help="attention heads (4; --device: 32)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (64; --device: 4096)")
    ap.add_argument("--batch", type=int, default=None,
                    help="sequences per rank per step (4; --device: 1)")
    ap.add_argument("--ffn", type=int, default=14336, help="--device: feed-forward size")
    ap.add_argument("--kv-heads", type=int, default=8, help="--device: key/value heads")
    ap.add_argument("--profile-steps", type=int, default=2,
                    help="--device: steps under the torch profiler")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--bf16", action="store_true", help="bf16 parameters, fp32 reduction (both)")
    ap.add_argument(
        "--checkpoint", action="store_true",
        help="activation checkpointing: checkpoint_wrapper (non-reentrant) on every block (both)",
    )
    ap.add_argument(
        "--compile", action="store_true",
        help="block.compile() on every block after fully_shard (both)",
    )
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend of --compile")
    args = ap.parse_args()
    for name, value in _DEFAULTS["device" if args.device else None].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.device is not None:
        from _one_process import run_one_process

        args.bf16 = True
        run_one_process(args, _shard)
        return
    per_rank = run_gloo(_worker, args.world, args)

    cfg = f"{args.layers} layers x {args.width} wide, seq {args.seq}, batch {args.batch}/rank"
    title = (
        f"FSDP runtimes on {args.world} gloo ranks (CPU), GPT {cfg}, "
        f"{'bf16 params / fp32 reduce' if args.bf16 else 'fp32'}"
        f"{', activation checkpointing' if args.checkpoint else ''}"
        f"{f', per-block compile ({args.compile_backend})' if args.compile else ''}, "
        f"torch {torch.__version__}, "
        f"{args.runs} runs x {args.steps} steps"
    )
    print_runtime_table(per_rank, title, "torch FSDP2", "ours")


if __name__ == "__main__":
    sys.exit(main())
