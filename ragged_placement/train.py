"""``python -m ragged_placement.train``: a torchtitan-shaped trainer, started by ``torchrun``.

::

    torchrun --standalone --nproc-per-node 4 -m ragged_placement.train --steps 200 \\
        --runtime ours --checkpoint-dir ckpt --checkpoint-every 50 --output model.pt

The same code runs on CPU (gloo) and CUDA (NCCL): the backend follows the device. Options come
from ``--config FILE`` (TOML) and/or flags (:mod:`ragged_placement.trainer.config`); a bad one
is an error naming the flag before any process-group work. With ``--checkpoint-dir`` the run
saves every ``--checkpoint-every`` steps and, when started again (by hand or by
``torchrun --max-restarts``), resumes from the newest complete checkpoint by itself, to the
same weights as an uninterrupted run (:mod:`ragged_placement.trainer.checkpoint`). A rank that
dies or freezes makes the others fail within ``--collective-timeout`` seconds with an error
naming the collective and the ranks behind (:mod:`ragged_placement.trainer.distributed`).
See ``docs/train.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.elastic.multiprocessing.errors import record
from typing_extensions import Self  # a dependency of torch

from ragged_placement._gloo import exit_without_finalization, one_worker_gloo
from ragged_placement.testing.profiling import (
    CollectiveMeter,
    HeapPeakMeter,
    LayoutCopyMeter,
    heap_in_use,
    net_bytes,
    state_bytes,
)
from ragged_placement.expert_parallel import split_state_sharding
from ragged_placement.planner import StateShardingPlan
from ragged_placement.trainer.build import (
    TokenData,
    build_mesh,
    build_model,
    build_optimizer,
    build_scheduler,
    loss_fn,
)
from ragged_placement.trainer.checkpoint import (
    MANIFEST,
    Checkpointer,
    check_checkpoint_dir,
    move_incomplete_aside,
)
from ragged_placement.trainer.collective_bytes import CollectiveBytes
from ragged_placement.trainer.config import MOE_DIMS, TrainConfig, check_world, parse_config
from ragged_placement.trainer.grad_norm import clip_grad_norm_
from ragged_placement.trainer.distributed import (
    CollectiveWatch,
    DistributedEnv,
    init_distributed,
    pick_device,
    torchrun_env,
)
from ragged_placement.trainer.resume import Resume, find_resume, layout, restore_rng, rng_state

__all__ = ["main"]

MiB = 2.0**20
# ``main``'s test-only seam: ``on_step(rank, step)``, called by every rank as it starts a step.
StepHook = Callable[[int, int], None]


class _CudaPeakMeter:
    """:class:`HeapPeakMeter`'s interface on a GPU: the caching allocator's peak during the
    :meth:`measure` windows, above the memory allocated when the meter was entered."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.peak, self._base = device, 0, 0

    def __enter__(self) -> Self:
        self._base = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc) -> None:
        pass

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        torch.cuda.reset_peak_memory_stats(self.device)
        yield
        self.peak = max(self.peak, torch.cuda.max_memory_allocated(self.device) - self._base)


class _Progress:
    """One line per ``--log-every`` steps, every field named (docs/train.md, "The log line"):
    ``step``, ``loss`` (the global batch's mean), ``lr``, ``tok/s`` (global tokens per second
    since the last line), ``state`` (this rank's parameter, gradient and optimizer-state
    tensors), ``heap`` (CPU: the C heap in use) or ``cuda peak`` (``max_memory_allocated``) and
    ``comm`` (bytes of every collective of the step, :class:`CollectiveBytes`); a bar
    rewritten in place when stdout is a terminal."""

    def __init__(self, cfg: TrainConfig, env: DistributedEnv, start: int) -> None:
        self.cfg, self.env, self.tty = cfg, env, sys.stdout.isatty()
        self.tokens = cfg.batch * cfg.seq * env.world_size
        self.t0, self.step0, self.comm0 = time.perf_counter(), start, 0

    def _memory(self) -> str:
        if self.env.device.type == "cuda":
            return f"cuda peak {torch.cuda.max_memory_allocated(self.env.device) / MiB:.1f} MiB"
        return f"heap {heap_in_use() / MiB:.1f} MiB"

    def update(self, step: int, loss: float, lr: float, comm: int, state: Callable[[], int]) -> None:
        """Log step ``step`` (``comm``: bytes of the collectives so far; ``state``: this rank's
        state bytes, computed only when a line is printed)."""
        done, total = step + 1, self.cfg.steps
        logged = done % self.cfg.log_every == 0 or done == total
        if self.env.rank != 0 or not (logged or self.tty):
            return
        steps = done - self.step0
        line = (f"step {done:5d}/{total}  loss {loss:.4f}  lr {lr:.2e}  "
                f"tok/s {self.tokens * steps / (time.perf_counter() - self.t0):,.0f}  "
                f"state {state() / MiB:.2f} MiB  {self._memory()}  "
                f"comm {(comm - self.comm0) / max(1, steps) / MiB:.3f} MiB/step")
        if self.tty:
            bar = "#" * (30 * done // total)
            print(f"\r[{bar:30s}] {line}", end="\n" if logged else "", flush=True)
        else:
            print(line, flush=True)
        if logged:
            self.t0, self.step0, self.comm0 = time.perf_counter(), done, comm


def _train_step(model, opt, sched, data: TokenData, cfg: TrainConfig, env: DistributedEnv,
                step: int) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)  # at the start: the gradients stay for measurement
    x, y = data.batch(step, env.rank, env.world_size)
    loss = loss_fn(model, x.to(env.device), y.to(env.device))
    loss.backward()
    if cfg.grad_clip:
        clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    sched.step()
    loss = loss.detach().float()
    dist.all_reduce(loss)
    return loss / env.world_size


def _validate(model, data: TokenData, cfg: TrainConfig, env: DistributedEnv) -> float | None:
    if not cfg.val_batches:
        return None
    with torch.no_grad():
        losses = [loss_fn(model, *(t.to(env.device) for t in data.batch(i, env.rank, env.world_size, "val")))
                  for i in range(cfg.val_batches)]
        val = torch.stack(losses).mean()
        dist.all_reduce(val)
    return val.item() / env.world_size


def _expert_sharding(plan: StateShardingPlan, mesh) -> str | None:
    """For ``--model moe``: the experts' own sharding, the choice with the ep dim dropped (as
    ``parallelize_moe`` applies it); ``None`` for a dense model."""
    if MOE_DIMS[1] not in (mesh.mesh_dim_names or ()):
        return None
    return str(split_state_sharding(mesh, MOE_DIMS[1], plan.sharding, None)[1])


def _experts_line(plan: StateShardingPlan, mesh) -> str:
    experts = _expert_sharding(plan, mesh)
    return "" if experts is None else f" with ep {plan.ep} over {MOE_DIMS[1]!r} (the experts: {experts})"


def _show_plan(plan: StateShardingPlan | None, env: DistributedEnv, mesh) -> None:
    if plan is not None and env.rank == 0:
        print(f"--state-sharding auto: the partitioner chose {plan.sharding}"
              f"{_experts_line(plan, mesh)}, "
              f"reshard_after_forward={plan.reshard_after_forward}; predicted communication "
              f"{sum(plan.comm_seconds.values()):.4g} s/step "
              f"({', '.join(f'{d} {t:.4g} s' for d, t in plan.comm_seconds.items())}) at "
              f"{', '.join(f'{d} {b:.4g} B/s' for d, b in plan.bandwidth.items())}:\n"
              f"{plan.table()}", flush=True)


def _plan_metrics(plan: StateShardingPlan | None, mesh) -> dict[str, Any] | None:
    """The partitioner's choice (with ``--model moe``: its EP degree and the experts' sharding)
    and every candidate's predictions (``--metrics``)."""
    if plan is None:
        return None
    return {"choice": str(plan.sharding), "reshard_after_forward": plan.reshard_after_forward,
            "ep": plan.ep, "experts": _expert_sharding(plan, mesh),
            "bandwidth": plan.bandwidth, "latency": plan.latency,
            "candidates": [{"sharding": str(c.sharding), "reshard_after_forward": c.reshard_after_forward,
                            "comm_seconds": c.comm_seconds, "comm_bytes": c.comm_bytes,
                            "memory_per_rank": c.memory_per_rank,
                            "collectives": [dataclasses.asdict(k) for k in c.collectives]}
                           for c in plan.candidates]}


def _unit_plans(model) -> list[str]:
    units = getattr(model, "fsdp_units", None)
    if units is None:
        return []
    return [f"plan of unit {name or '<root>'!r}:\n{unit.buffers[0].plan.summary()}" for name, unit in list(units())[:2]]


def _train(cfg: TrainConfig, env: DistributedEnv, resume: Resume | None,
           on_step: StepHook | None = None) -> dict[str, Any]:
    """Build, resume, train, save; the run's measurements (rank 0's are written by ``--metrics``;
    ``on_step``: :func:`main`'s)."""
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    mesh = build_mesh(cfg, env.device, env.world_size)
    data = TokenData(cfg)
    meter = _CudaPeakMeter(env.device) if env.device.type == "cuda" else HeapPeakMeter()
    with meter as mem:
        model, plan = build_model(cfg, mesh, env.device)
        _show_plan(plan, env, mesh)
        opt, ckpt = build_optimizer(cfg, model), None
        sched = build_scheduler(cfg, opt)
        start = 0
        if cfg.checkpoint_dir:
            ckpt = Checkpointer(cfg.checkpoint_dir, json.loads(json.dumps(cfg.fingerprint())),
                                layout=layout(cfg, env.world_size))
        if resume is not None:
            start = _resume(resume, ckpt, model, opt, sched, env)
        out = _loop(cfg, env, model, opt, sched, data, ckpt, start, mem, on_step)
    out.update(val_loss=_validate(model, data, cfg, env), plans=_unit_plans(model),
               state_sharding=_plan_metrics(plan, mesh))
    if cfg.output:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if env.rank == 0:
            torch.save(full, cfg.output)
    return out


def _resume(resume: Resume, ckpt: Checkpointer, model, opt, sched, env: DistributedEnv) -> int:
    """Restore ``resume`` (resharded to this run's layout); the step to start at."""
    ckpt.load(resume.path, model, opt)
    sched.load_state_dict(resume.state["scheduler"])
    if resume.schedule_changed:  # the restored LR is the old schedule's: the new one's instead
        sched.last_epoch = resume.step - 1
        sched.step()
    restore_rng(resume.state["rng"], env.device)
    if env.rank == 0:
        print(f"resumed from {resume.path} at step {resume.step}", flush=True)
        for change in resume.changes:
            print(f"resume: {change}", flush=True)
    return resume.step


def _loop(cfg, env, model, opt, sched, data, ckpt, start, mem, on_step) -> dict[str, Any]:
    progress, losses, last = _Progress(cfg, env, start), [], cfg.steps - 1
    copies, net0, timed = LayoutCopyMeter(), net_bytes(), (0.0, 0, 0.0)
    with CollectiveWatch(env) as watch, CollectiveMeter() as meter, CollectiveBytes() as comm:
        for step in range(start, cfg.steps):
            watch.step = step
            if on_step is not None:
                on_step(env.rank, step)
            measured = step == last and step > start  # memory and copies; not timed
            t0, comm0 = time.perf_counter(), watch.seconds
            try:
                idle = contextlib.nullcontext()
                with mem.measure() if measured else idle, copies if measured else idle:
                    losses.append(_train_step(model, opt, sched, data, cfg, env, step).item())
            except (RuntimeError, dist.DistBackendError) as e:
                raise watch.failure(e) from e
            if start < step and not measured:  # the first step warms up
                timed = (timed[0] + time.perf_counter() - t0, timed[1] + 1,
                         timed[2] + watch.seconds - comm0)
            progress.update(step, losses[-1], sched.get_last_lr()[0], comm.total,
                            lambda: sum(state_bytes(model, opt).values()))
            if ckpt is not None and cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
                ckpt.save(step + 1, model, opt, {"step": step + 1, "scheduler": sched.state_dict(),
                                                 "data": {"next_step": step + 1, "seed": cfg.seed},
                                                 "rng": rng_state(env.device)})
    n = max(1, cfg.steps - start)
    net1 = net_bytes()
    return {
        "losses": losses, "start": start,
        "tokens_per_s": cfg.batch * cfg.seq * env.world_size * timed[1] / timed[0] if timed[1] else None,
        "comm_bytes": (meter.all_gather_bytes + meter.reduce_scatter_bytes) / n,
        "comm_seconds": timed[2] / timed[1] if timed[1] else None,
        "collectives": (meter.counts["all_gather"] + meter.counts["reduce_scatter"]) / n,
        "collective_bytes": comm.total / n, "collective_calls": comm.calls / n,
        "collective_bytes_by_call": {k: v / n for k, v in comm.by_name.items()},
        "copy_bytes": copies.total, "peak": mem.peak, "state_bytes": state_bytes(model, opt),
        "net_bytes": {k: net1[k] - net0.get(k, 0) for k in net1} if env.local_rank == 0 else {},
    }


def _header(cfg: TrainConfig, env: DistributedEnv) -> None:
    if env.rank == 0:
        mesh = "x".join(map(str, cfg.mesh or (env.world_size,)))
        model = cfg.model
        if cfg.model == "moe" or cfg.ep > 1:
            mesh = f"{env.world_size // cfg.ep}x{cfg.ep} (dp_mod_ep, ep: --ep {cfg.ep})"
        if cfg.model == "moe":
            model = (f"moe ({cfg.moe_layers} MoE layers of {cfg.experts} experts, top "
                     f"{cfg.top_k})")
        print(f"{model}: {cfg.layers} layers x {cfg.width}, seq {cfg.seq}; {env.world_size} "
              f"ranks ({dist.get_backend()}, {env.device.type}), mesh {mesh}, --runtime {cfg.runtime}"
              f", --state-sharding {cfg.state_sharding}, {cfg.optimizer}, {cfg.precision}, "
              f"batch {cfg.batch} per rank", flush=True)


def _check(argv: list[str] | None) -> tuple[TrainConfig, Resume | None]:
    """Every check that needs no other rank: the options, the job's size, the device, the
    checkpoint directory (writable; an unpublished ``step_<S>`` moved aside by rank 0) and the
    checkpoint to resume; a ``ValueError`` naming the flag."""
    cfg = parse_config(argv)
    rank, world_size, local_rank = torchrun_env()
    check_world(cfg, world_size)
    pick_device(cfg.device, local_rank)
    if cfg.checkpoint_dir:
        check_checkpoint_dir(cfg.checkpoint_dir)
        for path, aside in move_incomplete_aside(cfg.checkpoint_dir) if rank == 0 else ():
            print(f"--checkpoint-dir: {path} has no {MANIFEST} (not a complete checkpoint): "
                  f"moved aside to {aside}, never resumed", file=sys.stderr, flush=True)
    return cfg, find_resume(cfg, rank, world_size)


@record
def main(argv: list[str] | None = None, *, on_step: StepHook | None = None) -> None:
    """Check, resume, train. A bad option, file or checkpoint ends the job before any
    process-group work: ``error: ...`` on stderr and exit status 2 from local rank 0 (the first
    rank of each node), exit status 0 without a word from the node's other ranks, which made the
    same checks on the same files; so torchrun reports one failure, not one per rank.

    ``on_step`` is a test-only seam: ``on_step(rank, step)`` is called by every rank as it
    starts each step (before the step's first collective); the tests' fault injection
    (``tests/train/fault_injection.py``, a torchrun script around this function) kills or
    freezes a rank there. ``python -m ragged_placement.train`` passes none."""
    try:
        cfg, resume = _check(argv)
    except (ValueError, NotImplementedError) as e:  # NotImplementedError: a refused combination
        if int(os.environ.get("LOCAL_RANK", "0")) != 0:
            sys.exit(0)
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    # The trainer's gloo groups (the default one, its mesh's) run one worker thread each: the
    # runtime overlaps collectives on them (ragged_placement.one_worker_gloo).
    with one_worker_gloo():
        env = init_distributed(cfg.device, cfg.collective_timeout)
        _header(cfg, env)
        out = _train(cfg, env, resume, on_step)
    per_rank = [None] * env.world_size
    dist.all_gather_object(per_rank, {k: out[k] for k in ("peak", "state_bytes", "net_bytes",
                                                          "comm_seconds", "tokens_per_s")})
    if env.rank == 0 and cfg.metrics:
        out.update(per_rank=per_rank, world_size=env.world_size, config=vars(cfg))
        Path(cfg.metrics).write_text(json.dumps(out, indent=1))
    dist.barrier()  # no rank tears its connections down while another still uses them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_finalization()  # as a torchrun worker: see its docstring
