"""torchtitan's trainer with torch's FSDP2 and with ours, from one seed checkpoint: the table.

    .venv/bin/python tests/train/titan/compare.py [--cases fsdp,hsdp,...] [--workdir DIR]

Each case runs ``torchtitan.train`` under ``torchrun`` (CPU, gloo) twice, with
``TITAN_FSDP=torch`` and ``TITAN_FSDP=ours`` (``launch.py``), from the same seed checkpoint
(made once per model, by torchtitan's own ``--checkpoint.create_seed_checkpoint`` on one rank),
and prints per case the largest per-step |loss difference| and |gradient-norm difference| over
the steps (relative to the norm for the MoE cases, whose norm reaches 41 where 1e-5 is two fp32
ulps; those also record and compare the norm of the full gradients summed in fp64, which does not
depend on the shard cuts). The 4-rank MoE cases run only when named in ``--cases``: ``moe_ep_fsdp``
(EP 2 x expert FSDP 2) and ``moe_fsdp4`` (no EP), each also as ``*_rank_order``, where FSDP2's
gloo reduce-scatter adds in rank order as ours does (``stand_ins.reduce_scatter_in_rank_order``);
with both orders run, a second table gives FSDP2 in gloo's order against FSDP2 in rank order.
``--dump-grads 1,11`` saves each job's full gradients after those steps (``grad_diff.py``).
The resume case trains 12 steps saving a DCP checkpoint at step 6, then resumes each runtime from
its own checkpoint in a fresh process and compares steps 7-12 with FSDP2's uninterrupted run.

The ``pp_*`` cases run every pipeline schedule torch ships (PP 2 x dp_shard 2 on 4 ranks; the
``*_hsdp`` ones, opt-in, PP 2 x dp_replicate 2 x dp_shard 2 on 8), 4 micro-batches of one sequence
per data-parallel rank. FSDP2 does not train all of them right, so besides FSDP2 under the same
schedule each is compared with torchtitan's FSDP2 without pipelining on the same data
(``pp_reference`` / ``pp_reference_hsdp``, run once): ours must match that reference, and FSDP2
under the schedule wherever FSDP2 matches it; an FSDP2 job that fails is reported, not fatal.
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
_MOE_NO_EP = ("--parallelism.expert_parallel_degree", "1", "--training.max_norm", "1e9")


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
    # "rank_order": both runtimes' jobs install stand_ins.reduce_scatter_in_rank_order (FSDP2's
    # gloo reduce-scatter then adds in rank order, as ours does): isolates the summation order.
    reduce_scatter: str = "gloo"
    # Each job also records the norm of its full gradients summed in fp64 per step
    # (stand_ins.record_exact_grad_norm), compared beside torchtitan's logged fp32 norm.
    exact_grad_norm: bool = False
    # The rank whose logged numbers are recorded (with pipeline parallelism: one of the last
    # stage, the only ones whose logged loss is the loss).
    metrics_rank: int = 0
    # A case whose FSDP2 run is the reference without pipelining on the same data: the row
    # also compares both runtimes with it, and an FSDP2 job that fails is reported, not fatal.
    reference: str | None = None
    # What ours must fail with (the case passes when it does): a combination it refuses.
    ours_fails_with: str | None = None
    steps: int = STEPS


def _moe(nproc: int, options: tuple[str, ...], **kwargs) -> Case:
    """A DeepSeek-V3 case: its own seed, the gradient norm relative and also summed in fp64."""
    return Case(nproc, DEEPSEEK_V3, options, seed_config=DEEPSEEK_V3, relative_grad_norm=True,
                exact_grad_norm=True, **kwargs)


# torch.distributed.pipelining's schedules by torchtitan's name; the V-shaped ones hold the first
# and the last stage on pipeline rank 0, the others the last stage on the last pipeline rank.
PP_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B",
                "looped_bfs": "LoopedBFS", "interleaved_zb": "InterleavedZeroBubble",
                "zbv": "ZBVZeroBubble", "dualpipev": "DualPipeV"}
_V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
# 4 micro-batches of one sequence per data-parallel rank (DualPipeV needs as many as its stages)
_PP_BATCH = ("--training.local_batch_size", "4")
_HSDP = ("--parallelism.data_parallel_replicate_degree", "2",
         "--parallelism.data_parallel_shard_degree", "2")


def _pp(schedule: str, hsdp: bool = False, batch: tuple[str, ...] = _PP_BATCH,
        reference: str | None = None, **kwargs) -> Case:
    """A pipeline case: PP 2 x dp_shard 2 (4 ranks) or PP 2 x HSDP 2 x 2 (8 ranks, opt-in)."""
    nproc = 8 if hsdp else 4
    dp = _HSDP if hsdp else ("--parallelism.data_parallel_shard_degree", "2")
    options = ("--parallelism.pipeline_parallel_degree", "2", *dp,
               "--parallelism.pipeline_parallel_schedule", schedule, *batch)
    kwargs.setdefault("in_default", not hsdp)
    reference = reference or ("pp_reference_hsdp" if hsdp else "pp_reference")
    return Case(nproc, options=options, metrics_rank=0 if schedule in _V_SHAPED else nproc // 2,
                reference=reference, **kwargs)


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
    "moe_ep": _moe(2, _MOE),
    # FSDP2's 4-rank reduce-scatter (gloo's all-reduce) adds in another order than ours (an
    # all-to-all, then a sum in rank order): last-bit gradient differences, which the experts'
    # bf16 matmuls and top-k routing amplify, over 1e-5 at a loss spike (docs/torchtitan.md).
    "moe_ep_fsdp": _moe(4, _MOE, in_default=False),
    # The same with FSDP2's reduce-scatter adding in ours' order: the same sums, the same losses.
    "moe_ep_fsdp_rank_order": _moe(4, _MOE, in_default=False, reduce_scatter="rank_order"),
    # The same model on 4 ranks without expert parallelism (plain FSDP over 4), both orders.
    "moe_fsdp4": _moe(4, _MOE_NO_EP, in_default=False),
    "moe_fsdp4_rank_order": _moe(4, _MOE_NO_EP, in_default=False, reduce_scatter="rank_order"),
    # torchtitan's FSDP2 and ours without pipelining, on the pipeline cases' data
    "pp_reference": Case(2, options=("--parallelism.data_parallel_shard_degree", "2", *_PP_BATCH),
                         in_default=False),
    "pp_reference_hsdp": Case(4, options=(*_HSDP, *_PP_BATCH), in_default=False),
    **{f"pp_{name}": _pp(schedule) for name, schedule in PP_SCHEDULES.items()},
    **{f"pp_{name}_hsdp": _pp(schedule, hsdp=True) for name, schedule in PP_SCHEDULES.items()},
    # ZBV with torchtitan's activation checkpointing: full AC trains; selective AC cannot (a
    # region of it can be backwarded once, and the weight pass is the second time)
    "pp_zbv_full_ac": _pp("ZBVZeroBubble", config="llama3_debugmodel_cpu_full_ac",
                          in_default=False),
    # make test's: 4 steps of ZBV, 2 micro-batches (the default batch), against the fsdp case
    "pp_zbv_short": _pp("ZBVZeroBubble", batch=(), reference="fsdp", steps=4, in_default=False),
    "pp_zbv_selective_ac": _pp("ZBVZeroBubble", config="llama3_debugmodel_cpu_selective_ac",
                               in_default=False, ours_fails_with="NotImplementedError: a "
                               "zero-bubble pipeline schedule"),
}


@dataclasses.dataclass
class Workdir:
    """The assets and the seed checkpoints the runs start from (one per model config)."""

    root: str
    tokenizer: str
    dataset: str
    seeds: dict[str, str]
    grad_steps: str = ""  # --dump-grads: steps whose full gradients each job saves (dump/grads)


class JobFailed(RuntimeError):
    """A ``torchtitan.train`` job exited with an error; ``error`` is its last error line."""

    def __init__(self, message: str, error: str) -> None:
        super().__init__(message)
        self.error = error


def _last_error(log: str) -> str:
    """The last ``SomeError: ...`` line of a job's log (what its ranks raised)."""
    lines = [ln.split("]: ", 1)[-1].strip() for ln in log.splitlines()]
    errors = [ln for ln in lines if ln.split(":", 1)[0].endswith(("Error", "Exception"))
              and ": " in ln]
    return errors[-1] if errors else "(no error line)"


def _torchrun(nproc: int, config: str, dump: str, work: Workdir, runtime: str,
              options: tuple[str, ...] = (), reduce_scatter: str = "gloo",
              exact_grad_norm: bool = False, metrics_rank: int = 0,
              steps: int = STEPS) -> list[dict]:
    """One ``torchtitan.train`` job; returns the recorded steps of rank ``metrics_rank`` (none
    for a seed job), with ``grad_norm_fp64`` in each when ``exact_grad_norm``. ``JobFailed`` if
    it exits with an error."""
    os.makedirs(dump, exist_ok=True)
    metrics = os.path.join(dump, "metrics.jsonl")
    env = dict(os.environ, TITAN_FSDP=runtime, TITAN_METRICS=metrics, HF_DATASETS_OFFLINE="1",
               HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TITAN_REDUCE_SCATTER=reduce_scatter,
               TITAN_METRICS_RANK=str(metrics_rank))
    exact_norms = os.path.join(dump, "grad_norm_fp64.jsonl")
    if exact_grad_norm:
        env["TITAN_EXACT_NORMS"] = exact_norms
    if work.grad_steps:
        env.update(TITAN_GRADS=os.path.join(dump, "grads"), TITAN_GRAD_STEPS=work.grad_steps)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", os.path.join(HERE, "launch.py"),
           "--module", "titan_config", "--config", config, "--hf_assets_path", work.tokenizer,
           "--dataloader.dataset_path", work.dataset, "--dump_folder", dump,
           "--training.steps", str(steps), *options]
    log = os.path.join(dump, "log.txt")
    with open(log, "w") as out:
        rc = _run_group(cmd, env, out)
    if rc != 0:
        with open(log) as f:
            text = f.read()
        raise JobFailed(f"torchtitan ({runtime}, {config} {' '.join(options)}) exited with "
                        f"{rc}; log {log}:\n{text[-6000:]}", _last_error(text))
    if not os.path.exists(metrics):
        return []
    with open(metrics) as f:
        steps = [json.loads(line) for line in f]
    if exact_grad_norm:
        with open(exact_norms) as f:
            exact = {r["step"]: r["grad_norm_fp64"] for r in map(json.loads, f)}
        for step in steps:
            step["grad_norm_fp64"] = exact[step["step"]]
    return steps


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


def run_case(name: str, case: Case, work: Workdir,
             runtimes: tuple[str, ...] = RUNTIMES) -> dict[str, list[dict] | str]:
    """The steps of ``runtimes`` for ``case``: ``{runtime: steps}``, plus ``ours_resumed`` etc.
    In a case with a ``reference`` (or ``ours_fails_with``), a job that fails gives its error
    line instead of steps (ours' only if it is the expected one)."""
    out: dict[str, list[dict] | str] = {}
    for runtime in runtimes:
        dump = os.path.join(work.root, name, runtime)
        try:
            out[runtime] = _torchrun(case.nproc, case.config, dump, work, runtime,
                                     case.options + _from_seed(work, case, save=case.resume),
                                     case.reduce_scatter, case.exact_grad_norm,
                                     case.metrics_rank, case.steps)
        except JobFailed as exc:
            expected = runtime == "ours" and case.ours_fails_with is not None and \
                exc.error.startswith(case.ours_fails_with)
            if not (expected or (runtime == "torch" and case.reference is not None)):
                raise
            out[runtime] = exc.error
        if case.resume:
            resumed = os.path.join(work.root, name, f"{runtime}_resumed")
            shutil.copytree(os.path.join(dump, "checkpoint", f"step-{RESUME_STEP}"),
                            os.path.join(resumed, "checkpoint", f"step-{RESUME_STEP}"))
            out[f"{runtime}_resumed"] = _torchrun(case.nproc, case.config, resumed, work,
                                                  runtime, case.options + _from_seed(work, case, save=True),
                                                  case.reduce_scatter, case.exact_grad_norm)
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


def max_exact_norm_difference(reference: list[dict], other: list[dict]) -> float | None:
    """Largest relative difference of the fp64 full-gradient norms (``None`` if not recorded)."""
    by_step = {r["step"]: r for r in reference}
    if "grad_norm_fp64" not in other[0]:
        return None
    return max(abs(o["grad_norm_fp64"] - by_step[o["step"]]["grad_norm_fp64"])
               / by_step[o["step"]]["grad_norm_fp64"] for o in other)


def compared(name: str, runs: dict[str, list[dict]]) -> tuple[float, float, int]:
    """The case's row: ours (resumed, for the resume case) against FSDP2's uninterrupted run."""
    return max_differences(runs["torch"], runs["ours_resumed" if name == "resume" else "ours"],
                           CASES[name].relative_grad_norm)


def _or_dash(x: float | None) -> str:
    return "-" if x is None else f"{x:.1e}"


def _print_fsdp2_against_itself(runs: dict[str, dict[str, list[dict]]]) -> None:
    """For each case run in both orders, FSDP2 in gloo's order against FSDP2 in rank order (a
    reference, not a check): how far the summation order alone moves FSDP2's own numbers."""
    pairs = [(n, f"{n}_rank_order") for n in runs if f"{n}_rank_order" in runs]
    if not pairs:
        return
    print("\n| FSDP2 against itself | steps compared | max abs loss diff | max grad-norm diff "
          "| fp64 full-gradient norm diff (relative) |\n| --- | --- | --- | --- | --- |")
    for name, ranked in pairs:
        reference, other = runs[name]["torch"], runs[ranked]["torch"]
        loss, grad, n = max_differences(reference, other, CASES[name].relative_grad_norm)
        kind = "relative" if CASES[name].relative_grad_norm else "abs"
        print(f"| {name}: gloo's order vs rank order | {n} | {loss:.1e} | {grad:.1e} ({kind}) "
              f"| {_or_dash(max_exact_norm_difference(reference, other))} |")


@dataclasses.dataclass(frozen=True)
class PipelineRow:
    """A ``pp_*`` case against FSDP2 under the same schedule and the reference without
    pipelining: each runtime's outcome (``trains``; ``trains wrong``: over the tolerance against
    the reference; ``fails: <error>``), the largest ``(loss, grad-norm)`` differences of each
    pair (``None`` where a side failed), the steps compared and whether the case passes."""

    fsdp2: str
    ours: str
    ours_vs_fsdp2: tuple[float, float] | None
    ours_vs_reference: tuple[float, float] | None
    fsdp2_vs_reference: tuple[float, float] | None
    steps: int
    ok: bool


def pipeline_row(name: str, runs: dict[str, list[dict] | str],
                 reference: list[dict]) -> PipelineRow:
    """The row of pipeline case ``name``. It passes when ours matches the reference within
    ``TOLERANCE`` (and FSDP2 under the schedule wherever FSDP2 matches the reference), or, for
    a case with ``ours_fails_with``, when ours fails with that error."""

    def diff(a, b) -> tuple[float, float] | None:
        return None if isinstance(a, str) or isinstance(b, str) else max_differences(a, b)[:2]

    def outcome(steps, vs_reference) -> str:
        if isinstance(steps, str):
            return f"fails: {steps}"
        return "trains" if max(vs_reference) <= TOLERANCE else "trains wrong"

    torch_steps, ours_steps = runs["torch"], runs["ours"]
    ours_ref, fsdp2_ref = diff(reference, ours_steps), diff(reference, torch_steps)
    ours_fsdp2 = diff(torch_steps, ours_steps)
    fsdp2, ours = outcome(torch_steps, fsdp2_ref), outcome(ours_steps, ours_ref)
    if CASES[name].ours_fails_with is not None:
        ok = ours.startswith("fails: ")
    else:
        ok = ours == "trains" and (fsdp2 != "trains" or max(ours_fsdp2) <= TOLERANCE)
    steps = 0 if isinstance(ours_steps, str) else len(ours_steps)
    return PipelineRow(fsdp2, ours, ours_fsdp2, ours_ref, fsdp2_ref, steps, ok)


def _pair(d: tuple[float, float] | None) -> str:
    return "-" if d is None else f"{d[0]:.1e} / {d[1]:.1e}"


def _print_pipeline_rows(rows: list[tuple[str, PipelineRow, float]]) -> None:
    print("\n| pipeline case | ranks | FSDP2 | ours | steps | ours vs FSDP2 (loss / grad norm) "
          "| ours vs no PP | FSDP2 vs no PP | seconds |\n| --- | --- | --- | --- | --- | --- | --- "
          "| --- | --- |")
    for name, row, seconds in rows:
        print(f"| {name} | {CASES[name].nproc} | {row.fsdp2} | {row.ours} | {row.steps} "
              f"| {_pair(row.ours_vs_fsdp2)} | {_pair(row.ours_vs_reference)} "
              f"| {_pair(row.fsdp2_vs_reference)} | {seconds:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(n for n, c in CASES.items() if c.in_default),
                        help="comma-separated, of " + ", ".join(CASES))
    parser.add_argument("--workdir", default=None, help="kept when given (logs, checkpoints)")
    parser.add_argument("--dump-grads", default="", metavar="STEPS",
                        help="e.g. 1,11: each job saves its full gradients after these steps "
                             "(<workdir>/<case>/<runtime>/grads/stepN.pt; grad_diff.py compares)")
    args = parser.parse_args()
    from ragged_placement._compat import torchtitan_unsupported

    if (reason := torchtitan_unsupported()) is not None:
        sys.exit(reason)
    names = args.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise ValueError(f"--cases: unknown {unknown}; choose from {list(CASES)}")
    root = args.workdir or tempfile.mkdtemp(prefix="titan-")
    start = time.perf_counter()
    work = make_workdir(root, tuple(dict.fromkeys(CASES[n].seed_config for n in names)))
    work.grad_steps = args.dump_grads
    rows, pipeline_rows, failed, runs = [], [], [], {}
    for name in names:
        t0 = time.perf_counter()
        case = CASES[name]
        if case.reference is not None and case.reference not in runs:
            # FSDP2 without pipelining alone, unless the reference case is named as well
            runtimes = RUNTIMES if case.reference in names else ("torch",)
            runs[case.reference] = run_case(case.reference, CASES[case.reference], work, runtimes)
        missing = tuple(r for r in RUNTIMES if r not in runs.get(name, {}))
        if missing:  # (a reference case named after a pipeline case ran its FSDP2 job already)
            runs.setdefault(name, {}).update(run_case(name, case, work, missing))
        if case.reference is not None:
            row = pipeline_row(name, runs[name], runs[case.reference]["torch"])
            pipeline_rows.append((name, row, time.perf_counter() - t0))
            if not row.ok:
                failed.append(name)
            continue
        loss, grad, n = compared(name, runs[name])
        exact = max_exact_norm_difference(runs[name]["torch"], runs[name]["ours"])
        rows.append((name, case.nproc, n, loss, grad, exact, time.perf_counter() - t0))
        if max(loss, grad) > TOLERANCE:
            failed.append(name)
    if rows:
        print(f"\n| configuration | ranks | steps compared | max abs loss diff | max grad-norm diff "
              f"| fp64 full-gradient norm diff (relative) | seconds |"
              f"\n| --- | --- | --- | --- | --- | --- | --- |")
    for name, nproc, n, loss, grad, exact, seconds in rows:
        kind = "relative" if CASES[name].relative_grad_norm else "abs"
        print(f"| {name} | {nproc} | {n} | {loss:.1e} | {grad:.1e} ({kind}) | {_or_dash(exact)} "
              f"| {seconds:.0f} |")
    if pipeline_rows:
        _print_pipeline_rows(pipeline_rows)
    _print_fsdp2_against_itself(runs)
    print(f"\ntotal {time.perf_counter() - start:.0f} s; runs under {root}")
    if not args.workdir:
        shutil.rmtree(root, ignore_errors=True)
    if failed:
        sys.exit(f"over {TOLERANCE}: {failed}")


if __name__ == "__main__":
    main()
