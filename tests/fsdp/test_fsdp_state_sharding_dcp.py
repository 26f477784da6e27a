"""Distributed checkpoints across state shardings: a checkpoint of ``get_model_state_dict`` and
``get_optimizer_state_dict`` saved by ``torch.distributed.checkpoint`` under zero3 on 4 gloo
ranks (a 2x2 mesh) loads with ``set_model_state_dict`` / ``set_optimizer_state_dict`` under AMSP
and under hsdp on the same mesh, and into one process (full state dicts): bitwise the saved
parameters and AdamW state, and training goes on as the uninterrupted run. The other ways round
too, bitwise: AMSP's and hsdp's saves into one process, AMSP's into zero3, one process's into
AMSP. Our Muon's state (momentum, its AdamW group's moments) and Shampoo's (each row slab's
statistics, roots and grafting moments, on the slab's owner) saved under zero3 load bitwise under
AMSP and into one process. One gloo spawn for all of it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from common.state_sharding import (
    BATCH,
    BOTH,
    MLP,
    MUON_ATOL,
    OPTIMIZERS,
    SHAMPOO_ATOL,
    SHARDINGS,
    STEPS,
    TOL,
    B,
    mlp_adamw,
    mlp_data,
)
from dist_utils import run_gloo
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


def _tensors(prefix: str, obj: object) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors in ``obj`` (nested dicts and lists: Shampoo's slab state) by dotted path."""
    if isinstance(obj, torch.Tensor):
        yield prefix, _full(obj)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(f"{prefix}.{k}", v)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _tensors(f"{prefix}.{i}", v)


def _snapshot(m: torch.nn.Module, opt: torch.optim.Optimizer) -> State:
    """Every parameter and every optimizer state tensor (``step`` included) this rank holds, in
    full (DTensors) or as they are (Shampoo's slab state, on its owner only), by name."""
    out = {f"param.{k}": _full(v) for k, v in m.named_parameters()}
    out.update(_tensors("optim", get_optimizer_state_dict(m, opt)["state"]))
    return out


def _union(states: Sequence[State]) -> State:
    """The ranks' snapshots as one: a name on several ranks must hold the same value on each."""
    out: State = {}
    for state in states:
        for k, v in state.items():
            if k in out:
                torch.testing.assert_close(v, out[k], atol=0, rtol=0, msg=k)
            out[k] = v
    return out


def _step(m: torch.nn.Module, opt: torch.optim.Optimizer, s: int, rows: slice) -> None:
    _, x, y = mlp_data()
    F.mse_loss(m(x[s, rows]), y[s, rows]).backward()
    opt.step()
    opt.zero_grad()


def _model(
    mesh, sharding: StateSharding | None, optimizer: str = "adamw"
) -> tuple[MLP, torch.optim.Optimizer]:
    """A model initialised unlike the checkpoint (a load must overwrite every value) and its
    optimizer: AdamW, or ours (``OPTIMIZERS``: Muon with AdamW on the biases, Shampoo)."""
    torch.manual_seed(7)
    m = MLP()
    if sharding is not None:
        for sub in (m.a, m.b, m):
            fully_shard(sub, mesh=mesh, state_sharding=sharding)
    return m, mlp_adamw(m.parameters()) if optimizer == "adamw" else OPTIMIZERS[optimizer](m)


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
    init, *_ = mlp_data()
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
    one-process one (AdamW); with Muon and with Shampoo, zero3 saves and AMSP loads."""
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
    for name in OPTIMIZERS:
        path = os.path.join(ckpt, f"{name}_zero3")
        out[name, "saved"], out[name, "uninterrupted"] = _train_and_save(mesh, rows, path, name)
        out[name, "loaded"], out[name, "resumed"] = _load_and_resume(
            mesh, SHARDINGS["amsp"], rows, path, name
        )
    return out


def _one_process_save(ckpt: str) -> State:
    """One process trains ``SAVE_AT`` steps on the whole batch and saves (full state dicts)."""
    init, *_ = mlp_data()
    m, opt = _model(None, None)
    m.load_state_dict(init)
    for s in range(SAVE_AT):
        _step(m, opt, s, slice(None))
    _save(m, opt, ckpt)
    return _snapshot(m, opt)


def _weights() -> list[torch.Tensor]:
    return [p for p in MLP().parameters() if p.ndim == 2]


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
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_dcp_of_muon_and_shampoo_across_zero3_amsp_and_one_process(runs, optimizer):
    """Muon's momentum (and its AdamW group's moments), Shampoo's statistics, roots and grafting
    moments (each row slab's on its owner rank) saved under zero3 load bitwise under AMSP and
    into one process, and training goes on as the uninterrupted run."""
    ckpt, _, ranks = runs
    saved, uninterrupted, loaded, resumed = (
        _union([out[optimizer, what] for out in ranks])
        for what in ("saved", "uninterrupted", "loaded", "resumed")
    )
    # Shampoo: per row slab, L, R and their roots per column block, and 2 grafting moments
    blocks = sum(-(-r // B) * (4 * -(-c // B) + 2) for r, c in (p.shape for p in _weights()))
    assert sum(".blocks." in k for k in saved) == (0 if optimizer == "muon" else blocks)
    one = _load_and_resume(None, None, slice(None), str(ckpt / f"{optimizer}_zero3"), optimizer)
    atol = MUON_ATOL if optimizer == "muon" else SHAMPOO_ATOL
    for what, (got, after) in (("AMSP", (loaded, resumed)), ("one process", one)):
        _assert_equal(got, saved, 0, f"{optimizer}: {what} loaded")
        params = {k: v for k, v in after.items() if k.startswith("param.")}
        _assert_equal(params, {k: uninterrupted[k] for k in params}, atol,
                      f"{optimizer}: {what} resumed")
