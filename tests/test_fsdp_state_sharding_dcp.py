"""Distributed checkpoints across state shardings: a checkpoint of ``get_model_state_dict`` and
``get_optimizer_state_dict`` saved by ``torch.distributed.checkpoint`` under zero3 on 4 gloo
ranks (a 2x2 mesh) loads with ``set_model_state_dict`` / ``set_optimizer_state_dict`` under AMSP
and under hsdp on the same mesh, and into one process (full state dicts): bitwise the saved
parameters and AdamW state, and training goes on as the uninterrupted run. The other ways round
too, bitwise: AMSP's and hsdp's saves into one process, AMSP's into zero3, one process's into
AMSP. Our Muon's state (momentum, its AdamW group's moments) saved under zero3 loads bitwise
under AMSP and into one process. One gloo spawn for all of it.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from dist_utils import run_gloo
from test_fsdp_state_sharding import BATCH, BOTH, MLP, SHARDINGS, STEPS, TOL, _adamw, _data
from test_fsdp_state_sharding_optim import MUON_ATOL, _muon
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
    """Every parameter and every optimizer state tensor (``step`` included), in full, by name."""
    out = {f"param.{k}": _full(v) for k, v in m.named_parameters()}
    for fqn, state in get_optimizer_state_dict(m, opt)["state"].items():
        out.update({f"optim.{fqn}.{k}": _full(v) for k, v in state.items()
                    if isinstance(v, torch.Tensor)})
    return out


def _step(m: torch.nn.Module, opt: torch.optim.Optimizer, s: int, rows: slice) -> None:
    _, x, y = _data()
    F.mse_loss(m(x[s, rows]), y[s, rows]).backward()
    opt.step()
    opt.zero_grad()


def _model(
    mesh, sharding: StateSharding | None, optimizer: str = "adamw"
) -> tuple[MLP, torch.optim.Optimizer]:
    """A model initialised unlike the checkpoint (a load must overwrite every value) and its
    optimizer: AdamW, or our Muon (with AdamW on the biases)."""
    torch.manual_seed(7)
    m = MLP()
    if sharding is not None:
        for sub in (m.a, m.b, m):
            fully_shard(sub, mesh=mesh, state_sharding=sharding)
    return m, _adamw(m.parameters()) if optimizer == "adamw" else _muon(m)


def _save(m: torch.nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    dcp.save({"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)},
             checkpoint_id=path)


def _load(m: torch.nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    state = {"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(m, state["model"])
    set_optimizer_state_dict(m, opt, state["optim"])


def _train_and_save(mesh, rows: slice, path: str, optimizer: str) -> tuple[State, State]:
    """zero3 trains ``SAVE_AT`` steps and saves to ``path``, then goes on to ``STEPS``
    uninterrupted: the state at the save and at the end."""
    init, *_ = _data()
    m, opt = _model(mesh, SHARDINGS["zero3"], optimizer)
    m.load_state_dict(init)
    for s in range(SAVE_AT):
        _step(m, opt, s, rows)
    _save(m, opt, path)
    saved = _snapshot(m, opt)
    for s in range(SAVE_AT, STEPS):
        _step(m, opt, s, rows)
    return saved, _snapshot(m, opt)


def _load_and_resume(
    mesh, sharding: StateSharding | None, rows: slice, path: str, optimizer: str = "adamw",
    save_to: str | None = None,
) -> tuple[State, State]:
    """A fresh model loads ``path`` (and saves it again to ``save_to``), then trains from
    ``SAVE_AT`` to ``STEPS``: the state right after the load and at the end."""
    m, opt = _model(mesh, sharding, optimizer)
    _load(m, opt, path)
    loaded = _snapshot(m, opt)
    if save_to is not None:
        _save(m, opt, save_to)
    for s in range(SAVE_AT, STEPS):
        _step(m, opt, s, rows)
    return loaded, _snapshot(m, opt)


def _save_and_resume(rank: int, ws: int, ckpt: str):
    """zero3 saves; AMSP and hsdp load and save again, zero3 loads AMSP's checkpoint, AMSP the
    one-process one (AdamW); with Muon, zero3 saves and AMSP loads."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=BOTH)
    rows = slice(rank * BATCH // ws, (rank + 1) * BATCH // ws)
    out = {}
    out["saved"], out["uninterrupted"] = _train_and_save(
        mesh, rows, os.path.join(ckpt, "zero3"), "adamw"
    )
    for name in LOADERS:
        out[name, "loaded"], out[name, "resumed"] = _load_and_resume(
            mesh, SHARDINGS[name], rows, os.path.join(ckpt, "zero3"),
            save_to=os.path.join(ckpt, name),
        )
    for name, source in (("zero3", "amsp"), ("amsp", "one")):
        out[name, "loaded", source] = _load_and_resume(
            mesh, SHARDINGS[name], rows, os.path.join(ckpt, source)
        )[0]
    muon = os.path.join(ckpt, "muon_zero3")
    out["muon", "saved"], out["muon", "uninterrupted"] = _train_and_save(mesh, rows, muon, "muon")
    out["muon", "loaded"], out["muon", "resumed"] = _load_and_resume(
        mesh, SHARDINGS["amsp"], rows, muon, "muon"
    )
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


def _assert_equal(got: State, want: State, atol: float, what: str) -> None:
    assert got.keys() == want.keys(), what
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, atol=atol, rtol=0, msg=f"{what}: {k}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[object, State, list[dict]]:
    """One spawn for both tests: the checkpoint directory, the one-process save, every rank's
    results of :func:`_save_and_resume`."""
    ckpt = tmp_path_factory.mktemp("ckpt")
    one = _one_process_save(str(ckpt / "one"))
    return ckpt, one, run_gloo(_save_and_resume, 4, str(ckpt))


@pytest.mark.multiprocess
def test_dcp_across_zero3_amsp_hsdp_and_one_process(runs):
    ckpt, one, ranks = runs
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
        loaded, resumed = _load_and_resume(None, None, slice(None), str(ckpt / name))
        _assert_equal(loaded, saved, 0, f"one process loading {name}'s checkpoint")
        _assert_equal(resumed, uninterrupted, TOL, f"one process resumed from {name}")


@pytest.mark.multiprocess
def test_dcp_of_muon_across_zero3_amsp_and_one_process(runs):
    """Muon's momentum (and its AdamW group's moments) saved under zero3 load bitwise under AMSP
    and into one process, and training goes on as the uninterrupted run."""
    ckpt, _, ranks = runs
    saved, uninterrupted = ranks[0]["muon", "saved"], ranks[0]["muon", "uninterrupted"]
    assert len(saved) == 6 + 3 + 3 * 3, "6 parameters, 3 momentum buffers, 3 biases' AdamW state"
    results = [(f"rank {r}", (out["muon", "loaded"], out["muon", "resumed"]))
               for r, out in enumerate(ranks)]
    results.append(("one process",
                    _load_and_resume(None, None, slice(None), str(ckpt / "muon_zero3"), "muon")))
    for what, (loaded, resumed) in results:
        _assert_equal(loaded, saved, 0, f"muon: {what} loaded")
        _assert_equal(resumed, uninterrupted, MUON_ATOL, f"muon: {what} resumed")
