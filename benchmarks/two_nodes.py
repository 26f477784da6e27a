"""Two emulated nodes x 2 ranks over a 1 Gbit/s link: ours and torch FSDP2, ZeRO-3 and HSDP.

Each configuration is one ``scripts/two_nodes.sh`` job (two network namespaces joined by a
tbf-shaped veth pair, ``torchrun`` with c10d rendezvous in each) of
``python -m ragged_placement.train`` on a GPT of ~11 M parameters, repeated ``--runs`` times;
the table gives

* tokens/s: the trainer's (timed steps: all but the first and the measured last), median over
  runs;
* bytes per link class, per step: what the node's network interfaces sent during the training
  loop (``/sys/class/net/*/statistics/tx_bytes`` inside each namespace; ``lo``: inside a node,
  the veth: across), summed over both nodes, from the first run;
* peak memory per rank, split by state: local parameter, gradient and optimizer-state bytes, and
  the heap peak of the measured step above the heap before the model was built (everything:
  states, activations, buffers), max over ranks.

``ours, the partitioner's choice`` (per-state sharding, ``--state-sharding auto``) needs the
StateSharding runtime of issue 25; its row is printed as a gap. Needs root (network namespaces).
Run: ``.venv/bin/python benchmarks/two_nodes.py`` (``--help`` for the knobs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = [
    ("ours, the partitioner's choice", None),
    ("ours zero3", ["--runtime", "ours", "--state-sharding", "zero3", "--mesh", "4"]),
    ("ours hsdp", ["--runtime", "ours", "--state-sharding", "hsdp", "--mesh", "2x2",
                           "--mesh-dim-names", "inter,intra"]),
    ("torch FSDP2 full shard", ["--runtime", "fsdp2", "--state-sharding", "zero3", "--mesh", "4"]),
    ("torch FSDP2 HSDP", ["--runtime", "fsdp2", "--state-sharding", "hsdp", "--mesh", "2x2",
                           "--mesh-dim-names", "inter,intra"]),
]
MiB = 2.0**20


def _job(args: argparse.Namespace, config: list[str], metrics: str) -> dict:
    cmd = ["bash", "scripts/two_nodes.sh", "--rate", args.rate, "--", "--layers", str(args.layers),
           "--width", str(args.width), "--heads", str(args.heads), "--seq", str(args.seq),
           "--batch", str(args.batch), "--steps", str(args.steps), "--log-every", str(args.steps),
           *config, "--metrics", metrics]
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=args.timeout, check=False)
    if proc.returncode:
        log = Path(metrics).with_suffix(".log")
        log.write_text(proc.stdout + proc.stderr)
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}); its output: {log}")
    return json.loads(Path(metrics).read_text())


def _link_bytes(metrics: dict, steps: int) -> tuple[float, float]:
    inside = across = 0
    for rank in metrics["per_rank"]:
        for iface, sent in rank["net_bytes"].items():
            if iface == "lo":
                inside += sent
            else:
                across += sent
    return inside / steps, across / steps


def _row(label: str, runs: list[dict], steps: int) -> str:
    tps = statistics.median(r["tokens_per_s"] for r in runs)
    inside, across = _link_bytes(runs[0], steps)
    ranks = runs[0]["per_rank"]
    states = [max(r["state_bytes"][k] for r in ranks) / MiB for k in ("params", "grads", "optimizer")]
    peak = max(r["peak"] for r in ranks) / MiB
    return (f"| {label} | {tps:,.0f} | {inside / MiB:.2f} | {across / MiB:.2f} | "
            + " | ".join(f"{s:.2f}" for s in states) + f" | {peak:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    ap.add_argument("--rate", default="1gbit", help="the link's rate (tc tbf)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per job (hang guard)")
    args = ap.parse_args()
    params = 12 * args.layers * args.width**2 + (256 + args.seq) * args.width
    print(f"GPT {args.layers} x {args.width} (~{params / 1e6:.1f} M parameters), seq {args.seq}, "
          f"batch {args.batch} per rank, fp32, AdamW; 2 nodes x 2 ranks, link {args.rate}; "
          f"{args.steps} steps, {args.runs} runs per row")
    print("\n| run | tokens/s | MiB/step inside nodes | MiB/step across | params MiB | grads MiB "
          "| optimizer MiB | peak MiB |")
    print("|---|---|---|---|---|---|---|---|")
    tmp = tempfile.mkdtemp(prefix="two_nodes_")  # kept when a job fails: its log is there
    for label, config in CONFIGS:
        if config is None:
            print(f"| {label} | - | - | - | - | - | - | - |  (needs issue 25's StateSharding)")
            continue
        runs = [_job(args, config, f"{tmp}/{i}.json") for i in range(args.runs)]
        print(_row(label, runs, args.steps), flush=True)
    shutil.rmtree(tmp)

if __name__ == "__main__":
    main()
