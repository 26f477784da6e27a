"""FSDP x TP on a (dp, tp) mesh: our ``fully_shard`` vs torch FSDP2's, after the same TP plan.

Spawns ``dp * tp`` gloo ranks on this machine (CPU). Both runs build the same Llama-like model
(:mod:`ragged_placement.models.llama`), apply torchtitan's tensor-parallel plan on ``mesh["tp"]``
(``parallelize_llama``), then ``fully_shard`` every block and the root on ``mesh["dp"]``: ours or
torch's. Training: AdamW(foreach) on the DTensor parameters. No ``clip_grad_norm_``: under
FSDP2 the parameters TP leaves plain (the RMSNorm weights) are DTensors on the 1-D dp mesh, the
others on the (dp, tp) mesh, and torch's ``clip_grad_norm_`` cannot stack norms across meshes
(ours puts them on the (dp, tp) mesh with ``Replicate()`` on tp; tests/compose/test_compose.py clips).
The instruments are :mod:`ragged_placement.testing.profiling`, the same for both:

* FSDP collectives per step and their bytes (all-gather outputs, reduce-scatter inputs); the
  tensor-parallel collectives are the same in both runs and are not counted;
* layout-copy bytes per step (FSDP2's copy-in / copy-out ops, the same count on ours);
* peak memory per rank: the most heap bytes in use during any of 3 steps of a model built under
  :class:`~ragged_placement.testing.profiling.HeapPeakMeter`, above the heap in use before it was
  built (parameters, gradients, optimizer state, activations, communication buffers, whatever a
  runtime keeps across steps), max over ranks;
* step time: median over ``--steps`` steps of each of ``--runs`` alternating runs, then the
  median over runs; and the losses of both runs side by side (they must agree).

Run: ``.venv/bin/python benchmarks/compose.py`` (``--help`` for the knobs).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from ragged_placement.fsdp import fully_shard
from ragged_placement.testing.launch import run_gloo

from _runtime_table import measure_runtime, print_runtime_table  # benchmarks/ is the script directory
from ragged_placement.models.llama import Llama, LlamaConfig
from ragged_placement.parallelize import parallelize_llama


def _build(runtime: str, mesh, cfg: LlamaConfig, init: dict) -> Llama:
    model = Llama(cfg)
    model.load_state_dict(init)
    parallelize_llama(model, mesh["tp"])
    if runtime == "ours":
        wrap = fully_shard
    else:
        from torch.distributed.fsdp import fully_shard as wrap
    for block in model.layers.values():
        wrap(block, mesh=mesh["dp"])
    wrap(model, mesh=mesh["dp"])
    return model


def _trainer(runtime: str, mesh, args, cfg: LlamaConfig, init: dict, losses: list[float]):
    """Builds the parallelized model and its optimizer; returns ``step(i)``, one training step
    that appends its loss to ``losses``."""
    model = _build(runtime, mesh, cfg, init)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    d, per = mesh["dp"].get_local_rank(), args.batch
    gen = torch.Generator().manual_seed(0)
    data = [
        torch.randint(0, cfg.vocab_size, (per * args.dp, args.seq + 1), generator=gen)
        for _ in range(8)
    ]

    def step(i: int) -> None:
        b = data[i % len(data)][d * per : (d + 1) * per]
        loss = F.cross_entropy(model(b[:, :-1]).reshape(-1, cfg.vocab_size), b[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())

    return step


def _measure(runtime: str, mesh, args, cfg: LlamaConfig, init: dict) -> dict:
    losses: list[float] = []
    out = measure_runtime(
        lambda: _trainer(runtime, mesh, args, cfg, init, losses), args.warmup, args.steps
    )
    out["losses"] = losses[: args.warmup + args.steps]  # the trained steps, before the meters
    return out


def _worker(rank: int, ws: int, args) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        dim=args.width,
        n_layers=args.layers,
        n_heads=args.heads,
        hidden_dim=args.hidden,
    )
    torch.manual_seed(0)
    init = Llama(cfg).state_dict()
    results: dict[str, list[dict]] = {"fsdp2": [], "ours": []}
    for _ in range(args.runs):
        for runtime in ("fsdp2", "ours"):
            results[runtime].append(_measure(runtime, mesh, args, cfg, init))
    return results



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=688)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4, help="sequences per dp rank per step")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    ws = args.dp * args.tp
    per_rank = run_gloo(_worker, ws, args)

    model = (
        f"Llama {args.layers} layers x {args.width} wide (SwiGLU {args.hidden}, vocab "
        f"{args.vocab}), seq {args.seq}, batch {args.batch}/dp rank"
    )
    title = (
        f"FSDP x TP on a (dp={args.dp}, tp={args.tp}) gloo mesh (CPU), {model}, fp32, "
        f"torch {torch.__version__}, {args.runs} runs x {args.steps} steps"
    )
    print_runtime_table(per_rank, title, "FSDP2 + TP", "ours + TP", collective="FSDP ")
    la, lb = per_rank[0]["fsdp2"][0]["losses"], per_rank[0]["ours"][0]["losses"]
    print(
        f"rank-0 losses, max |ours - FSDP2| over {len(la)} steps: "
        f"{max(abs(x - y) for x, y in zip(la, lb)):.2e}"
    )


if __name__ == "__main__":
    sys.exit(main())
