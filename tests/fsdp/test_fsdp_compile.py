"""``torch.compile`` with ``fully_shard``: per block (torchtitan's order) and whole model.

Each test trains the same model on 2 threaded ranks under our runtime and under torch FSDP2,
compiled the same way, and counts what Dynamo produced with a backend that records every graph
it is handed (per rank) and every call of a compiled graph, plus Dynamo's graph-break counter.
Our hooks run eagerly around the compiled block compute (``ragged_placement.fsdp._dynamo``), so
the counts must equal FSDP2's: per-block compile is one graph per rank (both blocks share it)
and no graph break. Losses and parameters are compared with our eager run and the one-process
reference on the concatenated batch.

Dynamo under threaded ranks: compilation is serialized by Dynamo's global lock; each rank's
thread compiles its own graph (its guards fail on the other thread's thread-local state), for
FSDP2 and for us alike, so the per-rank counts are deterministic. Dynamo's counters are
process-wide and summed over both ranks.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from common_fsdp import global_loss, rows, train_steps
from dist_utils import run_threaded
from torch._dynamo.backends.registry import lookup_backend
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_PREFIX,
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

from ragged_placement.fsdp import fully_shard
from ragged_placement.models import GPT, GPTConfig, StdlibCorpus

WORLD = 2
BATCH = 4
SEQ = 8
STEPS = 5
CFG = GPTConfig(n_layer=2, n_embd=16, n_head=2, block_size=SEQ)
CORPUS = StdlibCorpus(max_bytes=1 << 14)
# SGD with momentum, not Adam: the attention's key bias has an exactly zero gradient (softmax
# ignores a shift shared by all keys), which Adam normalizes to an lr-sized step of rounding
# noise (2.3e-5 off the reference after 5 steps, for FSDP2 as for us).
LR = 0.2
torch.manual_seed(0)
INIT = GPT(CFG).state_dict()  # built once: threads must not race on the global RNG


class _CountingBackend:
    """A Dynamo backend that compiles with ``inner`` and counts, per rank, the graphs it is
    handed and the calls of the compiled graphs."""

    def __init__(self, inner: str) -> None:
        self.inner = lookup_backend(inner)
        self.graphs: Counter[int] = Counter()
        self.calls: Counter[int] = Counter()
        self._lock = threading.Lock()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        with self._lock:
            self.graphs[dist.get_rank()] += 1
        compiled = self.inner(gm, example_inputs)

        def run(*args: Any) -> Any:
            with self._lock:
                self.calls[dist.get_rank()] += 1
            return compiled(*args)

        return run


@dataclass
class _Run:
    losses: list[float]
    params: dict[str, torch.Tensor]  # full values after training


def _model() -> GPT:
    m = GPT(CFG)
    m.load_state_dict(INIT)
    return m


def _optimizer(m: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9, foreach=False)


def _reference(steps: int) -> _Run:
    """One process, the concatenated batch, eager."""
    m = _model()
    losses = train_steps(m, _optimizer(m), (CORPUS.batch(s, BATCH, SEQ) for s in range(steps)))
    return _Run(losses, {n: p.detach().clone() for n, p in m.named_parameters()})


def _train(
    rank: int, ws: int, runtime: str, compile_mode: str | None, backend, steps: int,
    checkpoint: str | None = None,
) -> _Run:
    """``checkpoint``: ``checkpoint_wrapper`` on every block ``"before"`` ``fully_shard``
    (torchtitan's order: the recomputation is inside the compiled block) or ``"after"`` it and
    the compile (the compiled block runs again in backward)."""
    m = _model()
    mesh = DeviceMesh("cpu", list(range(ws)))
    shard = fsdp2_fully_shard if runtime == "fsdp2" else fully_shard
    if checkpoint == "before":
        for i, block in enumerate(m.layers):
            m.layers[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    for i, block in enumerate(m.layers):
        shard(block, mesh=mesh)
        if compile_mode == "block":
            block.compile(backend=backend)  # torchtitan's order: fully_shard, then compile
        if checkpoint == "after":
            m.layers[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    shard(m, mesh=mesh)
    model = torch.compile(m, backend=backend) if compile_mode == "model" else m
    batches = (CORPUS.batch(s, BATCH, SEQ) for s in range(steps))
    if compile_mode == "step":
        losses = _train_compiled_steps(m, batches, rank, ws, backend)
    else:
        losses = train_steps(model, _optimizer(m), batches, rank, ws)
    return _Run(
        losses,
        {n.replace(_CHECKPOINT_PREFIX, ""): p.full_tensor() for n, p in m.named_parameters()},
    )


def _hooks_handed_to_dynamo() -> list[str]:
    """The runtime's hooks (the methods of ``FSDPState``, which module hooks and autograd call:
    the forward and backward hooks, the per-parameter gradient hooks, the root's final
    callback) whose frames Dynamo was handed to compile since its last reset
    (``convert_frame.input_codes``)."""
    from torch._dynamo.convert_frame import input_codes

    from ragged_placement.fsdp.state import FSDPState

    found = []
    for name, member in vars(FSDPState).items():
        code = getattr(getattr(member, "_fn", member), "__code__", None)
        if code is not None and code in input_codes:
            found.append(name)
    return found


def _forward_backward(model: torch.nn.Module, *batch: torch.Tensor) -> torch.Tensor:
    loss = model(*batch)
    loss.backward()
    return loss.detach()


def _train_compiled_steps(m: torch.nn.Module, batches, rank: int, ws: int, backend) -> list[float]:
    """Forward and backward in one compiled function: Dynamo breaks the graph at
    ``.backward()`` and runs it with its frame callback still set, so every hook the backward
    calls (the per-parameter gradient hooks included) must keep Dynamo out by itself."""
    step, opt, losses = torch.compile(_forward_backward, backend=backend), _optimizer(m), []
    for batch in batches:
        loss = step(m, *(rows(t, rank, ws) for t in batch))
        opt.step()
        opt.zero_grad()
        losses.append(global_loss(loss, ws))
    return losses


@dataclass
class _Compiled:
    runs: list[_Run]
    graphs: Counter[int]  # per rank
    calls: Counter[int]  # per rank
    graph_breaks: int  # both ranks


def _compiled(
    runtime: str, compile_mode: str, backend: str, steps: int = STEPS, checkpoint: str | None = None
) -> _Compiled:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    counting = _CountingBackend(backend)
    # A cold inductor compile of a block takes tens of seconds on a busy 2-core machine.
    timeout = 600.0 if backend == "inductor" else 120.0
    runs = run_threaded(
        _train, WORLD, runtime, compile_mode, counting, steps, checkpoint, timeout=timeout
    )
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    return _Compiled(runs, counting.graphs, counting.calls, breaks)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _assert_close(run: _Run, expected: _Run, tol: float) -> None:
    assert run.losses == pytest.approx(expected.losses, abs=tol)
    assert run.params.keys() == expected.params.keys()
    for name, p in run.params.items():
        torch.testing.assert_close(p, expected.params[name], atol=tol, rtol=0, msg=name)


def test_per_block_compile_is_one_graph_per_block_no_break_and_eager_exact(one_torch_thread):
    ours = _compiled("ours", "block", "aot_eager")
    theirs = _compiled("fsdp2", "block", "aot_eager")
    # What Dynamo produced: the same as FSDP2, one graph (shared by the blocks) and no break.
    assert ours.graphs == theirs.graphs == Counter({r: 1 for r in range(WORLD)})
    assert ours.graph_breaks == theirs.graph_breaks == 0
    # The compiled block compute really runs: once per block per step on each rank.
    assert ours.calls == theirs.calls == Counter({r: CFG.n_layer * STEPS for r in range(WORLD)})
    eager = run_threaded(_train, WORLD, "ours", None, None, STEPS)
    ref = _reference(STEPS)
    for run in ours.runs:
        _assert_close(run, eager[0], 1e-5)
        _assert_close(run, ref, 1e-5)
        _assert_close(run, theirs.runs[0], 1e-5)
    assert ref.losses[-1] < ref.losses[0]  # it trains


def test_whole_model_compile_matches_fsdp2_counts_and_is_eager_exact(one_torch_thread):
    ours = _compiled("ours", "model", "aot_eager")
    theirs = _compiled("fsdp2", "model", "aot_eager")
    assert ours.graphs == theirs.graphs
    assert ours.calls == theirs.calls
    assert ours.graph_breaks == theirs.graph_breaks
    assert sum(ours.calls.values()) > 0
    ref = _reference(STEPS)
    for run in ours.runs:
        _assert_close(run, ref, 1e-5)
        _assert_close(run, theirs.runs[0], 1e-5)


@pytest.mark.parametrize("checkpoint", ["before", "after"])
def test_per_block_compile_with_activation_checkpointing_matches_fsdp2(one_torch_thread, checkpoint):
    """checkpoint_wrapper before fully_shard and compile: the recomputation is part of the
    compiled block; after them: the compiled block runs again in backward (one more call per
    block per step, no new graph). Counts equal FSDP2's, training is exact."""
    ours = _compiled("ours", "block", "aot_eager", checkpoint=checkpoint)
    theirs = _compiled("fsdp2", "block", "aot_eager", checkpoint=checkpoint)
    calls = CFG.n_layer * STEPS * (2 if checkpoint == "after" else 1)
    assert ours.graphs == theirs.graphs == Counter({r: 1 for r in range(WORLD)})
    assert ours.graph_breaks == theirs.graph_breaks == 0
    assert ours.calls == theirs.calls == Counter({r: calls for r in range(WORLD)})
    ref = _reference(STEPS)
    for run in ours.runs:
        _assert_close(run, ref, 1e-5)
        _assert_close(run, theirs.runs[0], 1e-5)


# Inductor generates fused C++ kernels (fp32 rounding other than eager's op-by-op kernels), so it
# is compared within a tolerance. Measured on this model (torch 2.13 CPU, 5 steps): 4.8e-7 on the
# losses and 3.0e-7 on the parameters against the reference and our eager run, and bitwise equal
# to FSDP2 compiled by inductor.
INDUCTOR_TOL = 1e-5


def test_per_block_inductor_matches_eager_and_fsdp2(one_torch_thread):
    ours = _compiled("ours", "block", "inductor")
    theirs = _compiled("fsdp2", "block", "inductor")
    assert ours.graphs == theirs.graphs == Counter({r: 1 for r in range(WORLD)})
    assert ours.graph_breaks == theirs.graph_breaks == 0
    assert ours.calls == theirs.calls == Counter({r: CFG.n_layer * STEPS for r in range(WORLD)})
    ref = _reference(STEPS)
    for run in ours.runs:
        _assert_close(run, ref, INDUCTOR_TOL)
        _assert_close(run, theirs.runs[0], INDUCTOR_TOL)


def test_backward_inside_a_compiled_function_compiles_no_hook_and_matches_fsdp2(one_torch_thread):
    """The hooks a backward runs under Dynamo's frame callback (its graph break at
    ``.backward()``) stay eager: Dynamo is handed none of their frames, ours gives FSDP2's
    graphs and compiled calls (the graph breaks are Dynamo's per-reason counts over both rank
    threads, which vary between runs for FSDP2 as for us), and the one-process reference's
    numbers."""
    ours = _compiled("ours", "step", "aot_eager")
    assert _hooks_handed_to_dynamo() == []
    theirs = _compiled("fsdp2", "step", "aot_eager")
    assert ours.graphs == theirs.graphs
    assert ours.calls == theirs.calls
    ref = _reference(STEPS)
    for run in ours.runs:
        _assert_close(run, ref, 1e-5)
        _assert_close(run, theirs.runs[0], 1e-5)
