"""Bytes a rank allocates for meta-device initialization: our ``fully_shard`` vs torch FSDP2's.

Both runs build a GPT under ``torch.device("meta")``, ``fully_shard`` every block and the root,
then ``model.to_empty(device="cpu")``, on ``--world`` threaded ranks. A dispatch mode records the
storage of every tensor an op returns that none of its inputs holds (a DTensor counts its local
tensor). Printed per phase: the bytes allocated in all (transient ones included) and the largest
single allocation, and the parameter bytes a rank keeps; next to the full model's bytes. Counts,
not timings: they do not depend on the machine.

Run: ``.venv/bin/python benchmarks/meta_init.py`` (``--help`` for the knobs).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from dist_utils import run_threaded  # noqa: E402

from ragged_placement.fsdp import fully_shard  # noqa: E402
from ragged_placement.testing.profiling import AllocationMeter  # noqa: E402
from ragged_placement.models import GPT, GPTConfig  # noqa: E402


def _measure(rank: int, ws: int, runtime: str, cfg: GPTConfig) -> tuple[int, ...]:
    mesh = DeviceMesh("cpu", list(range(ws)))
    with torch.device("meta"):
        m = GPT(cfg)
    shard = fully_shard if runtime == "ours" else fsdp2_fully_shard
    with AllocationMeter() as at_shard:
        for block in m.layers:
            shard(block, mesh=mesh)
        shard(m, mesh=mesh)
    with AllocationMeter() as at_materialize:
        m.to_empty(device="cpu")
    storages = {p._local_tensor.untyped_storage().data_ptr(): p for p in m.parameters()}
    kept = sum(p._local_tensor.untyped_storage().nbytes() for p in storages.values())
    return (
        sum(at_shard.nbytes),
        max(at_shard.nbytes, default=0),
        sum(at_materialize.nbytes),
        max(at_materialize.nbytes, default=0),
        kept,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    cfg = GPTConfig(n_layer=args.layers, n_embd=args.width, n_head=4, block_size=64)
    with torch.device("meta"):
        full = sum(p.numel() * p.element_size() for p in GPT(cfg).parameters())
    print(f"GPT n_layer={args.layers} n_embd={args.width}, {args.world} ranks; full model "
          f"{full / 2**20:.2f} MiB (fp32)")
    print("| runtime | fully_shard: allocated / largest | to_empty: allocated / largest | kept |")
    print("|---|---|---|---|")
    for runtime in ("ours", "fsdp2"):
        s_all, s_max, m_all, m_max, kept = run_threaded(_measure, args.world, runtime, cfg)[0]
        mib = lambda n: f"{n / 2**20:.2f} MiB"  # noqa: E731
        print(f"| {runtime} | {mib(s_all)} / {mib(s_max)} | {mib(m_all)} / {mib(m_max)} | "
              f"{mib(kept)} |")


if __name__ == "__main__":
    main()
