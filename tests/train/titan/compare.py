"""torchtitan's trainer with torch's FSDP2 and with ours, from one seed checkpoint: the table.

    .venv/bin/python tests/train/titan/compare.py [--cases fsdp,hsdp,...] [--workdir DIR]

Each case runs ``torchtitan.train`` under ``torchrun`` (CPU, gloo) twice, with
``TITAN_FSDP=torch`` and ``TITAN_FSDP=ours`` (``launch.py``), from the same seed checkpoint
(made once per model, by torchtitan's own ``--checkpoint.create_seed_checkpoint`` on one rank),
and prints per case the largest per-step |loss difference| and |gradient-norm difference| over
the steps (relative to the norm for the MoE cases, whose norm reaches 41 where 1e-5 is two fp32
ulps). ``moe_ep_fsdp`` runs only when named in ``--cases``.
The resume case trains 12 steps saving a DCP checkpoint at step 6, then resumes each runtime from
its own checkpoint in a fresh process and compares steps 7-12 with FSDP2's uninterrupted run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import assets  # noqa: E402

TOLERANCE = 1e-5
TIMEOUT = 900  # seconds per torchrun job: a hang guard, never what decides a pass
STEPS = 12
RESUME_STEP = 6
RUNTIMES = ("torch", "ours")


LLAMA3, DEEPSEEK_V3 = "llama3_debugmodel_cpu", "deepseek_v3_debugmodel_cpu"
# torchtitan's own MoE recipe: EP 2, the routed experts FSDP-sharded over `efsdp` beside `ep`
# (its shard_placement_fn returns FSDP2's per-parameter mesh), the rest of each block over
# `fsdp`. Gradient clipping off: the clip coefficient carries the gradient norm's fp32 rounding,
# which depends on the shard boundaries (ours and FSDP2's differ), into the update, where the
# experts' bf16 matmuls and top-k routing amplify it (docs/torchtitan.md); without it both
# runtimes train bit for bit alike and the norms differ by that rounding alone.
_MOE = ("--parallelism.expert_parallel_degree", "2", "--training.max_norm", "1e9")


@dataclasses.dataclass(frozen=True)
class Case:
    """One torchtitan configuration: ranks, config function, extra CLI options, the config whose
    seed checkpoint it starts from, and whether its gradient norms compare relative to their
    size (``max |diff| / |FSDP2's norm|``; else absolute)."""

    nproc: int
    config: str = LLAMA3
    options: tuple[str, ...] = ()
    resume: bool = False
    seed_config: str = LLAMA3
    relative_grad_norm: bool = False
    in_default: bool = True  # run without --cases


CASES = {
    "fsdp": Case(2),
    "hsdp": Case(4, options=("--parallelism.data_parallel_replicate_degree", "2",
                             "--parallelism.data_parallel_shard_degree", "2")),
    "fsdp_tp": Case(4, options=("--parallelism.data_parallel_shard_degree", "2",
                                "--parallelism.tensor_parallel_degree", "2")),
    # torchtitan's full-DTensor backend: fully_shard(dp_mesh_dims=...) on its whole SPMD mesh.
    "full_dtensor": Case(2, options=("--parallelism.spmd_backend", "full_dtensor")),
    "full_ac": Case(2, config="llama3_debugmodel_cpu_full_ac"),
    "selective_ac": Case(2, config="llama3_debugmodel_cpu_selective_ac"),
    "resume": Case(2, resume=True),
    "moe_ep": Case(2, DEEPSEEK_V3, _MOE, seed_config=DEEPSEEK_V3, relative_grad_norm=True),
    # Over 1e-5 (docs/torchtitan.md): 4-rank reduce-scatters sum in another order than gloo's
    # (last-bit gradient differences), which the experts' bf16 matmuls and routing amplify.
    "moe_ep_fsdp": Case(4, DEEPSEEK_V3, _MOE, seed_config=DEEPSEEK_V3, relative_grad_norm=True,
                        in_default=False),
}


@dataclasses.dataclass
class Workdir:
    """The assets and the seed checkpoints the runs start from (one per model config)."""

    root: str
    tokenizer: str
    dataset: str
    seeds: dict[str, str]


def _torchrun(nproc: int, config: str, dump: str, work: Workdir, runtime: str,
              options: tuple[str, ...] = ()) -> list[dict]:
    """One ``torchtitan.train`` job; returns rank 0's recorded steps (none for a seed job)."""
    os.makedirs(dump, exist_ok=True)
    metrics = os.path.join(dump, "metrics.jsonl")
    env = dict(os.environ, TITAN_FSDP=runtime, TITAN_METRICS=metrics, HF_DATASETS_OFFLINE="1",
               HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", os.path.join(HERE, "launch.py"),
           "--module", "titan_config", "--config", config, "--hf_assets_path", work.tokenizer,
           "--dataloader.dataset_path", work.dataset, "--dump_folder", dump,
           "--training.steps", str(STEPS), *options]
    log = os.path.join(dump, "log.txt")
    with open(log, "w") as out:
        rc = _run_group(cmd, env, out)
    if rc != 0:
        with open(log) as f:
            tail = f.read()[-6000:]
        raise RuntimeError(f"torchtitan ({runtime}, {config} {' '.join(options)}) exited with "
                           f"{rc}; log {log}:\n{tail}")
    if not os.path.exists(metrics):
        return []
    with open(metrics) as f:
        return [json.loads(line) for line in f]


def _run_group(cmd: list[str], env: dict[str, str], out) -> int:
    """Run ``cmd`` in its own process group; past ``TIMEOUT`` (a hang guard), end the group."""
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        return proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, None)):
            try:
                os.killpg(proc.pid, sig)
                return proc.wait(timeout=wait)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        raise TimeoutError(f"{' '.join(cmd)} ran over {TIMEOUT} s") from None


def make_workdir(root: str, seed_configs: tuple[str, ...] = (LLAMA3,)) -> Workdir:
    """Write the assets and make a seed checkpoint per config (one rank, torchtitan's own
    option)."""
    tokenizer, dataset = assets.write_assets(os.path.join(root, "assets"))
    work = Workdir(root, tokenizer, dataset, seeds={})
    for config in seed_configs:
        dump = os.path.join(root, f"seed_{config}")
        _torchrun(1, config, dump, work, "torch",
                  ("--checkpoint.enable", "--checkpoint.create_seed_checkpoint"))
        work.seeds[config] = os.path.join(dump, "checkpoint", "step-0")
    return work


def _from_seed(work: Workdir, case: Case, *, save: bool) -> tuple[str, ...]:
    options = ("--checkpoint.enable", "--checkpoint.initial_load_path", work.seeds[case.seed_config],
               "--checkpoint.interval", str(RESUME_STEP if save else 10 * STEPS))
    return options if save else options + ("--checkpoint.load_only",)


def run_case(name: str, case: Case, work: Workdir) -> dict[str, list[dict]]:
    """Both runtimes' steps for ``case``: ``{runtime: steps}``, plus ``ours_resumed`` etc."""
    out = {}
    for runtime in RUNTIMES:
        dump = os.path.join(work.root, name, runtime)
        out[runtime] = _torchrun(case.nproc, case.config, dump, work, runtime,
                                 case.options + _from_seed(work, case, save=case.resume))
        if case.resume:
            resumed = os.path.join(work.root, name, f"{runtime}_resumed")
            shutil.copytree(os.path.join(dump, "checkpoint", f"step-{RESUME_STEP}"),
                            os.path.join(resumed, "checkpoint", f"step-{RESUME_STEP}"))
            out[f"{runtime}_resumed"] = _torchrun(case.nproc, case.config, resumed, work,
                                                  runtime, case.options + _from_seed(work, case, save=True))
    return out


def max_differences(reference: list[dict], other: list[dict],
                    relative_grad_norm: bool = False) -> tuple[float, float, int]:
    """Largest |loss| and |grad_norm| differences over the steps ``other`` has, and their count;
    with ``relative_grad_norm``, each grad-norm difference over the reference's norm."""
    by_step = {r["step"]: r for r in reference}
    if not other or any(o["step"] not in by_step for o in other):
        raise ValueError(f"steps {[o['step'] for o in other]} not all in the reference's")
    loss = max(abs(o["loss"] - by_step[o["step"]]["loss"]) for o in other)
    grad = max(abs(o["grad_norm"] - by_step[o["step"]]["grad_norm"])
               / (abs(by_step[o["step"]]["grad_norm"]) if relative_grad_norm else 1.0)
               for o in other)
    return loss, grad, len(other)


def compared(name: str, runs: dict[str, list[dict]]) -> tuple[float, float, int]:
    """The case's row: ours (resumed, for the resume case) against FSDP2's uninterrupted run."""
    return max_differences(runs["torch"], runs["ours_resumed" if name == "resume" else "ours"],
                           CASES[name].relative_grad_norm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(n for n, c in CASES.items() if c.in_default),
                        help="comma-separated, of " + ", ".join(CASES))
    parser.add_argument("--workdir", default=None, help="kept when given (logs, checkpoints)")
    args = parser.parse_args()
    names = args.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise ValueError(f"--cases: unknown {unknown}; choose from {list(CASES)}")
    root = args.workdir or tempfile.mkdtemp(prefix="titan-")
    start = time.perf_counter()
    work = make_workdir(root, tuple(dict.fromkeys(CASES[n].seed_config for n in names)))
    rows, failed = [], []
    for name in names:
        t0 = time.perf_counter()
        loss, grad, n = compared(name, run_case(name, CASES[name], work))
        rows.append((name, CASES[name].nproc, n, loss, grad, time.perf_counter() - t0))
        if max(loss, grad) > TOLERANCE:
            failed.append(name)
    print(f"\n| configuration | ranks | steps compared | max abs loss diff | max grad-norm diff "
          f"| seconds |\n| --- | --- | --- | --- | --- | --- |")
    for name, nproc, n, loss, grad, seconds in rows:
        kind = "relative" if CASES[name].relative_grad_norm else "abs"
        print(f"| {name} | {nproc} | {n} | {loss:.1e} | {grad:.1e} ({kind}) | {seconds:.0f} |")
    print(f"\ntotal {time.perf_counter() - start:.0f} s; runs under {root}")
    if not args.workdir:
        shutil.rmtree(root, ignore_errors=True)
    if failed:
        sys.exit(f"over {TOLERANCE}: {failed}")


if __name__ == "__main__":
    main()
