"""The large-model recipe end to end, on spawned gloo ranks, against one process and torch FSDP2.

torchtitan's order: build under ``torch.device("meta")``, ``checkpoint_wrapper`` each block,
``fully_shard`` it (bf16 parameters, fp32 gradient reduction), ``block.compile()``, then the root;
``to_empty`` and initialize the sharded parameters in place; train with ``clip_grad_norm_`` and
AdamW on the DTensor parameters; a DCP checkpoint (model and optimizer) after step 5 on 4 ranks,
resumed on 2. FSDP2 runs the same recipe in the same test; ours also runs it in fp32, where it
must equal one process.

Tolerances (measured with ``pytest tests/fsdp/test_fsdp_recipe.py -s`` on torch 2.13 CPU):

* fp32, the whole recipe against one process on the concatenated batch: 4.8e-7 on the loss over
  10 steps on 4 ranks, 2.4e-7 on the 5 steps resumed on 2 ranks; checked at 1e-5.
* bf16 parameters (fp32 reduction), ours against FSDP2 doing the same: 1.7e-4. Without
  ``clip_grad_norm_`` the two are bitwise equal (2 threaded ranks, 10 bf16 steps); with it they
  are 4.9e-4 apart there: the total norm sums per-rank squared norms over different shard
  layouts (RaggedShard row runs vs FSDP2's dim-0 chunks), so the clip coefficients differ in
  the last fp32 bits, and the bf16 casts of the parameters round some elements the other way.
  Resumed on 2 ranks against the same steps on 4: 4.8e-4 (FSDP2: 1.2e-4), other per-rank
  batches in bf16. Checked at ``BF16_VS_FSDP2``.
* bf16 against the fp32 one-process run: 2.0e-3 for ours and for FSDP2; checked at ``BF16_TOL``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import run_gloo
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_PREFIX,
    checkpoint_wrapper,
)
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2MixedPrecision
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor.experimental import implicit_replication

from ragged_placement.fsdp import MixedPrecisionPolicy, fully_shard
from ragged_placement.models import GPT, GPTConfig, StdlibCorpus

pytestmark = pytest.mark.multiprocess

WORLD = 4
RESUME_WORLD = 2
BATCH = 8
SEQ = 16
STEPS = 10
SAVE_AT = 5
LR = 1e-2
CFG = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=SEQ)
RUNS = ("ours/bf16", "fsdp2/bf16", "ours/fp32")
BF16_TOL = 5e-3
BF16_VS_FSDP2 = 1e-3


def _init_state() -> dict[str, torch.Tensor]:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return GPT(CFG).state_dict()


def _recipe(run: str, mesh) -> tuple[GPT, torch.optim.Optimizer]:
    """Meta init, checkpointing, fully_shard (bf16 parameters unless ``run`` says fp32),
    per-block compile."""
    runtime, precision = run.split("/")
    param_dtype = torch.bfloat16 if precision == "bf16" else None
    if runtime == "ours":
        shard, mp = fully_shard, MixedPrecisionPolicy(param_dtype, torch.float32)
    else:
        shard, mp = fsdp2_fully_shard, FSDP2MixedPrecision(param_dtype, torch.float32)
    with torch.device("meta"):
        m = GPT(CFG)
    for i, block in enumerate(m.layers):
        m.layers[i] = shard(checkpoint_wrapper(block), mesh=mesh, mp_policy=mp)
        m.layers[i].compile(backend="aot_eager")
    shard(m, mesh=mesh, mp_policy=mp)
    m.to_empty(device="cpu")
    init = _init_state()
    with torch.no_grad(), implicit_replication():
        for name, p in m.named_parameters():
            p.copy_(init[name.replace(_CHECKPOINT_PREFIX, "")])
    return m, torch.optim.AdamW(m.parameters(), lr=LR, foreach=False)


def _step(m: GPT, opt: torch.optim.Optimizer, corpus, step: int, rank: int, ws: int) -> float:
    per = BATCH // ws
    x, y = corpus.batch(step, BATCH, SEQ)
    loss = m(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    total = loss.detach().float()
    torch.distributed.all_reduce(total)
    return total.item() / ws


def _train_and_save(rank: int, ws: int, ckpt: str) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (ws,))
    corpus = StdlibCorpus(max_bytes=1 << 18)
    out = {}
    for run in RUNS:
        m, opt = _recipe(run, mesh)
        losses = []
        for s in range(STEPS):
            losses.append(_step(m, opt, corpus, s, rank, ws))
            if s + 1 == SAVE_AT:
                state = {"model": m.state_dict(), "optim": get_optimizer_state_dict(m, opt)}
                dcp.save(state, checkpoint_id=f"{ckpt}/{run}")
        out[run] = losses
    return out


def _resume(rank: int, ws: int, ckpt: str) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (ws,))
    corpus = StdlibCorpus(max_bytes=1 << 18)
    out = {}
    for run in RUNS:
        m, opt = _recipe(run, mesh)
        state = {"model": m.state_dict(), "optim": get_optimizer_state_dict(m, opt)}
        dcp.load(state, checkpoint_id=f"{ckpt}/{run}")
        m.load_state_dict(state["model"])
        set_optimizer_state_dict(m, opt, state["optim"])
        out[run] = [_step(m, opt, corpus, s, rank, ws) for s in range(SAVE_AT, STEPS)]
    return out


def _reference() -> list[float]:
    """One process, fp32, the concatenated batch, no checkpointing or compile."""
    m = GPT(CFG)
    m.load_state_dict(_init_state())
    opt = torch.optim.AdamW(m.parameters(), lr=LR, foreach=False)
    corpus = StdlibCorpus(max_bytes=1 << 18)
    return [_step_one_process(m, opt, corpus, s) for s in range(STEPS)]


def _step_one_process(m: GPT, opt: torch.optim.Optimizer, corpus, step: int) -> float:
    loss = m(*corpus.batch(step, BATCH, SEQ))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return loss.item()


def test_recipe_meta_checkpointing_bf16_compile_dcp_resume_matches_fsdp2_and_one_process(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    four = run_gloo(_train_and_save, WORLD, ckpt)
    two = run_gloo(_resume, RESUME_WORLD, ckpt)
    ref = _reference()
    assert all(r == four[0] for r in four) and all(r == two[0] for r in two)
    four, two = four[0], two[0]
    # fp32: the whole recipe is exact
    assert four["ours/fp32"] == pytest.approx(ref, abs=1e-5)
    assert two["ours/fp32"] == pytest.approx(ref[SAVE_AT:], abs=1e-5)
    # bf16: ours against FSDP2 and against fp32
    assert four["ours/bf16"] == pytest.approx(four["fsdp2/bf16"], abs=BF16_VS_FSDP2)
    for run in ("ours/bf16", "fsdp2/bf16"):
        assert four[run] == pytest.approx(ref, abs=BF16_TOL), run
        assert two[run] == pytest.approx(four[run][SAVE_AT:], abs=BF16_VS_FSDP2), run
    assert ref[-1] < ref[0] - 0.5  # it trains
