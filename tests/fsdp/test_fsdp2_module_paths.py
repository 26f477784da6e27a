"""Code that branches on ``isinstance(m, torch.distributed.fsdp.FSDPModule)``, run on ours.

Our sharded modules are instances of torch's ``FSDPModule`` (issue 34): torchtitan's
``disable_fsdp_gradient_division`` (``set_gradient_divide_factor(1.0)``, the loss divided by
the global token count instead) and ``ChunkedLossWrapper`` (the output layer kept unsharded
across the loss chunks), torch's ``register_fsdp_forward_method``, ``clip_grad_norm_``, DCP's
state-dict helpers and torch ``FSDPModule``'s ``__new__`` / ``_apply`` take them for FSDP2's.
Each is checked against torch FSDP2 on the same model and data and against one process on the
concatenated batch (4 gloo ranks, one spawn: FSDP2's divide factor is a pre-multiplied sum,
which threaded ranks do not run); pipelining's path is in ``tests/compose/test_compose.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint.state_dict as dcp_sd
import torch.nn.functional as F
from dist_utils import run_gloo, run_threaded
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp import register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from ragged_placement.fsdp import fully_shard

V, D, SEQ, BATCH = 11, 8, 6, 4  # BATCH sequences per rank
TOL = dict(atol=2e-6, rtol=1e-5)
WORLD = 4


class Tiny(nn.Module):
    """An embedding, two blocks, a norm and an output layer (torchtitan's shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(2))
        self.norm = nn.RMSNorm(D)
        self.output = nn.Linear(D, V, bias=False)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.norm(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.hidden(x))


with torch.random.fork_rng():
    torch.manual_seed(0)
    INIT = Tiny().state_dict()
    TOKENS = torch.randint(0, V, (4 * BATCH, SEQ + 1))


def _model() -> Tiny:
    m = Tiny()
    m.load_state_dict(INIT)
    return m


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _shard(m: Tiny, runtime: str, mesh) -> Tiny:
    """torchtitan's order: each layer, the output layer, then the root."""
    fs = fully_shard if runtime == "ours" else torch_fully_shard
    for layer in m.layers:
        fs(layer, mesh=mesh)
    fs(m.output, mesh=mesh)
    fs(m, mesh=mesh)
    return m


def _disable_fsdp_gradient_division(model: nn.Module) -> int:
    """torchtitan 0.3.0's ``distributed.fsdp.disable_fsdp_gradient_division``, verbatim but
    for the count it returns and ``set_force_sum_reduction_for_comms(True)``, a gloo stand-in:
    FSDP2 divides by another factor with a pre-multiplied sum, which gloo does not have (ours
    always sums, then divides)."""
    n = 0
    for module in model.modules():
        if isinstance(module, TorchFSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
            n += 1
    return n


def _token_loss(logits: torch.Tensor, y: torch.Tensor, global_tokens: int) -> torch.Tensor:
    """torchtitan's: summed over this rank's tokens, divided by the global token count."""
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") / global_tokens


def _step_grads(m: nn.Module, x, y, global_tokens: int) -> tuple[dict, float]:
    _token_loss(m(x), y, global_tokens).backward()
    norm = torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=0.1)
    grads = {n: _full(p.grad) for n, p in m.named_parameters()}
    return grads, _full(norm).item()


def _reference(batch: torch.Tensor) -> tuple[dict, float]:
    m = _model()
    return _step_grads(m, batch[:, :-1], batch[:, 1:], batch[:, 1:].numel())


def _divide_factor(rank: int, ws: int, runtime: str, hsdp: bool):
    mesh = (
        init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard"))
        if hsdp
        else init_device_mesh("cpu", (ws,))
    )
    m = _shard(_model(), runtime, mesh)
    assert isinstance(m, TorchFSDPModule) and isinstance(m.output, TorchFSDPModule)
    n = _disable_fsdp_gradient_division(m)
    batch = TOKENS[: ws * BATCH]
    local = batch[rank * BATCH : (rank + 1) * BATCH]
    grads, norm = _step_grads(m, local[:, :-1], local[:, 1:], batch[:, 1:].numel())
    return n, grads, norm


def _worker(rank: int, ws: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    for runtime in ("ours", "fsdp2"):
        for hsdp in (False, True):
            out["divide", runtime, hsdp] = _divide_factor(rank, ws, runtime, hsdp)
        if _has_torchtitan():
            out["chunked", runtime] = _chunked_loss_steps(rank, ws, runtime)
    return out


def _has_torchtitan() -> bool:
    try:
        import torchtitan.components.loss  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_gloo(_worker, WORLD)


@pytest.mark.multiprocess
@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp4", "hsdp2x2"])
def test_torchtitans_gradient_divide_factor_sums_gradients_as_fsdp2(ranks, hsdp):
    """torchtitan sets factor 1.0 on every FSDPModule and divides the loss by the global token
    count: gradients are summed over the data-parallel ranks (not averaged: 1/4 of them before
    our modules were instances of torch's FSDPModule), so they, the clipped norm and the
    clipping equal FSDP2's and one process's."""
    ref_grads, ref_norm = _reference(TOKENS[: WORLD * BATCH])
    for runtime in ("ours", "fsdp2"):
        for r in ranks:
            n, grads, norm = r["divide", runtime, hsdp]
            assert n == 4, runtime  # the two layers, the output layer, the root
            assert norm == pytest.approx(ref_norm, rel=1e-5), runtime
            for k, g in grads.items():
                torch.testing.assert_close(g, ref_grads[k], **TOL, msg=f"{runtime} {k}")


# -- torchtitan's ChunkedLossWrapper: the output layer unsharded across the loss chunks ----------


def _chunked_loss_steps(rank: int, ws: int, runtime: str) -> tuple[list[float], dict]:
    """Two SGD steps through torchtitan's ``ChunkedLossWrapper`` (3 chunks per sequence)."""
    from torchtitan.components.loss import ChunkedLossWrapper

    m = _shard(_model(), runtime, init_device_mesh("cpu", (ws,)))
    _disable_fsdp_gradient_division(m)
    wrapper = ChunkedLossWrapper(ChunkedLossWrapper.Config(num_chunks=3))
    wrapper.set_lm_head(m.output)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    batch = TOKENS[: ws * BATCH]
    local = batch[rank * BATCH : (rank + 1) * BATCH]
    tokens = torch.tensor(float(batch[:, 1:].numel()))
    losses = []
    for _ in range(2):
        h = _hidden_through_root(m, local[:, :-1])
        loss, _ = wrapper(h, local[:, 1:], global_valid_tokens=tokens)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses, {k: _full(v) for k, v in m.state_dict().items()}


def _hidden_through_root(m: Tiny, x: torch.Tensor) -> torch.Tensor:
    """The root's forward without its output layer (torchtitan's ``_skip_lm_head=True``): the
    root's hooks run around it."""
    m.forward = m.hidden
    try:
        return m(x)
    finally:
        del m.forward


@pytest.mark.multiprocess
def test_torchtitans_chunked_loss_wrapper_matches_fsdp2(ranks):
    """``ChunkedLossWrapper`` sees an FSDPModule output layer: it keeps it unsharded across the
    chunks with gradient sync on for the last chunk only; two SGD steps then equal FSDP2's
    and one process's (the chunks' losses summed, divided by the global token count)."""
    if not _has_torchtitan():
        pytest.skip("torchtitan is not installed")
    batch = TOKENS[: WORLD * BATCH]
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref_losses = []
    for _ in range(2):
        loss = _token_loss(ref(batch[:, :-1]), batch[:, 1:], batch[:, 1:].numel())
        loss.backward()
        ref_losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    for runtime in ("ours", "fsdp2"):
        for _, state in (r["chunked", runtime] for r in ranks):
            for k, v in state.items():
                torch.testing.assert_close(v, ref.state_dict()[k], **TOL, msg=f"{runtime} {k}")
        # each rank's loss is its own tokens' share: the ranks' sum is the whole batch's loss
        total = [sum(x) for x in zip(*(r["chunked", runtime][0] for r in ranks))]
        assert total == pytest.approx(ref_losses, rel=1e-5), runtime


# -- torch FSDPModule's own paths: __new__, private state -------------------------------------


def _torch_module_paths(rank: int, ws: int) -> bool:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import share_comm_ctx

    mesh = init_device_mesh("cpu", (ws,))
    m = _shard(_model(), "ours", mesh)
    # torch's __new__: a container sliced into a new one is built as the original class (as
    # FSDP2's), not as a sharded class without a unit
    seq = fully_shard(nn.Sequential(nn.Linear(D, D), nn.Tanh()), mesh=mesh)
    assert type(seq[0:1]) is nn.Sequential and isinstance(seq, TorchFSDPModule)
    # what reaches FSDP2's private state raises naming it (no AttributeError inside torch)
    private = r"FSDPParamGroup.fsdp_params of FSDPLinear: torch FSDP2's private state"
    with pytest.raises(NotImplementedError, match=private):
        torch_fully_shard.state(m.output)._fsdp_param_groups[0].fsdp_params
    with pytest.raises(NotImplementedError, match=r"_get_fsdp_state\(\) of FSDPTiny"):
        with FSDPMemTracker(m):
            pass
    with pytest.raises(NotImplementedError, match=r"_get_fsdp_state\(\) of FSDPLinear"):
        share_comm_ctx([m.output])
    # a module of neither runtime: torch's lookups as before
    assert torch_fully_shard.state(nn.Linear(2, 2)) is None
    return True


def test_torch_fsdp_module_new_and_private_state_paths():
    assert all(run_threaded(_torch_module_paths, 2))
