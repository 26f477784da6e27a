"""Instructions per forward + backward of ``benchmarks/host_overhead.py``'s model, counted by
valgrind's callgrind: a plain module, torch FSDP2 and ours on torch's fake process group.

Unlike the benchmark's CPU times, instruction counts do not move with other load on the machine,
so two revisions of the runtime compare exactly (a change of 1% shows). They do not weigh what
an instruction costs: memory-bound work (zero-filling, the fake backend's copies) takes more
time per instruction than the model's matrix products, so the time ratio is higher than this
one.

Each runtime runs in a process of its own under ``valgrind --tool=callgrind``, collecting only
inside ``functools.reduce`` (the C function the timed steps run in), after the model is built and
warmed up: ``--steps`` forward + backward + ``zero_grad()`` of the benchmark's ``Trainer`` with
AdamW (foreach; ``opt.step()`` is not run in the counted steps).

Run (valgrind installed; about 3 minutes per runtime at 48 blocks):
``.venv/bin/python scripts/host_instructions.py --depth 48 --runtimes plain ours``.
``--inner RUNTIME`` is the counted process itself (what the driver launches under valgrind).
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def inner(runtime: str, depth: int, steps: int) -> None:
    """Build ``runtime``'s model, warm it up, then run ``steps`` counted steps inside
    ``functools.reduce``."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import host_overhead
    from _one_process import one_process_world

    torch.set_num_threads(1)
    args = types.SimpleNamespace(depth_now=depth, dim=64, batch=4, seq=16, clock="cpu")
    with one_process_world("cpu", 8):
        trainer = host_overhead.Trainer(runtime, "adamw-foreach", args,
                                        init_device_mesh("cpu", (8,)))
        for _ in range(3):
            trainer.step(timed=False)

        def counted(acc, _):
            trainer.forward_backward()
            trainer.opt.zero_grad()
            return acc

        functools.reduce(counted, range(steps), None)


def count(runtime: str, depth: int, steps: int) -> int:
    """Instructions of ``steps`` counted steps of ``runtime`` (callgrind's ``Collected``)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            ["valgrind", "--tool=callgrind", "--collect-atstart=no",
             "--toggle-collect=*functools_reduce*", f"--callgrind-out-file={tmp}/cg.out",
             sys.executable, os.path.abspath(__file__), "--inner", runtime,
             "--depth", str(depth), "--steps", str(steps)],
            capture_output=True, text=True, check=True, cwd=ROOT,
        )
    found = re.search(r"Collected : (\d+)", out.stderr)
    if found is None:
        raise RuntimeError(f"callgrind reported no count for {runtime}:\n{out.stderr[-2000:]}")
    return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", type=int, default=48)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--runtimes", nargs="+", default=["plain", "fsdp2", "ours"],
                        choices=["plain", "fsdp2", "ours"])
    parser.add_argument("--inner", choices=["plain", "fsdp2", "ours"], default=None)
    args = parser.parse_args()
    if args.inner is not None:
        inner(args.inner, args.depth, args.steps)
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("scripts/host_instructions.py needs valgrind (callgrind) on PATH")
    per_step = {rt: count(rt, args.depth, args.steps) / args.steps for rt in args.runtimes}
    print(f"\nInstructions per forward + backward, {args.depth} blocks, fake world 8 "
          f"(callgrind, {args.steps} counted steps)\n")
    print("| runtime | instructions per step | vs plain |")
    print("|---|---|---|")
    for rt, n in per_step.items():
        ratio = f"{n / per_step['plain']:.3f}x" if "plain" in per_step else "-"
        print(f"| {rt} | {n / 1e6:,.1f} M | {ratio} |")


if __name__ == "__main__":
    main()
