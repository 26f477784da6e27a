"""torchtitan's own numbers, ours against torch FSDP2: tokens/s and memory from its step lines.

Every job is torchtitan's trainer, ``torchrun ... -m torchtitan.train --module integration_config
--config NAME`` (``tests/train/titan/integration_config.py``: the llama3 debug model, 6 layers,
dim 256, vocab 2048, fp32, AdamW, CPU/gloo with the harness's stand-ins), from one seed checkpoint
made by torchtitan itself; FSDP2 is torchtitan as it ships (``llama3_fsdp2``), ours is the same
config through ``ragged_placement.integrations.torchtitan.configure``. Rows:

* FSDP: 2 ranks, ``configure(config)`` against FSDP2;
* HSDP: 4 ranks, ``dp_replicate 2 x dp_shard 2``, ``configure(config)`` against FSDP2's HSDP;
* PP: 4 ranks, ``pp 2 x dp_shard 2``, schedule 1F1B, ``configure(config)`` against FSDP2;
* AMSP: 4 ranks on the HSDP mesh, ``configure(config, state_sharding="amsp")`` against FSDP2's
  HSDP.

Per job: tokens/s is the median of rank 0's step-line ``tps`` over the steps after the first
(torchtitan's tokens per second per rank); memory is rank 0's step-line ``memory`` at the last
step: on a GPU torch's peak reserved memory, on a CPU the stand-in's peak resident set size of
the process (torch's import included). Per row: medians over ``--runs`` (the runs interleaved:
run i of every row and runtime before run i + 1 of any, so a machine whose load changes slows
each alike), the ratios ours / FSDP2, and the machine-independent check that both trained the
same: the largest per-step |difference| of torchtitan's logged gradient norm (global on every
rank; with pipeline parallelism rank 0 holds the first stage and logs no loss) and of the loss.

``--two-nodes`` (root): the same jobs on two emulated nodes x 2 ranks (``scripts/two_nodes.sh``:
network namespaces over a shaped veth link, ``--rate``, ``--queue``): FSDP2's HSDP (replicated
across the link, sharded inside each node) against ours with the partitioner's choice
(``configure(config, state_sharding="auto")``, bandwidth profiled on the link in the job; its
choice is printed).

Run: ``.venv/bin/python benchmarks/titan.py [--two-nodes]`` (``--help`` for the knobs);
``make titan-bench`` runs both.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "train" / "titan"))

import titan_jobs  # noqa: E402  (the harness's job runner)

HSDP_2X2 = ("--parallelism.data_parallel_replicate_degree", "2",
            "--parallelism.data_parallel_shard_degree", "2")
PP_2X2 = ("--parallelism.pipeline_parallel_degree", "2",
          "--parallelism.data_parallel_shard_degree", "2",
          "--parallelism.pipeline_parallel_schedule", "1F1B")
# row: (ranks, FSDP2's config, ours, torchtitan options)
ROWS = {
    "FSDP": (2, "llama3_fsdp2", "llama3_ours", ()),
    "HSDP": (4, "llama3_fsdp2", "llama3_ours", HSDP_2X2),
    "PP": (4, "llama3_fsdp2", "llama3_ours", PP_2X2),
    "AMSP (FSDP2: HSDP)": (4, "llama3_fsdp2", "llama3_amsp", HSDP_2X2),
}
TWO_NODES = {"the partitioner's choice (FSDP2: HSDP)": (4, "llama3_fsdp2", "llama3_auto", HSDP_2X2)}
_CHOICE = re.compile(r"state_sharding='auto' chose (.*?), reshard_after_forward=(\w+)")


def _job_numbers(run: titan_jobs.Run) -> dict:
    timed = run.lines[1:] or run.lines
    return {"tps": statistics.median(line["tps"] for line in timed),
            "memory": run.lines[-1]["memory_gib"], "steps": run.steps,
            "choice": ", ".join(dict.fromkeys(" reshard_after_forward=".join(m)
                                              for m in _CHOICE.findall(run.log)))}


def _differences(a: list[dict], b: list[dict]) -> tuple[float | None, float]:
    """Largest per-step |loss| (None where rank 0 logs no loss: pipeline parallelism) and
    |grad-norm| differences."""
    diffs = titan_jobs.max_differences(a, b)
    logged = all(s["loss"] > 0 for s in a + b)
    return (diffs["loss"] if logged else None), diffs["grad_norm"]


def _measure(rows: dict, args: argparse.Namespace, launcher: list[str] | None) -> None:
    root = tempfile.mkdtemp(prefix="titan_bench_")  # kept when a job fails: its log is there
    work = titan_jobs.compare.make_workdir(root)
    options = ("--training.steps", str(args.steps), "--training.seq_len", str(args.seq),
               "--training.local_batch_size", str(args.batch))
    results: dict[str, dict[str, list[dict]]] = {r: {"torch": [], "ours": []} for r in rows}
    for i in range(args.runs):
        for row, (nproc, fsdp2, ours, extra) in rows.items():
            for runtime, config in (("torch", fsdp2), ("ours", ours)):
                dump = os.path.join(root, f"{row.split()[0]}_{runtime}_{i}")
                run = titan_jobs.run(nproc, config, dump, work, options + extra, seed=True,
                                     launcher=launcher)
                results[row][runtime].append(_job_numbers(run))
    print(f"\nllama3 debug model, fp32, seq {args.seq}, batch {args.batch} per data-parallel "
          f"rank, {args.steps} steps (tokens/s: the median over steps 2-{args.steps}), median of "
          f"{args.runs} run(s) per runtime, interleaved")
    print("\n| configuration | ranks | FSDP2 tokens/s | ours tokens/s | ours / FSDP2 | FSDP2 "
          "memory GiB | ours memory GiB | ours / FSDP2 | max abs loss diff | max abs grad-norm "
          "diff |\n|---|---|---|---|---|---|---|---|---|---|")
    for row, (nproc, *_rest) in rows.items():
        torch_runs, our_runs = results[row]["torch"], results[row]["ours"]
        tps = [statistics.median(r["tps"] for r in runs) for runs in (torch_runs, our_runs)]
        mem = [statistics.median(r["memory"] for r in runs) for runs in (torch_runs, our_runs)]
        loss, grad = _differences(torch_runs[0]["steps"], our_runs[0]["steps"])
        shown = "- (not on rank 0)" if loss is None else f"{loss:.1e}"
        print(f"| {row} | {nproc} | {tps[0]:,.0f} | {tps[1]:,.0f} | {tps[1] / tps[0]:.2f} "
              f"| {mem[0]:.2f} | {mem[1]:.2f} | {mem[1] / mem[0]:.2f} | {shown} | {grad:.1e} |")
    for row in rows:
        choices = {r["choice"] for r in results[row]["ours"] if r["choice"]}
        if choices:
            print(f"\n{row}: the partitioner chose {' / '.join(sorted(choices))}")
    shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="runs per runtime and row (median)")
    ap.add_argument("--steps", type=int, default=8, help="training steps per job (the first "
                                                         "is not timed)")
    ap.add_argument("--seq", type=int, default=128, help="sequence length")
    ap.add_argument("--batch", type=int, default=2, help="sequences per data-parallel rank")
    ap.add_argument("--two-nodes", action="store_true",
                    help="FSDP2 HSDP against the partitioner's choice on two emulated nodes "
                         "(scripts/two_nodes.sh; root)")
    ap.add_argument("--rate", default="1gbit", help="--two-nodes: the link's rate")
    ap.add_argument("--queue", default="10ms", help="--two-nodes: the link's queue")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be at least 2: the first step is not timed")
    if not args.two_nodes:
        _measure(ROWS, args, None)
        return
    if os.geteuid() != 0 or shutil.which("ip") is None:
        sys.exit("--two-nodes needs root and iproute2: scripts/two_nodes.sh creates network "
                 "namespaces")
    os.environ["PYTHON"] = sys.executable  # the interpreter two_nodes.sh runs in each node
    os.chdir(REPO)
    print(f"two emulated nodes x 2 ranks, link {args.rate} (queue {args.queue})")
    _measure(TWO_NODES, args, ["bash", "scripts/two_nodes.sh", "--rate", args.rate,
                               "--queue", args.queue, "--module", "torchtitan.train", "--"])


if __name__ == "__main__":
    main()
