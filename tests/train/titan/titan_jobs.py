"""One ``torchrun ... -m torchtitan.train --module integration_config --config NAME`` job and
what it left: rank 0's recorded steps, its fp64 full-gradient norms, its step lines (tokens/s,
memory) and the torchtitan attributes it changed. For ``tests/train/test_titan_integration.py``
and ``benchmarks/titan.py``; the configs are ``integration_config.py``'s.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import compare  # noqa: E402  (its hang-guarded process-group runner and seed checkpoints)

# torchtitan's step line: "step:  3  loss:  7.26958  grad_norm:  2.1593  memory:  0.52GiB(0.00%)
# tps: 268  tflops: 0.01  mfu: 0.00%" (colored; rank-prefixed under torchrun --tee)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*([-\d.e+naif]+)\s+grad_norm:\s*([-\d.e+naif]+)\s+"
                   r"memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)")


@dataclasses.dataclass
class Run:
    """A finished job: ``steps`` (rank 0's recorded ``{"step", "loss", "grad_norm"}``, with
    ``grad_norm_fp64`` when recorded), ``lines`` (rank 0's step lines: ``{"step", "tps",
    "memory_gib"}``), ``log`` (the job's output) and ``changed`` (torchtitan attributes changed
    after the stand-ins, when watched; else ``None``)."""

    steps: list[dict]
    lines: list[dict]
    log: str
    changed: list[str] | None


def step_lines(log: str) -> list[dict]:
    """The step lines of the first rank that logs them (torchtitan logs on every rank)."""
    out: dict[int, dict] = {}
    for line in _ANSI.sub("", log).splitlines():
        m = _STEP.search(line)
        if m and int(m.group(1)) not in out:
            out[int(m.group(1))] = {"step": int(m.group(1)), "memory_gib": float(m.group(4)),
                                    "tps": int(m.group(5).replace(",", ""))}
    return [out[k] for k in sorted(out)]


def run(nproc: int, config: str, dump: str, work: compare.Workdir, options: tuple[str, ...] = (),
        *, exact_norms: bool = False, watch_attributes: bool = False, seed: bool = False,
        launcher: list[str] | None = None, module: str = "integration_config") -> Run:
    """Run ``config`` of ``integration_config`` on ``nproc`` ranks (CPU, gloo) under
    ``dump``; ``seed``: from ``work``'s llama3 seed checkpoint (``compare.make_workdir``).
    ``launcher`` replaces ``torchrun --standalone --nproc-per-node N`` (e.g. two emulated
    nodes), and runs ``python -m torchtitan.train`` itself; ``module``: another config module
    (on ``PYTHONPATH``)."""
    os.makedirs(dump, exist_ok=True)
    files = {k: os.path.join(dump, name) for k, name in (
        ("metrics", "metrics.jsonl"), ("norms", "grad_norm_fp64.jsonl"),
        ("attributes", "attributes.json"))}
    env = dict(os.environ, TITAN_METRICS=files["metrics"], HF_DATASETS_OFFLINE="1",
               HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([HERE, *filter(None, [os.environ.get("PYTHONPATH")])]))
    if exact_norms:
        env["TITAN_EXACT_NORMS"] = files["norms"]
    if watch_attributes:
        env["TITAN_ATTRIBUTES"] = files["attributes"]
    entry = launcher or [sys.executable, "-m", "torch.distributed.run", "--standalone",
                         f"--nproc-per-node={nproc}", "-m", "torchtitan.train"]
    options = tuple(options)
    if seed:
        options += ("--checkpoint.enable", "--checkpoint.initial_load_path",
                    work.seeds[compare.LLAMA3], "--checkpoint.interval", "100000",
                    "--checkpoint.load_only")
    cmd = [*entry, "--module", module, "--config", config,
           "--hf_assets_path", work.tokenizer, "--dataloader.dataset_path", work.dataset,
           "--dump_folder", dump, *options]
    log_path = os.path.join(dump, "log.txt")
    with open(log_path, "w") as out:
        rc = compare._run_group(cmd, env, out)
    with open(log_path) as f:
        log = f.read()
    if rc != 0:
        raise RuntimeError(f"torchtitan ({config} {' '.join(options)}) exited with {rc}; log "
                           f"{log_path}:\n{log[-6000:]}")
    steps = _jsonl(files["metrics"])
    if exact_norms:
        exact = {r["step"]: r["grad_norm_fp64"] for r in _jsonl(files["norms"])}
        for step in steps:
            step["grad_norm_fp64"] = exact[step["step"]]
    changed = None
    if watch_attributes:
        with open(files["attributes"]) as f:
            watched = json.load(f)
        changed = watched["changed"] if watched["owners"] > 50 else ["<too few watched>"]
    return Run(steps, step_lines(log), log, changed)


def assets_only(root: str) -> compare.Workdir:
    """A work directory with the tokenizer and data set only (no seed checkpoint)."""
    tokenizer, dataset = compare.assets.write_assets(os.path.join(root, "assets"))
    return compare.Workdir(root, tokenizer, dataset, seeds={})


def _jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


def max_differences(reference: list[dict], other: list[dict]) -> dict[str, float]:
    """Largest per-step differences over the steps both have: ``loss`` and ``grad_norm``
    (torchtitan's logged norm) absolute, ``grad_norm_fp64`` relative (when both recorded it)."""
    by_step = {r["step"]: r for r in reference}
    pairs = [(by_step[o["step"]], o) for o in other if o["step"] in by_step]
    if not pairs or len(pairs) != len(other):
        raise ValueError(f"steps {[o['step'] for o in other]} not all in the reference's")
    out = {k: max(abs(o[k] - r[k]) for r, o in pairs) for k in ("loss", "grad_norm")}
    if all("grad_norm_fp64" in x for pair in pairs for x in pair):
        out["grad_norm_fp64"] = max(abs(o["grad_norm_fp64"] - r["grad_norm_fp64"])
                                    / r["grad_norm_fp64"] for r, o in pairs)
    return out
