"""Muon and Shampoo on an HSDP mesh: one owner per matrix in the world vs one per replica row.

Spawns 4 gloo ranks as a ``(replicate, shard) = (2, 2)`` mesh; the parameters are the block
matrices of ``gpt2-124m`` (``--layers`` blocks, from ``ragged_placement/planner/models.json``), ``Shard(0)`` over
``shard`` and ``Replicate()`` over ``replicate`` (``--whole``: each matrix whole on one rank of
``shard``, alternating, as the planner's ``matrix`` granularity places them). Two paths step the
same parameters and gradients:

* ``per-matrix``: the path HSDP parameters took before (still the FSDP x TP path): each matrix
  is redistributed to an owner and back, one collective per matrix and direction, and every
  replica row runs every Newton-Schulz (Shampoo: every inverse root) itself;
* ``ours``: one owner per matrix in the world, one all-to-all each way inside each replica row
  and one all-gather over ``replicate`` (``optim/_sharding.py``).

Reported per step: collectives by kind (``CommDebugMode``), Newton-Schulz matrices (Shampoo:
inverse roots) per rank (a counting wrapper), bytes this rank sent (ours: ``MuonStepInfo``),
and the step time (slowest rank, median over ``--steps`` steps after one warm-up). The final
parameters of both paths are checked bitwise equal.

Run: ``.venv/bin/python benchmarks/optim_hsdp.py`` (``--help`` for the knobs).
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch
import torch.distributed as dist
from _gpt_shapes import MODELS_JSON, block_matrices  # benchmarks/ is the script directory
from ragged_placement.optim import Muon, Shampoo
from ragged_placement.optim import muon as muon_module
from ragged_placement.optim import shampoo as shampoo_module
from ragged_placement.planner.models import load_configs
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from ragged_placement import RaggedShard
from ragged_placement.testing.launch import run_gloo

MESH = (2, 2)  # (replicate, shard)


def _per_matrix(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, DTensor) and tensor.device_mesh.ndim > 1


def _run(optimizer: str, path: str, shapes, args) -> dict:
    """One path on this rank: counts and times per step, and the final parameters."""
    mesh = init_device_mesh("cpu", MESH)
    gen = torch.Generator().manual_seed(0)
    fulls = [0.02 * torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    placements = [
        [Replicate(), RaggedShard((0,), (1, 0) if i % 2 else (0, 1))] if args.whole
        else [Replicate(), Shard(0)]
        for i in range(len(shapes))
    ]
    params = [torch.nn.Parameter(distribute_tensor(f, mesh, pl)) for f, pl in zip(fulls, placements)]
    for p, g in zip(params, grads):
        p.grad = distribute_tensor(g, mesh, p.placements)
    opt = (
        Muon(params, lr=0.02)
        if optimizer == "muon"
        else Shampoo(params, lr=1e-3, max_preconditioner_dim=256, precondition_frequency=1)
    )
    math_calls = [0]

    def counting(fn):
        def wrapper(x, *a, **kw):
            math_calls[0] += x.shape[:-2].numel()
            return fn(x, *a, **kw)

        return wrapper

    routing = _per_matrix if path == "per-matrix" else muon_module.sharded_on_several_dims
    out = {"times": [], "comms": None, "math": None, "bytes": None}
    with mock.patch.object(muon_module, "sharded_on_several_dims", routing), \
            mock.patch.object(shampoo_module, "sharded_on_several_dims", routing), \
            mock.patch.object(muon_module, "newton_schulz", counting(muon_module.newton_schulz)), \
            mock.patch.object(shampoo_module, "matrix_power", counting(shampoo_module.matrix_power)):
        for step in range(args.steps + 1):
            math_calls[0] = 0
            dist.barrier()
            t0 = time.perf_counter()
            with CommDebugMode() as comm:
                opt.step()
            out["times"].append(time.perf_counter() - t0)
            if step == 0:
                out["comms"] = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}
                out["math"] = math_calls[0]
                if optimizer == "muon" and path == "ours":
                    out["bytes"] = opt.last_step_info.bytes_sent
    out["times"] = out["times"][1:]
    out["params"] = [p.full_tensor() for p in params]
    return out


def _worker(rank: int, ws: int, args, shapes) -> dict:
    torch.set_num_threads(1)
    return {
        (opt, path): _run(opt, path, shapes, args)
        for opt in args.optimizers
        for path in ("per-matrix", "ours")
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per path (after 1 warm-up)")
    ap.add_argument("--whole", action="store_true", help="each matrix whole on one shard rank")
    ap.add_argument("--optimizers", nargs="+", default=["muon", "shampoo"])
    ap.add_argument("--model", default="gpt2-124m")
    ap.add_argument("--models-json", default=MODELS_JSON)
    args = ap.parse_args()
    shapes = block_matrices(load_configs(args.models_json)[args.model], args.layers)
    ranks = run_gloo(_worker, 4, args, shapes)
    print(f"{args.model}, {len(shapes)} matrices, 2x2 HSDP gloo mesh"
          f"{', whole matrices' if args.whole else ', Shard(0)'}; per step:")
    print("| optimizer | path | collectives per rank | NS / roots per rank | bytes sent per rank "
          "| step s (median, slowest rank) |")
    print("|---|---|---|---|---|---|")
    for opt in args.optimizers:
        for path in ("per-matrix", "ours"):
            runs = [r[(opt, path)] for r in ranks]
            comms = sorted({tuple(sorted(r["comms"].items())) for r in runs})
            step_s = statistics.median(max(ts) for ts in zip(*(r["times"] for r in runs)))
            sent = [r["bytes"] for r in runs]
            print(f"| {opt} | {path} | {' / '.join(str(dict(c)) for c in comms)} "
                  f"| {[r['math'] for r in runs]} | {sent if sent[0] is not None else '-'} "
                  f"| {step_s:.3f} |")
        equal = all(
            torch.equal(a, b)
            for r in ranks
            for a, b in zip(r[(opt, "per-matrix")]["params"], r[(opt, "ours")]["params"])
        )
        print(f"{opt}: final parameters bitwise equal between the paths: {equal}")


if __name__ == "__main__":
    main()
