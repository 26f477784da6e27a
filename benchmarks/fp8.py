"""Bytes all-gathered and bytes of amax traffic per step for block-wise FP8 training.

For one FSDP unit of ``--layers-per-unit`` transformer layers (default 1) of every model in
shared/models.json and the world sizes given, three ways of all-gathering a unit whose Linear
weights train in 128x128-block FP8:

* ``ours``: the planner places every 2-D weight at 128-row granularity (RaggedShard), so each
  rank quantizes its own blocks with no communication; one all-gather moves the FP8 bytes, one
  fp32 scale per block and the other parameters (norms, biases, routers) in bf16, padded to
  equal per-rank sizes. The bytes are those of :class:`FP8GatherLayout` built on the real plan
  (what ``pack`` / ``unpack`` move, including alignment and padding). amax traffic: 0.
* ``fsdp2_bf16``: torch FSDP2's ``Shard(0)`` all-gather in bf16: every parameter's dim 0 padded
  to a multiple of the world size (FSDP2's per-parameter padding), 2 bytes per element.
* ``fsdp2_fp8_cut``: FSDP2's ``Shard(0)`` with FP8 weights: 1 byte per (padded) element, each
  rank's scales for the blocks it touches (equal-size all-gather, so padded to the largest
  rank), other parameters in bf16. A 128-row block band that a rank boundary ``r * ceil(m / W)``
  cuts needs a cross-rank amax before quantizing: ``amax B`` is the payload of that all-reduce
  (4 bytes per cut block, one extra collective per unit per step; a ring moves ~2x the payload
  per rank). Stacked ``[E, out, in]`` experts are sharded on ``E`` by ``Shard(0)``.

All byte counts are for the whole gathered unit (what every rank receives, its own chunk
included). ``ratio`` is against ``fsdp2_bf16`` (target for ours: <= 0.51). ``plan pad%`` is the
planner's padding of the flat buffer (the equal-size all-gather sends it), ``payload`` what ours
would send with no padding at all (FP8 + scales + bf16 others, over ``fsdp2_bf16``): the gap
between the two ratios is the planner's padding, not the FP8 format.

A CPU timing follows (medians of 5): quantizing a rank's chunk into the FP8 send buffer
(``FP8GatherLayout.pack``, torch reference) vs the bf16 cast FSDP's mixed precision does before
its all-gather, on the same chunk. GPU timings (Triton kernel GB/s vs copy bandwidth, FP8 vs bf16
Linear step time, torchao's FSDP2 + block-wise FP8 Linear) need a CUDA device and are not run here.

``--train-steps N`` also trains the small GPT of ``ragged_placement.models`` (2 layers, width
128) on the stdlib byte corpus for N AdamW steps in fp32, bf16 autocast and FP8 (CPU emulation of
the FP8 Linear), and prints the validation losses (one CPU thread; times are CPU emulation, not
FP8 speed).

Usage: python benchmarks/fp8.py [--models a,b] [--worlds 8,64,256] [--layers-per-unit 4]
       [--train-steps 200 --lr 1e-3]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch
from ragged_placement.planner import Granularity, plan
from ragged_placement.planner.models import fsdp_units, load_configs

from ragged_placement.quant import FlatParam, FP8GatherLayout

MODELS_JSON = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "models.json")
BLOCK = 128
_BLOCK_G, _ELEMENT_G = Granularity.block(BLOCK, BLOCK), Granularity.element()


def is_fp8(name: str, shape: tuple[int, ...]) -> bool:
    """Linear weights train in FP8; norms, biases and MoE routers stay in high precision."""
    return len(shape) >= 2 and not name.endswith("mlp.gate.weight")


def policy(name: str, shape: tuple[int, ...]) -> Granularity:
    return _BLOCK_G if len(shape) >= 2 else _ELEMENT_G


def as_2d(shape: tuple[int, ...]) -> tuple[int, int]:
    """A stacked ``[E, out, in]`` tensor as ``[E * out, in]`` (blocks never straddle experts
    when ``out % 128 == 0``, which holds for every model here; checked)."""
    if len(shape) == 3:
        if shape[1] % BLOCK:
            raise ValueError(
                f"stacked experts {shape}: out={shape[1]} is not a multiple of {BLOCK}"
            )
        return (shape[0] * shape[1], shape[2])
    return shape  # type: ignore[return-value]


def ours(params: list[tuple[str, tuple[int, ...]]], world: int) -> tuple[FP8GatherLayout, float]:
    """The FP8 gather layout on the planner's 128-row-granularity plan, and the plan's padding."""
    p = plan(params, world, granularity=policy, dtype=torch.float32)
    flat = [
        FlatParam(n, as_2d(s) if is_fp8(n, s) else s, p.offsets[n], is_fp8(n, s)) for n, s in params
    ]
    layout = FP8GatherLayout(
        flat, p.chunk_numel, world, block=(BLOCK, BLOCK), raw_dtype=torch.bfloat16
    )
    return layout, p.padding_fraction


def fsdp2_bf16(params: list[tuple[str, tuple[int, ...]]], world: int) -> int:
    return sum(2 * math.ceil(s[0] / world) * world * math.prod(s[1:]) for _, s in params)


def fsdp2_fp8_cut(params: list[tuple[str, tuple[int, ...]]], world: int) -> tuple[int, int]:
    """(all-gather bytes, amax all-reduce payload bytes) of Shard(0) FP8 with cut blocks."""
    data = 0
    scale_per_rank = [0] * world
    cut_blocks = 0
    for name, s in params:
        c = math.ceil(s[0] / world)  # rows (dim-0 slices) per rank, FSDP2's Shard(0)
        if not is_fp8(name, s):
            data += 2 * c * world * math.prod(s[1:])
            continue
        data += c * world * math.prod(s[1:])
        if len(s) == 3:  # Shard(0) on experts: whole experts per rank, no block is cut
            e, m, n = s
            per_expert = math.ceil(m / BLOCK) * math.ceil(n / BLOCK)
            for r in range(world):
                scale_per_rank[r] += 4 * per_expert * max(0, min((r + 1) * c, e) - r * c)
            continue
        m, n = s
        nb = math.ceil(n / BLOCK)
        cut_bands = set()
        for r in range(world):
            lo, hi = r * c, min((r + 1) * c, m)
            if lo >= hi:
                continue
            scale_per_rank[r] += 4 * nb * ((hi - 1) // BLOCK - lo // BLOCK + 1)
            if lo % BLOCK:
                cut_bands.add(lo // BLOCK)
        cut_blocks += len(cut_bands) * nb
    return data + world * max(scale_per_rank), 4 * cut_blocks


def representative_layers(
    name: str, cfg: dict, layers_per_unit: int = 1
) -> list[tuple[str, list[tuple[str, tuple[int, ...]]]]]:
    """The first ``layers_per_unit`` transformer layers as one unit (and, for DeepSeek-V3, the
    last ones too: its first layers are dense, the rest MoE)."""
    units = fsdp_units(name, cfg, stacked_experts=True)
    layers = [u for u in units if u[0].startswith("layers.")]
    groups = [layers[:layers_per_unit]]
    if name.startswith("deepseek"):
        groups.append(layers[-layers_per_unit:])
    out = []
    for g in groups:
        label = g[0][0] if len(g) == 1 else f"{g[0][0]}-{g[-1][0].split('.')[-1]}"
        out.append((f"{name}/{label}", [(n, tuple(s)) for _, p in g for n, s in p]))
    return out


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


def byte_table(models: dict, worlds: list[int], layers_per_unit: int) -> None:
    hdr = (
        f"{'unit':<32}{'W':>5}  {'fsdp2_bf16':>11}  {'ours':>11} {'ratio':>6} {'amax B':>6} "
        f"{'plan pad%':>9} {'payload':>7}  {'fsdp2_fp8_cut':>13} {'ratio':>6} {'cut blk':>8} "
        f"{'amax B':>9}"
    )
    print(hdr)
    print("-" * len(hdr))
    for model, cfg in models.items():
        for unit, params in representative_layers(model, cfg, layers_per_unit):
            for w in worlds:
                b = fsdp2_bf16(params, w)
                layout, plan_pad = ours(params, w)
                a = layout.gathered_nbytes
                payload = layout.fp8_nbytes + layout.scale_nbytes + layout.raw_nbytes
                c, amax_c = fsdp2_fp8_cut(params, w)
                print(
                    f"{unit:<32}{w:>5}  {fmt_bytes(b):>11}  {fmt_bytes(a):>11} {a / b:>6.3f} "
                    f"{0:>6} "
                    f"{100 * plan_pad:>9.2f} {payload / b:>7.3f}  {fmt_bytes(c):>13} {c / b:>6.3f} "
                    f"{amax_c // 4:>8,} {amax_c:>9,}"
                )


def cpu_timing(models: dict, world: int = 64, reps: int = 5) -> None:
    model = "llama-3.1-8b" if "llama-3.1-8b" in models else next(iter(models))
    unit, params = representative_layers(model, models[model])[0]
    layout, _ = ours(params, world)
    chunk = torch.randn(layout.chunk_numel)
    send = torch.empty(layout.send_nbytes, dtype=torch.uint8)
    bf16 = torch.empty(layout.chunk_numel, dtype=torch.bfloat16)

    def med(fn) -> float:
        fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    t_pack = med(lambda: layout.pack(0, chunk, send, kernel="torch"))
    t_cast = med(lambda: bf16.copy_(chunk))
    print(
        f"\nCPU ({torch.get_num_threads()} threads), {unit} at W={world}: rank chunk "
        f"{layout.chunk_numel:,} fp32 elements"
    )
    print(
        f"  FP8 pack (quantize into send buffer, torch ref): {1e3 * t_pack:8.2f} ms  "
        f"-> sends {fmt_bytes(layout.send_nbytes)}"
    )
    print(
        f"  bf16 cast (FSDP mixed-precision all-gather input): {1e3 * t_cast:6.2f} ms  "
        f"-> sends {fmt_bytes(2 * layout.chunk_numel)}"
    )
    print(
        f"  pack / cast time: {t_pack / t_cast:.1f}x (medians of {reps}); "
        f"send bytes ratio {layout.send_nbytes / (2 * layout.chunk_numel):.3f}"
    )


def train_gpt(mode: str, steps: int, lr: float) -> tuple[float, float]:
    """Validation loss and median step time of the small GPT trained ``steps`` steps in ``mode``."""
    from ragged_placement.models import GPT, GPTConfig, StdlibCorpus
    from ragged_placement.quant import convert_to_fp8_linear

    corpus = StdlibCorpus(max_bytes=1 << 20)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=128))
    if mode == "fp8":
        convert_to_fp8_linear(model.layers)  # embeddings, norms and the tied head stay fp32
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    times = []
    for step in range(steps):
        x, y = corpus.batch(step, 16, 64)
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16"):
            loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    with torch.no_grad():
        val = [model(*corpus.batch(10_000 + i, 32, 64, split="val")).item() for i in range(8)]
    return sum(val) / len(val), statistics.median(times)


def train_table(steps: int, lr: float) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = {mode: train_gpt(mode, steps, lr) for mode in ("fp32", "bf16", "fp8")}
    finally:
        torch.set_num_threads(threads)
    print(f"\nGPT (2 layers, width 128), {steps} steps, AdamW lr {lr}, batch 16x64, 1 CPU thread")
    for mode, (val, t) in results.items():
        rel = (val - results["bf16"][0]) / results["bf16"][0]
        print(
            f"  {mode:<5} val loss {val:.4f}  ({100 * rel:+.2f}% vs bf16)  step {1e3 * t:6.1f} ms"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="", help="comma-separated subset of models.json")
    ap.add_argument("--worlds", default="8,64,256")
    ap.add_argument("--models-json", default=MODELS_JSON)
    ap.add_argument(
        "--layers-per-unit", type=int, default=1, help="transformer layers per FSDP unit"
    )
    ap.add_argument("--train-steps", type=int, default=0, help="also train the small GPT")
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()
    models = load_configs(args.models_json)
    if args.models:
        models = {k: models[k] for k in args.models.split(",")}
    worlds = [int(w) for w in args.worlds.split(",")]
    byte_table(models, worlds, args.layers_per_unit)
    cpu_timing(models)
    if args.train_steps:
        train_table(args.train_steps, args.lr)


if __name__ == "__main__":
    main()
