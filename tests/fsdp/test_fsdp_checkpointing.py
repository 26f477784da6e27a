"""Activation checkpointing with ``fully_shard``, against one process and torch FSDP2.

Every way a user checkpoints a sharded block recomputes its forward during backward, which runs
the unit's forward hooks inside backward (or, with ``checkpoint_wrapper`` inside
``fully_shard``, reads the module's parameters with no hook at all). Each test trains the same
small GPT on 2 threaded ranks (AdamW on the DTensor parameters) and on one process over the
concatenated batch, and FSDP2 on the same model and data in the same test: fp32 losses and final
parameters within 1e-5 over 5 steps. The recomputation must not cost an all-gather: the counts
per unit per step are those of the same model without checkpointing, and FSDP2's.
"""

from __future__ import annotations

import functools
import re
import threading
from collections import Counter

import pytest
import torch
from common_fsdp import full_params, global_loss, train_steps
from dist_utils import run_gloo, run_threaded
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule as FSDP2Module
from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2MixedPrecision
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from ragged_placement.fsdp import MixedPrecisionPolicy, fully_shard
from ragged_placement.models import GPT, GPTConfig, StdlibCorpus
from ragged_placement.models.gpt import Block

WORLD = 2
BATCH = 4
SEQ = 16
STEPS = 5
LR = 1e-2
CFG = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=SEQ)
CORPUS = StdlibCorpus(max_bytes=1 << 18)
with torch.random.fork_rng():  # the same values in every spawned rank; threads share the RNG
    torch.manual_seed(0)
    INIT = GPT(CFG).state_dict()

# Ways to checkpoint the blocks. "inline", "selective" and "reentrant" call
# torch.utils.checkpoint on each (sharded) block from the model's forward; "region" checkpoints
# both blocks as one region (the first block is recomputed before its own backward starts);
# "wrapper_before" / "wrapper_after" apply checkpoint_wrapper before / after fully_shard(block).
MODES = ("inline", "selective", "reentrant", "region", "wrapper_before", "wrapper_after")

# Saves the matmuls and the slices (an op the runtime's all-gather also dispatches, so a
# collective recorded inside the region would shift the slices' replay index), recomputes the rest.
_SAVED_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.slice.Tensor}


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _narrowed_tanh(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``tanh(block(x))`` through a full-width slice of ``block(x)``: an ``aten.slice`` after
    the block's pre-forward hook (whose all-gather, which runs in the forward only, also
    slices) whose output backward needs, so the recomputation must replay it."""
    y = block(x)
    return torch.tanh(y.narrow(-1, 0, y.shape[-1]))


class _Checkpointed(nn.Module):
    """Runs ``block`` under ``torch.utils.checkpoint`` (no parameters of its own)."""

    def __init__(self, block: nn.Module, mode: str) -> None:
        super().__init__()
        self.block = block
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "selective":
            context = functools.partial(create_selective_checkpoint_contexts, _policy)
            return checkpoint(
                _narrowed_tanh, self.block, x, use_reentrant=False, context_fn=context
            )
        return checkpoint(self.block, x, use_reentrant=self.mode == "reentrant")


class _Region(nn.Module):
    """Runs all ``blocks`` as one checkpointed region."""

    def __init__(self, blocks: nn.ModuleList) -> None:
        super().__init__()
        self.blocks = blocks

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self._run, x, use_reentrant=False)


def _model(mode: str | None) -> GPT:
    m = GPT(CFG)
    m.load_state_dict(INIT)
    if mode in ("inline", "selective", "reentrant"):
        m.layers = nn.ModuleList(_Checkpointed(b, mode) for b in m.layers)
    elif mode == "region":
        m.layers = nn.ModuleList([_Region(m.layers)])
    return m


def _shard(
    m: GPT,
    runtime: str,
    mode: str | None,
    mesh: DeviceMesh,
    reshard: bool = True,
    bf16: bool = False,
) -> None:
    shard = fsdp2_fully_shard if runtime == "fsdp2" else fully_shard
    if bf16:
        policy = FSDP2MixedPrecision if runtime == "fsdp2" else MixedPrecisionPolicy
        shard = functools.partial(shard, mp_policy=policy(torch.bfloat16, torch.float32))
    shard_block = functools.partial(shard, mesh=mesh, reshard_after_forward=reshard)
    if mode in ("wrapper_before", "wrapper_after"):
        for i, block in enumerate(m.layers):
            if mode == "wrapper_before":
                m.layers[i] = shard_block(checkpoint_wrapper(block))
            else:
                m.layers[i] = checkpoint_wrapper(shard_block(block))
    else:
        for block in [b for b in m.modules() if isinstance(b, Block)]:
            shard_block(block)
    shard(m, mesh=mesh)  # the root: each runtime's default (kept from forward to backward)


def _local_batch(step: int, rank: int, ws: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = CORPUS.batch(step, BATCH, SEQ)
    n = BATCH // ws
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def _full_params(m: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters by name without checkpoint wrappers' prefixes, as full tensors."""
    return full_params(m, drop="_checkpoint_wrapped_module.")


def _batches():
    return (CORPUS.batch(step, BATCH, SEQ) for step in range(STEPS))


def _train(m: nn.Module, opt: torch.optim.Optimizer, rank: int, ws: int) -> list[float]:
    return train_steps(m, opt, _batches(), rank, ws)


def _train_sharded(rank: int, ws: int, runtime: str, mode: str | None, bf16: bool = False):
    m = _model(mode)
    _shard(m, runtime, mode, DeviceMesh("cpu", list(range(ws))), bf16=bf16)
    losses = _train(m, torch.optim.AdamW(m.parameters(), lr=LR), rank, ws)
    return losses, _full_params(m)


@functools.cache
def _reference(mode: str | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the concatenated batch, the model of ``mode`` (whose checkpointing changes
    nothing on one process; "selective" adds a tanh after each block)."""
    m = _model(mode)
    losses = train_steps(m, torch.optim.AdamW(m.parameters(), lr=LR), _batches())
    return losses, _full_params(m)


def _unwrapped(name: str) -> str:
    """A parameter's name in the plain GPT (without _Checkpointed / _Region levels)."""
    return re.sub(r"^layers\.0\.blocks\.(\d+)\.", r"layers.\1.", name).replace(".block.", ".")


# The key third of ``attn.qkv.bias`` has an exactly zero gradient (softmax is invariant to adding
# one value to every score of a query), so AdamW divides rounding noise (~1e-10) by its own
# magnitude and moves it by O(lr): any other summation order (one process vs a reduce-scatter)
# ends elsewhere. FSDP2 lands on the same values as ours there; the reference check skips it.
_NOISE_ONLY = ("attn.qkv.bias",)


def _assert_matches_reference(
    mode: str | None, losses: list[float], params: dict[str, torch.Tensor]
) -> None:
    ref_losses, ref_params = _reference(mode)
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    params = {_unwrapped(k): v for k, v in params.items()}
    ref_params = {_unwrapped(k): v for k, v in ref_params.items()}
    assert params.keys() == ref_params.keys()
    for name, ref in ref_params.items():
        if not name.endswith(_NOISE_ONLY):
            torch.testing.assert_close(params[name], ref, atol=1e-5, rtol=0, msg=name)


def _assert_same_params(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("mode", MODES)
def test_activation_checkpointing_trains_as_one_process_and_fsdp2(mode, one_torch_thread):
    ours = run_threaded(_train_sharded, WORLD, "ours", mode)[0]
    theirs = run_threaded(_train_sharded, WORLD, "fsdp2", mode)[0]
    _assert_matches_reference(mode, *ours)
    _assert_matches_reference(mode, *theirs)
    assert ours[0] == pytest.approx(theirs[0], abs=1e-6)
    _assert_same_params(ours[1], theirs[1])


@pytest.mark.parametrize("mode", ("inline", "wrapper_before"))
def test_activation_checkpointing_with_bf16_parameters_matches_fsdp2(mode, one_torch_thread):
    """bf16 all-gather and compute, fp32 reduction: the recomputation casts its inputs as the
    forward did. No one-process reference at this precision: FSDP2 is the peer (measured equal
    to the last bit on this model)."""
    ours = run_threaded(_train_sharded, WORLD, "ours", mode, True)[0]
    theirs = run_threaded(_train_sharded, WORLD, "fsdp2", mode, True)[0]
    no_checkpointing = run_threaded(_train_sharded, WORLD, "ours", None, True)[0]
    assert ours[0] == pytest.approx(theirs[0], abs=1e-5)
    assert ours[0] == pytest.approx(no_checkpointing[0], abs=1e-5)
    _assert_same_params(ours[1], theirs[1])


# -- all-gathers per unit ---------------------------------------------------------------------

_FSDP2_GATHERS: dict[int, Counter] = {}
_FSDP2_LOCK = threading.Lock()


def _counting_foreach_all_gather(fn):
    def wrapped(fsdp_params, *args, **kwargs):
        with _FSDP2_LOCK:
            _FSDP2_GATHERS.setdefault(threading.get_ident(), Counter())[id(fsdp_params)] += 1
        return fn(fsdp_params, *args, **kwargs)

    return wrapped


def _units(m: nn.Module, runtime: str) -> list[object]:
    """Each unit's key in module order: our FSDPUnit, or FSDP2's parameter list (by identity)."""
    if runtime == "ours":
        return [u for _, u in m.fsdp_units()]
    return [
        mod._get_fsdp_state()._fsdp_param_group.fsdp_params
        for mod in m.modules()
        if isinstance(mod, FSDP2Module)
    ]


def _gathers_per_step(
    rank: int, ws: int, runtime: str, mode: str | None, reshard: bool
) -> list[tuple[int, ...]]:
    m = _model(mode)
    _shard(m, runtime, mode, DeviceMesh("cpu", list(range(ws))), reshard=reshard)
    counts = []
    for step in range(3):  # the first step records the order the later ones prefetch in
        if runtime == "ours":
            for unit in _units(m, runtime):
                unit.stats.reset()
        _FSDP2_GATHERS.pop(threading.get_ident(), None)
        m(*_local_batch(step, rank, ws)).backward()
        if runtime == "ours":
            stats = [u.stats for u in _units(m, runtime)]
            counts.append(tuple((s.all_gathers, s.reduce_scatters) for s in stats))
        else:
            seen = _FSDP2_GATHERS.get(threading.get_ident(), Counter())
            counts.append(tuple(seen[id(params)] for params in _units(m, runtime)))
    return counts


def test_recomputation_gathers_each_unit_once_per_backward(monkeypatch, one_torch_thread):
    monkeypatch.setattr(
        _fsdp_param_group,
        "foreach_all_gather",
        _counting_foreach_all_gather(_fsdp_param_group.foreach_all_gather),
    )
    # (all-gathers, reduce-scatters) of the root, which keeps its parameters from forward to
    # backward, and of the blocks: gathered in forward and again in backward unless they keep
    # them too (reshard_after_forward=False)
    cases = [(mode, True) for mode in (None, *MODES)]
    cases += [(mode, False) for mode in (None, "inline", "wrapper_before")]
    for mode, reshard in cases:
        expected = ((1, 1), (1 + reshard, 1), (1 + reshard, 1))
        for ours in run_threaded(_gathers_per_step, WORLD, "ours", mode, reshard):
            assert ours == [expected] * 3, (mode, reshard)
        for theirs in run_threaded(_gathers_per_step, WORLD, "fsdp2", mode, reshard):
            assert theirs == [tuple(ag for ag, _ in expected)] * 3, (mode, reshard)


def _pairs_checkpointed(rank: int, ws: int, mode: str):
    """``reshard_after_forward=2`` on 4 ranks: training, and per unit of the last step
    (all-gathers, those over the pair)."""
    m = _model(mode)
    _shard(m, "ours", mode, DeviceMesh("cpu", list(range(ws))), reshard=2)
    opt = torch.optim.AdamW(m.parameters(), lr=LR)
    losses = _train(m, opt, rank, ws)
    units = _units(m, "ours")
    for unit in units:
        unit.stats.reset()
    m(*_local_batch(0, rank, ws)).backward()
    counts = [(u.stats.all_gathers, u.stats.post_forward_all_gathers) for u in units]
    return losses, _full_params(m), counts


@pytest.mark.parametrize("mode", ("inline", "region"))
def test_recomputation_with_reshard_to_pairs_gathers_once_over_the_pair(mode, one_torch_thread):
    """A recomputed forward (for "region", the first block's, before its own backward)
    re-gathers from the post-forward shard over the pair, once per backward."""
    for losses, params, counts in run_threaded(_pairs_checkpointed, 4, mode):
        _assert_matches_reference(mode, losses, params)
        assert counts == [(1, 0), (2, 1), (2, 1)]  # the root, then the two blocks


# -- gloo integration -------------------------------------------------------------------------


def _gloo_recipe(rank: int, ws: int) -> dict[str, list[float]]:
    """torchtitan's order (checkpoint_wrapper, then fully_shard) and selective checkpointing
    inside forward, ours and FSDP2, on real processes."""
    torch.set_num_threads(1)
    return {
        f"{runtime}/{mode}": _train_sharded(rank, ws, runtime, mode)[0]
        for runtime, mode in (
            ("ours", "wrapper_before"), ("fsdp2", "wrapper_before"), ("ours", "selective")
        )
    }


def test_activation_checkpointing_on_gloo_world_4():
    results = run_gloo(_gloo_recipe, 4)
    for key, losses in results[0].items():
        ref_losses, _ = _reference(key.split("/")[1])
        assert losses == pytest.approx(ref_losses, abs=1e-5), key
    assert all(r == results[0] for r in results)


# -- model.parameters() outside forward and backward --------------------------------------------


def _optimizer_after_forward(
    rank: int, ws: int, runtime: str, mode: str | None, reshard: bool
) -> tuple[bool, list[float], dict[str, torch.Tensor]]:
    """A forward with grad and no backward, then the optimizer is built, then training."""
    m = _model(mode)
    _shard(m, runtime, mode, DeviceMesh("cpu", list(range(ws))), reshard=reshard)
    m(*_local_batch(0, rank, ws))
    params = list(m.parameters())
    all_sharded = all(isinstance(p, DTensor) for p in params)
    losses = _train(m, torch.optim.AdamW(params, lr=LR), rank, ws)
    return all_sharded, losses, _full_params(m)


def test_optimizer_built_after_a_forward_trains_as_one_process_unlike_fsdp2(one_torch_thread):
    """``model.parameters()`` after a forward with grad (no backward) gives the sharded
    parameters, with and without activation checkpointing and whatever
    ``reshard_after_forward``: an optimizer built then trains exactly as one process."""
    for mode, reshard in ((None, True), (None, False), ("inline", True), ("wrapper_before", True)):
        for all_sharded, losses, params in run_threaded(
            _optimizer_after_forward, WORLD, "ours", mode, reshard
        ):
            assert all_sharded, (mode, reshard)
            _assert_matches_reference(mode, losses, params)
    # FSDP2 registers the root's unsharded parameters there and its optimizer steps those, which
    # the next all-gather overwrites: the root's parameters never train.
    all_sharded, losses, _ = run_threaded(_optimizer_after_forward, WORLD, "fsdp2", None, True)[0]
    assert not all_sharded
    assert max(abs(a - b) for a, b in zip(losses, _reference()[0])) > 1e-3


def _forward_between_backward_and_step(rank: int, ws: int, runtime: str):
    """Each step logs a second loss with grad on (no backward) before the optimizer step: the
    root still holds the values gathered before the step when the next forward starts."""
    m = _model(None)
    _shard(m, runtime, None, DeviceMesh("cpu", list(range(ws))))
    opt = torch.optim.AdamW(m.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        batch = _local_batch(step, rank, ws)
        m(*batch).backward()
        loss = m(*batch)
        opt.step()
        opt.zero_grad()
        losses.append(global_loss(loss, ws))
    return losses, _full_params(m)


def test_forward_without_backward_before_the_step_regathers_after_it(one_torch_thread):
    ours = run_threaded(_forward_between_backward_and_step, WORLD, "ours")[0]
    _assert_matches_reference(None, *ours)
    # FSDP2's root keeps the all-gather of that forward and the next forward reuses it: from the
    # second step on its root parameters are one optimizer step behind.
    losses, _ = run_threaded(_forward_between_backward_and_step, WORLD, "fsdp2")[0]
    assert max(abs(a - b) for a, b in zip(losses, _reference()[0])) > 1e-3
