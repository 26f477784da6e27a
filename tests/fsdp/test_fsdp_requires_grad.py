"""``requires_grad`` changed after ``fully_shard`` (freezing and unfreezing mid-training, or
before the first forward), side by side with torch FSDP2 and one process (issue 35).

FSDP2 re-reads each sharded parameter's ``requires_grad`` at every unshard (``to_unsharded``),
so a parameter frozen after wrapping gets no gradient and AdamW (weight decay included) leaves
it alone; an unfrozen one trains again. Ours must do the same: before the fix a frozen
parameter still got a gradient and AdamW moved it, and a parameter frozen at wrap time never
trained again.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_threaded
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import ragged_placement.quant.linear as fp8_linear_module
from ragged_placement.fsdp import StateSharding, fully_shard
from ragged_placement.quant import BlockFP8Config, convert_to_fp8_linear

WORLD = 2
STEPS = 6
BATCH = 8
TOL = 1e-5
QUANT = BlockFP8Config(block=(128, 128))
WIDTH = {False: 16, True: 128}  # FP8 units: whole 128x128 blocks

# parameters frozen: the first unit whole, and the third unit's weight (its flat buffer then
# mixes frozen and trainable parameters)
FROZEN = ("0.lin.weight", "0.lin.bias", "2.lin.weight")


@dataclass
class Schedule:
    """``changes``: step -> True (freeze ``FROZEN``) / False (unfreeze them) before that
    step's forward (-1: before ``fully_shard``). ``keep_grads``: ``zero_grad(set_to_none=
    False)`` after odd steps, so a parameter may be frozen holding a zeroed ``.grad`` (AdamW
    then still steps it, weight decay included, in one process as under FSDP2) and unfrozen
    holding one (the next gradient accumulates into it)."""

    changes: dict[int, bool]
    keep_grads: bool = False


SCHEDULES = {
    "before_first_forward": Schedule({0: True, 4: False}),
    "mid_training": Schedule({2: True, 4: False}),
    "frozen_at_wrap": Schedule({-1: True, 3: False}),
    "mid_training_keeping_zeroed_grads": Schedule({2: True, 5: False}, keep_grads=True),
}


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def _blocks(width: int) -> nn.Sequential:
    return nn.Sequential(*(Block(width) for _ in range(3)))


with torch.random.fork_rng():  # once per process: rank threads share the global RNG
    torch.manual_seed(0)
    INIT = {fp8: _blocks(w).state_dict() for fp8, w in WIDTH.items()}
    _GEN = torch.Generator().manual_seed(0)
    DATA = {
        fp8: (torch.randn(STEPS, BATCH, w, generator=_GEN),
              torch.randn(STEPS, BATCH, w, generator=_GEN))
        for fp8, w in WIDTH.items()
    }


def _model(fp8: bool) -> nn.Sequential:
    m = _blocks(WIDTH[fp8])
    m.load_state_dict(INIT[fp8])
    return m


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()


def _set_frozen(m: nn.Module, frozen: bool) -> None:
    params = dict(m.named_parameters())
    for name in FROZEN:
        params[name].requires_grad_(not frozen)


def _train(m: nn.Module, schedule: Schedule, batches) -> tuple:
    """``STEPS`` AdamW steps of ``m``, each on the micro-batches ``batches(step)`` (a list of
    ``(x, y)``; each loss over their number, the gradients accumulated): the losses (the mean
    over the micro-batches), per step the names of the parameters without ``.grad`` after
    backward and the full ``FROZEN`` parameters after the step, and the final full
    parameters."""
    opt = _adamw(m.parameters())
    losses, no_grad, frozen = [], [], []
    for s in range(STEPS):
        if s in schedule.changes:
            _set_frozen(m, schedule.changes[s])
        parts = batches(s)
        loss = 0.0
        for x, y in parts:
            part = F.mse_loss(m(x), y)
            (part / len(parts)).backward()
            loss += part.item() / len(parts)
        no_grad.append(sorted(n for n, p in m.named_parameters() if p.grad is None))
        opt.step()
        opt.zero_grad(set_to_none=not (schedule.keep_grads and s % 2 == 1))
        losses.append(loss)
        params = dict(m.named_parameters())
        frozen.append({n: _full(params[n]) for n in FROZEN})
    return losses, no_grad, frozen, {n: _full(p) for n, p in m.named_parameters()}


def _rank_rows(rank: int, ws: int) -> slice:
    per = BATCH // ws
    return slice(rank * per, (rank + 1) * per)


def _reference(schedule: Schedule, fp8: bool = False):
    """One process on the concatenated batch; for ``fp8``, with ``FP8Linear``, on the same
    rows as ``WORLD`` micro-batches (the ranks' rows, gradients accumulated).

    FP8 rounds to 3 mantissa bits, so a last-bit difference in an activation or a master
    weight can move its FP8 value a whole step (one part in 8 to 16), and AdamW's first step
    of a weight (``lr * g / (|g| + eps)``) turns a last-bit difference of a gradient element
    near ``eps`` into up to ``lr`` of the parameter. On the concatenated batch the last bits
    differ twice over: the CPU FP8 GEMMs are float32 matmuls of 8 rows instead of a rank's 4,
    and MKL picks its sgemm kernel by the matrix sizes and the instruction set (on AVX-512 a
    row of the 8-row product differs from the same row of the 4-row one; on other CPUs it may
    not); and the weight and bias gradients are one sum over 8 rows instead of two partial
    sums of 4. So the FP8 reference does the ranks' arithmetic: each micro-batch is a rank's
    forward and backward on the same shapes, on one thread as each rank (MKL's sgemm also
    splits its work, and with some kernels its sums, by the thread count), and the
    accumulated ``g_0 / 2 + g_1 / 2`` is bitwise the reduce-scatter's ``(g_0 + g_1) / 2``:
    the sharded run must match it bitwise, on every machine."""
    m = _model(fp8)
    if fp8:
        convert_to_fp8_linear(m, QUANT)
    if -1 in schedule.changes:
        _set_frozen(m, schedule.changes[-1])
    x, y = DATA[fp8]
    rows = [_rank_rows(r, WORLD) for r in range(WORLD)] if fp8 else [slice(None)]
    with _one_thread():
        return _train(m, schedule, lambda s: [(x[s, r], y[s, r]) for r in rows])


@contextlib.contextmanager
def _one_thread():
    """Run the block on one intra-op thread, as ``_sharded_rank`` runs each rank."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _sharded_rank(rank: int, ws: int, runtime: str, schedule: Schedule, raf: bool):
    """``runtime``: ``fsdp2``, ``ours``, or ours with a ``state_sharding`` (``zero1``,
    ``zero2``) or FP8 units (``fp8``)."""
    torch.set_num_threads(1)
    fp8 = runtime == "fp8"
    m = _model(fp8)
    if -1 in schedule.changes:
        _set_frozen(m, schedule.changes[-1])
    fs, kwargs = fully_shard, {}
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("dp",))
    if runtime == "fsdp2":
        fs = torch_fully_shard
    elif runtime in ("zero1", "zero2"):
        kwargs["state_sharding"] = getattr(StateSharding, runtime)(mesh)
    elif fp8:
        kwargs["quant"] = QUANT
    for block in m:
        fs(block, mesh=mesh, reshard_after_forward=raf, **kwargs)
    fs(m, mesh=mesh, **kwargs)
    rows = _rank_rows(rank, ws)
    x, y = DATA[fp8]
    return _train(m, schedule, lambda s: [(x[s, rows], y[s, rows])])


def _frozen_steps(schedule: Schedule) -> list[int]:
    """The steps that run with ``FROZEN`` frozen and no ``.grad`` left from before."""
    frozen, out = False, []
    for s in range(-1, STEPS):
        frozen = schedule.changes.get(s, frozen)
        kept = schedule.keep_grads and s % 2 == 0  # the previous step kept zeroed grads
        if frozen and s >= 0 and not kept:
            out.append(s)
    return out


def _check(ranks: list, ref, schedule: Schedule, what: str, fp8: bool = False) -> None:
    """Against the one-process reference: the ranks' mean loss (each rank's is the mean over
    its rows), every rank's ``.grad``-less parameters and final parameters (for ``fp8``
    bitwise: the reference computes what the ranks do, see :func:`_reference`); and the
    frozen parameters bitwise unchanged by every step that ran frozen without a ``.grad``."""
    ref_losses, ref_no_grad, _, ref_params = ref
    losses = [sum(r[0][s] for r in ranks) / len(ranks) for s in range(STEPS)]
    assert losses == (ref_losses if fp8 else pytest.approx(ref_losses, abs=TOL)), what
    for _, no_grad, frozen, params in ranks:
        assert no_grad == ref_no_grad, what
        for s in _frozen_steps(schedule):
            before = frozen[s - 1] if s > 0 else INIT[fp8]
            for n in FROZEN:
                assert torch.equal(frozen[s][n], before[n]), f"{what}: step {s} moved {n}"
        for k, v in params.items():
            tol = 0.0 if fp8 else TOL
            torch.testing.assert_close(v, ref_params[k], atol=tol, rtol=0, msg=f"{what} {k}")


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_requires_grad_changed_after_fully_shard_trains_as_fsdp2_and_one_process(schedule):
    """A parameter frozen after ``fully_shard`` gets no ``.grad`` and AdamW's weight decay
    leaves it bitwise unchanged; unfrozen, it trains again: as FSDP2 and one process on the
    concatenated batch."""
    sched = SCHEDULES[schedule]
    ref = _reference(sched)
    assert ref[1][_frozen_steps(sched)[0]] == sorted(FROZEN)  # the reference froze them
    for runtime in ("fsdp2", "ours"):
        for raf in (True, False):
            ranks = run_threaded(_sharded_rank, WORLD, runtime, sched, raf)
            _check(ranks, ref, sched, f"{runtime} reshard_after_forward={raf}")


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_requires_grad_changed_after_fully_shard_under_state_sharding_and_fp8(schedule):
    """The same under ``state_sharding`` zero1 and zero2 (the gradient lands through the
    nested reductions) against one process, and with FP8 units (the unsharded parameters of
    FP8 weights are gradient sinks) against one process with the same ``FP8Linear``."""
    sched = SCHEDULES[schedule]
    ref = _reference(sched)
    for runtime in ("zero1", "zero2"):
        _check(run_threaded(_sharded_rank, WORLD, runtime, sched, True), ref, sched, runtime)
    ref_fp8 = _reference(sched, fp8=True)
    ranks = run_threaded(_sharded_rank, WORLD, "fp8", sched, True)
    _check(ranks, ref_fp8, sched, "fp8", fp8=True)


def test_fp8_reference_runs_every_fp8_gemm_as_a_rank_does(monkeypatch):
    """The one-process FP8 reference computes what the ranks compute (:func:`_reference`):
    every FP8 GEMM of its forwards and backwards has the operand shapes and the intra-op
    thread count of one of the ranks' GEMMs, the same number of times (a reference on the
    concatenated batch runs them on 8 rows, and MKL's sgemm rounds a row of an 8-row product
    otherwise than of a 4-row one on AVX-512 CPUs; with more threads, otherwise too)."""
    calls: dict[object, collections.Counter] = collections.defaultdict(collections.Counter)
    lock = threading.Lock()
    gemm = fp8_linear_module._gemm

    def recording(a_q, a_s, b_q, b_s, b_block, cfg, out_dtype):
        who = dist.get_rank() if dist.is_initialized() else "reference"
        with lock:
            calls[who][(tuple(a_q.shape), tuple(b_q.shape), torch.get_num_threads())] += 1
        return gemm(a_q, a_s, b_q, b_s, b_block, cfg, out_dtype)

    monkeypatch.setattr(fp8_linear_module, "_gemm", recording)
    sched = SCHEDULES["mid_training"]
    _reference(sched, fp8=True)
    run_threaded(_sharded_rank, WORLD, "fp8", sched, True)
    assert sum(calls[0].values()) > 0
    assert calls["reference"] == sum((calls[r] for r in range(WORLD)), collections.Counter())


def _accumulate_across_freeze(m: nn.Module, rows) -> dict[str, torch.Tensor]:
    """Backward on batch 0; freeze ``FROZEN`` (they keep their gradients) and drop the other
    gradients; backward on batch 1; drop the others again and unfreeze; backward on batch 2.
    Returns the full gradients: ``FROZEN``'s are batch 0's plus batch 2's."""
    params = dict(m.named_parameters())
    others = [p for n, p in params.items() if n not in FROZEN]
    for s in range(3):
        if s == 1:
            _set_frozen(m, True)
        if s == 2:
            _set_frozen(m, False)
        for p in others:
            p.grad = None
        x, y = rows(s)
        F.mse_loss(m(x), y).backward()
    return {n: _full(p.grad) for n, p in params.items()}


def _accumulate_rank(rank: int, ws: int, runtime: str) -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    m = _model(False)
    fs = fully_shard if runtime == "ours" else torch_fully_shard
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("dp",))
    for block in m:
        fs(block, mesh=mesh)
    fs(m, mesh=mesh)
    rows = _rank_rows(rank, ws)
    x, y = DATA[False]
    return _accumulate_across_freeze(m, lambda s: (x[s, rows], y[s, rows]))


def test_unfrozen_parameter_accumulates_into_the_gradient_it_kept():
    """A parameter frozen while it holds a gradient keeps it (its unit, wholly frozen, gets
    no gradient meanwhile and releases its flat gradient); unfrozen, its next gradient adds
    to it, as in one process and under FSDP2."""
    x, y = DATA[False]
    ref = _accumulate_across_freeze(_model(False), lambda s: (x[s], y[s]))
    for runtime in ("fsdp2", "ours"):
        for grads in run_threaded(_accumulate_rank, WORLD, runtime):
            for n, g in grads.items():
                torch.testing.assert_close(g, ref[n], atol=TOL, rtol=0, msg=f"{runtime} {n}")
