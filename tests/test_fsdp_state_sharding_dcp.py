"""Distributed checkpoints across state shardings: a checkpoint of ``get_model_state_dict`` and
``get_optimizer_state_dict`` saved by ``torch.distributed.checkpoint`` under zero3 on 4 gloo
ranks (a 2x2 mesh) loads with ``set_model_state_dict`` / ``set_optimizer_state_dict`` under AMSP
and under hsdp on the same mesh, and into one process (full state dicts): bitwise the saved
parameters and AdamW state, and training goes on as the uninterrupted run. The other ways round
too, bitwise: AMSP's and hsdp's saves into one process, AMSP's into zero3, one process's into
AMSP.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from dist_utils import run_gloo
from test_fsdp_state_sharding import BATCH, BOTH, MLP, SHARDINGS, STEPS, TOL, _adamw, _data
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from ragged_placement.fsdp import StateSharding, fully_shard

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),  # tests/conftest.py
    # the one-process load: dcp.load without a process group says it loads in one process
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]

SAVE_AT = 2  # steps before the checkpoint; training goes on to STEPS
LOADERS = ("amsp", "hsdp")
State = dict[str, torch.Tensor]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def _snapshot(m: torch.nn.Module, opt: torch.optim.Optimizer) -> State:
    """Every parameter and every AdamW state tensor (``step`` included), in full, by name."""
    out = {f"param.{k}": _full(v) for k, v in m.named_parameters()}
    names = {id(p): k for k, p in m.named_parameters()}
    for p, state in opt.state.items():
        out.update({f"optim.{names[id(p)]}.{key}": _full(v) for key, v in state.items()})
    return out


def _step(m: torch.nn.Module, opt: torch.optim.Optimizer, s: int, rows: slice) -> None:
    _, x, y = _data()
    F.mse_loss(m(x[s, rows]), y[s, rows]).backward()
    opt.step()
    opt.zero_grad()


def _model(mesh, sharding: StateSharding | None) -> tuple[MLP, torch.optim.Optimizer]:
    """A model initialised unlike the checkpoint (a load must overwrite every value)."""
    torch.manual_seed(7)
    m = MLP()
    if sharding is not None:
        for sub in (m.a, m.b, m):
            fully_shard(sub, mesh=mesh, state_sharding=sharding)
    return m, _adamw(m.parameters())


def _save(m: torch.nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    dcp.save({"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)},
             checkpoint_id=path)


def _load(m: torch.nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    state = {"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(m, state["model"])
    set_optimizer_state_dict(m, opt, state["optim"])


def _save_and_resume(rank: int, ws: int, ckpt: str):
    """zero3 trains ``SAVE_AT`` steps, saves, and goes on to ``STEPS`` uninterrupted; AMSP and
    hsdp load its checkpoint, save it again and go on from ``SAVE_AT``; zero3 loads AMSP's
    checkpoint and AMSP the one-process one."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=BOTH)
    rows = slice(rank * BATCH // ws, (rank + 1) * BATCH // ws)
    init, *_ = _data()
    m, opt = _model(mesh, SHARDINGS["zero3"])
    m.load_state_dict(init)
    for s in range(SAVE_AT):
        _step(m, opt, s, rows)
    _save(m, opt, os.path.join(ckpt, "zero3"))
    out = {"saved": _snapshot(m, opt)}
    for s in range(SAVE_AT, STEPS):
        _step(m, opt, s, rows)
    out["uninterrupted"] = _snapshot(m, opt)
    for name in LOADERS:
        m, opt = _model(mesh, SHARDINGS[name])
        _load(m, opt, os.path.join(ckpt, "zero3"))
        out[name, "loaded"] = _snapshot(m, opt)
        _save(m, opt, os.path.join(ckpt, name))
        for s in range(SAVE_AT, STEPS):
            _step(m, opt, s, rows)
        out[name, "resumed"] = _snapshot(m, opt)
    for name, source in (("zero3", "amsp"), ("amsp", "one")):
        m, opt = _model(mesh, SHARDINGS[name])
        _load(m, opt, os.path.join(ckpt, source))
        out[name, "loaded", source] = _snapshot(m, opt)
    return out


def _one_process_save(ckpt: str) -> State:
    """One process trains ``SAVE_AT`` steps on the whole batch and saves (full state dicts)."""
    init, *_ = _data()
    m, opt = _model(None, None)
    m.load_state_dict(init)
    for s in range(SAVE_AT):
        _step(m, opt, s, slice(None))
    _save(m, opt, ckpt)
    return _snapshot(m, opt)


def _one_process_load(ckpt: str) -> tuple[State, State]:
    """The checkpoint loaded into one process (full state dicts): the state right after the load,
    and after training on the whole batch from ``SAVE_AT`` to ``STEPS``."""
    m, opt = _model(None, None)
    _load(m, opt, ckpt)
    loaded = _snapshot(m, opt)
    for s in range(SAVE_AT, STEPS):
        _step(m, opt, s, slice(None))
    return loaded, _snapshot(m, opt)


def _assert_equal(got: State, want: State, atol: float, what: str) -> None:
    assert got.keys() == want.keys(), what
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, atol=atol, rtol=0, msg=f"{what}: {k}")


@pytest.mark.multiprocess
def test_dcp_across_zero3_amsp_hsdp_and_one_process(tmp_path):
    one = _one_process_save(str(tmp_path / "one"))
    ranks = run_gloo(_save_and_resume, 4, str(tmp_path))
    saved, uninterrupted = ranks[0]["saved"], ranks[0]["uninterrupted"]
    assert len(saved) == 6 * 4, "3 weights and 3 biases, each with step, exp_avg, exp_avg_sq"
    for rank, out in enumerate(ranks):
        _assert_equal(out["saved"], saved, 0, f"rank {rank} zero3 at save")
        for name in LOADERS:
            _assert_equal(out[name, "loaded"], saved, 0, f"rank {rank} {name} loaded")
            _assert_equal(out[name, "resumed"], uninterrupted, TOL, f"rank {rank} {name} resumed")
        _assert_equal(out["zero3", "loaded", "amsp"], saved, 0, f"rank {rank} zero3 from amsp")
        _assert_equal(out["amsp", "loaded", "one"], one, 0, f"rank {rank} amsp from one process")
    for name in ("zero3", *LOADERS):
        loaded, resumed = _one_process_load(str(tmp_path / name))
        _assert_equal(loaded, saved, 0, f"one process loading {name}'s checkpoint")
        _assert_equal(resumed, uninterrupted, TOL, f"one process resumed from {name}")
