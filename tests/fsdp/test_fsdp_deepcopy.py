"""``copy.deepcopy`` of a model after ``fully_shard`` (issue 35): a clear error, as FSDP2's,
never a dead process; and the copy the error recommends (the same ``fully_shard`` calls on a
second model, then ``load_state_dict``) trains exactly as the original.

On gloo ranks (forked processes): before the fix the deep copy killed the rank with SIGSEGV
(in ``torch.nn.Parameter.__deepcopy__``, a parameter aliasing a freed flat buffer), which
fails the test here instead of killing pytest.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from common_fsdp import shard_blocks
from dist_utils import run_gloo, run_threaded
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

WORLD = 2
D = 8


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D))


def _shard(m: nn.Sequential, runtime: str, ws: int) -> None:
    shard_blocks(m, runtime, [m[0]], mesh=DeviceMesh("cpu", list(range(ws))))


def _deepcopies(rank: int, ws: int) -> list[tuple[str, str, str, str]]:
    """Each runtime, after ``fully_shard``, before and after a training step: the deep copy
    of the model and of a module holding it; ``(runtime, when, what, error)``."""
    out = []
    for runtime in ("fsdp2", "ours"):
        torch.manual_seed(0)
        m = _model()
        _shard(m, runtime, ws)
        for when in ("before forward", "after a step"):
            if when == "after a step":
                opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
                m(torch.randn(4, D)).sum().backward()
                opt.step()
            for what, obj in (("model", m), ("holder", {"model": m})):
                try:
                    copy.deepcopy(obj)
                    error = "none"
                except (AssertionError, NotImplementedError) as exc:
                    error = f"{type(exc).__name__}: {exc}"
                out.append((runtime, when, what, error))
    return out


@pytest.mark.multiprocess
def test_deepcopy_after_fully_shard_raises_as_fsdp2():
    for rank_out in run_gloo(_deepcopies, WORLD):
        assert len(rank_out) == 8
        for runtime, when, what, error in rank_out:
            if runtime == "fsdp2":
                assert error.startswith("AssertionError: FSDP does not support deepcopy"), (
                    when, what, error)
            else:
                assert error.startswith("NotImplementedError: copy.deepcopy of FSDPSequential "
                                        "after fully_shard is not supported"), (when, what)
                assert "load_state_dict(model.state_dict())" in error


def _copy_trains_as_original(rank: int, ws: int) -> list[list[float]]:
    """The recommended copy: a second model with the same ``fully_shard`` calls, loaded from
    the trained original's state dict; then both train 3 more steps on the same data. Per
    model: its full parameters after."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(rank)
    m = _model()
    _shard(m, "ours", ws)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    F.mse_loss(m(torch.randn(4, D, generator=gen)), torch.zeros(4, D)).backward()
    opt.step()
    opt.zero_grad()
    twin = _model()
    _shard(twin, "ours", ws)
    twin.load_state_dict(m.state_dict())
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # else they share moments
    data = [torch.randn(4, D, generator=gen) for _ in range(3)]
    out = []
    for model, o in ((m, opt), (twin, twin_opt)):
        for x in data:
            F.mse_loss(model(x), torch.zeros(4, D)).backward()
            o.step()
            o.zero_grad()
        out.append([p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()])
    return [[p.detach() for p in ps] for ps in out]


def test_the_copy_the_error_recommends_trains_exactly_as_the_original():
    for original, twin in run_threaded(_copy_trains_as_original, WORLD):
        assert len(original) == 4
        for a, b in zip(original, twin):
            assert torch.equal(a, b)
