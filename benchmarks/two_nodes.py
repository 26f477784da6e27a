"""Two emulated nodes x 2 ranks over a 1 Gbit/s link: ours (the partitioner's choice, ZeRO-3,
HSDP) and torch FSDP2 (full shard, HSDP).

Each configuration is one ``scripts/two_nodes.sh`` job (two network namespaces joined by a
tbf-shaped veth pair, ``--queue`` of buffer, ``torchrun`` with c10d rendezvous in each) of
``python -m ragged_placement.train`` on a GPT of ~11 M parameters, repeated ``--runs`` times;
the table gives

* tokens/s: the trainer's (timed steps: all but the first and the measured last), median over
  runs (the rows' runs interleaved: run i of every row before run i + 1 of any);
* bytes per link class, per step: what the node's network interfaces sent during the training
  loop (``/sys/class/net/*/statistics/tx_bytes`` inside each namespace; ``lo``: inside a node,
  the veth: across), summed over both nodes, from the first run;
* communication seconds per step, predicted and measured. Predicted: ``plan_state_sharding``'s
  ``comm_seconds`` (summed over mesh dims) for the row's sharding, from the partitioner run
  (``--state-sharding auto`` with ``--bandwidth``, default ``profile``: the bandwidth and
  latency of each group of mesh dims measured on the emulated link by
  ``planner.profile.profile_mesh`` inside the job); zero3 and FSDP2 full shard are
  ``P(inter,intra) G(inter,intra) OS(inter,intra)``, HSDP ``P(intra) G(intra) OS(intra)``, both
  with ``reshard_after_forward=True``; the FSDP2 rows count the reduce-scatters twice (torch's
  gloo reduce-scatter is an all-reduce, see ``_predicted``). Measured: the trainer's ``comm_seconds``, the wall time a
  rank spends inside a collective call or a wait on an asynchronous one per timed step (what it
  was blocked on, waiting for slower ranks included; overlapped communication is not counted),
  mean over ranks, median over runs; and the link's busy time: the bytes the busier node sent
  across per step over ``--rate`` (a lower bound of the time the step's traffic needs), first
  run;
* memory per rank, split by state: local parameter (the optimizer shard plus the parameter chunk
  a ``state_sharding`` keeps), gradient and optimizer-state bytes, and the heap peak of the
  measured step above the heap before the model was built (everything: states, activations,
  buffers), max over ranks.

Then each target of issue 27 §5, met or not. Needs root (network namespaces).
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
MESH_2X2 = ["--mesh", "2x2", "--mesh-dim-names", "inter,intra"]
AUTO = "ours, the partitioner's choice"
FULL, HSDP = "torch FSDP2 full shard", "torch FSDP2 HSDP"
# The planner's candidate of each fixed configuration (sharding, reshard_after_forward)
ZERO3 = ("P(inter,intra) G(inter,intra) OS(inter,intra)", True)
HSDP_POINT = ("P(intra) G(intra) OS(intra)", True)
CONFIGS = [
    (AUTO, ["--runtime", "ours", "--state-sharding", "auto", *MESH_2X2]),
    ("ours zero3", ["--runtime", "ours", "--state-sharding", "zero3", "--mesh", "4"]),
    ("ours hsdp", ["--runtime", "ours", "--state-sharding", "hsdp", *MESH_2X2]),
    (FULL, ["--runtime", "fsdp2", "--state-sharding", "zero3", "--mesh", "4"]),
    (HSDP, ["--runtime", "fsdp2", "--state-sharding", "hsdp", *MESH_2X2]),
]
# --only's names of the rows
ROW_NAMES = dict(zip(("auto", "zero3", "hsdp", "fsdp2-full", "fsdp2-hsdp"),
                     (label for label, _ in CONFIGS)))
POINTS = {"ours zero3": ZERO3, "ours hsdp": HSDP_POINT, FULL: ZERO3, HSDP: HSDP_POINT}
MiB = 2.0**20


def _job(args: argparse.Namespace, config: list[str], metrics: str) -> dict:
    cmd = ["bash", "scripts/two_nodes.sh", "--rate", args.rate, "--queue", args.queue, "--",
           "--layers", str(args.layers), "--width", str(args.width), "--heads", str(args.heads),
           "--seq", str(args.seq), "--batch", str(args.batch), "--steps", str(args.steps), "--log-every", str(args.steps),
           *config, *(["--bandwidth", args.bandwidth] if "auto" in config else []),
           "--metrics", metrics]
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


def _rate(text: str) -> float:
    """tc's rate (``1gbit``, ``500mbit``) in bytes/s."""
    for unit, scale in (("kbit", 1e3), ("mbit", 1e6), ("gbit", 1e9), ("bit", 1.0)):
        if text.endswith(unit):
            return float(text[:-len(unit)]) * scale / 8
    raise ValueError(f"--rate must be N[k|m|g]bit, got {text!r}")


def _link_seconds(metrics: dict, steps: int, rate: float) -> float:
    """Seconds per step the busier direction of the link sends: its node's bytes across / rate."""
    across = [sum(b for iface, b in r["net_bytes"].items() if iface != "lo")
              for r in metrics["per_rank"] if r["net_bytes"]]
    return max(across) / steps / rate


def _predicted(label: str, auto: dict) -> float:
    """Predicted communication seconds per step of ``label``'s sharding, from the partitioner
    run's candidates. Torch FSDP2 on gloo reduce-scatters with gloo's own, an all-reduce of the
    whole input: twice the bytes and the ring steps of the model's reduce-scatter (ours runs it
    as an all-to-all, the model's bytes), so its rows count each reduce-scatter twice."""
    plan = auto["state_sharding"]
    point = (plan["choice"], plan["reshard_after_forward"]) if label == AUTO else POINTS[label]
    for c in plan["candidates"]:
        if (c["sharding"], c["reshard_after_forward"]) == point:
            seconds = sum(c["comm_seconds"].values())
            if label in (FULL, HSDP):
                seconds += sum(k["seconds"] for k in c["collectives"] if k["op"] == "reduce_scatter")
            return seconds
    raise ValueError(f"no candidate {point} in the partitioner's table")


def _summary(label: str, runs: list[dict], args: argparse.Namespace, auto: dict) -> dict:
    steps = args.steps
    ranks = runs[0]["per_rank"]
    inside, across = _link_bytes(runs[0], steps)
    return {
        "label": label,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
        "inside": inside / MiB, "across": across / MiB,
        "predicted": _predicted(label, auto),
        "measured": statistics.median(statistics.mean(p["comm_seconds"] for p in r["per_rank"])
                                      for r in runs),
        "link": _link_seconds(runs[0], steps, _rate(args.rate)),
        **{k: max(r["state_bytes"][k] for r in ranks) for k in ("params", "grads", "optimizer")},
        "peak": max(r["peak"] for r in ranks) / MiB,
    }


def _row(r: dict) -> str:
    return (f"| {r['label']} | {r['tokens_per_s']:,.0f} | {r['inside']:.2f} | {r['across']:.2f} | "
            f"{r['predicted']:.3f} | {r['measured']:.3f} | {r['link']:.3f} | "
            + " | ".join(f"{r[k] / MiB:.2f}" for k in ("params", "grads", "optimizer"))
            + f" | {r['peak']:.1f} |")


def _targets(rows: dict[str, dict]) -> list[str]:
    """Issue 27 §5's targets for the partitioner's choice, each met or not."""
    def met(ok: bool) -> str:
        return "met" if ok else "NOT met"

    lines = []
    # (peer, its row, tokens/s target, optimizer-state bound as a fraction of the peer's)
    for name, label, speed, memory_share in (("FSDP2 full shard", FULL, 1.5, 1.05),
                                             ("FSDP2 HSDP", HSDP, 0.95, 0.5)):
        if AUTO not in rows or label not in rows:
            continue  # --only left a row out
        a, ref = rows[AUTO], rows[label]
        memory_bound = memory_share * ref["optimizer"]
        ratio = a["tokens_per_s"] / ref["tokens_per_s"]
        lines.append(f"- vs {name}: tokens/s {ratio:.2f}x (target >= {speed}x: "
                     f"{met(ratio >= speed)}); optimizer state {a['optimizer']:,} bytes per rank "
                     f"(target <= {memory_bound:,.0f}: {met(a['optimizer'] <= memory_bound)}, "
                     f"{a['optimizer'] - memory_bound:+,.0f} bytes)")
    for r in rows.values():
        err, link = r["predicted"] / r["measured"] - 1, r["predicted"] / r["link"] - 1
        lines.append(f"- {r['label']}: predicted communication {r['predicted']:.3f} s/step, "
                     f"measured {r['measured']:.3f} s/step ({err:+.0%}; target within 25%: "
                     f"{met(abs(err) <= 0.25)}); link busy {r['link']:.3f} s/step ({link:+.0%})")
    return lines


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
    ap.add_argument("--queue", default="10ms",
                    help="the link's queue, as the time a packet may wait before it is dropped "
                         "(tbf latency; scripts/two_nodes.sh --queue)")
    ap.add_argument("--bandwidth", default="profile",
                    help="the partitioner's bytes/s per mesh dim (inter=...,intra=...) or profile")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per job (hang guard)")
    ap.add_argument("--only", nargs="+", choices=list(ROW_NAMES), default=list(ROW_NAMES),
                    help="the rows to run (default: all; 'auto' is needed for the predictions)")
    args = ap.parse_args()
    if "auto" not in args.only:
        ap.error("--only must include 'auto': its partitioner run predicts every row")
    chosen_rows = {ROW_NAMES[name] for name in args.only}
    configs = [(label, config) for label, config in CONFIGS if label in chosen_rows]
    params = 12 * args.layers * args.width**2 + (256 + args.seq) * args.width
    print(f"GPT {args.layers} x {args.width} (~{params / 1e6:.1f} M parameters), seq {args.seq}, "
          f"batch {args.batch} per rank, fp32, AdamW; 2 nodes x 2 ranks, link {args.rate} "
          f"(queue {args.queue}); "
          f"{args.steps} steps, {args.runs} runs per row")
    print("\n| run | tokens/s | MiB/step inside nodes | MiB/step across | predicted comm s/step "
          "| measured comm s/step | link busy s/step | params MiB | grads MiB | optimizer MiB | peak MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    tmp = tempfile.mkdtemp(prefix="two_nodes_")  # kept when a job fails: its log is there
    # run i of every row before run i + 1 of any: a machine whose load changes during the
    # benchmark slows every row alike
    runs: dict[str, list[dict]] = {label: [] for label, _ in configs}
    for i in range(args.runs):
        for label, config in configs:
            runs[label].append(_job(args, config, f"{tmp}/{label}-{i}.json"))
    auto = runs[AUTO][0]  # the partitioner's first run: its plan predicts every row
    chosen = {r["state_sharding"]["choice"] for r in runs[AUTO]}
    rows = {label: _summary(label, runs[label], args, auto) for label, _ in configs}
    print("\n".join(_row(r) for r in rows.values()))
    if len(chosen) > 1:  # a profile that differs between runs
        print(f"(the partitioner's runs chose differently: {sorted(chosen)})")
    plan = auto["state_sharding"]
    print(f"\nThe partitioner chose {plan['choice']}, reshard_after_forward="
          f"{plan['reshard_after_forward']}; bandwidth "
          + ", ".join(f"{d} {b:.4g} B/s" for d, b in plan["bandwidth"].items())
          + ", latency " + ", ".join(f"{d} {t:.3g} s" for d, t in plan["latency"].items()))
    print("\n".join(["Targets (issue 27 §5):", *_targets(rows)]))
    shutil.rmtree(tmp)

if __name__ == "__main__":
    main()
