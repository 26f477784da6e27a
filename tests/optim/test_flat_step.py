"""The optimizer step on flat shards (``ragged_placement.optim._flat``): torch's Adam / AdamW
with ``foreach`` or ``fused`` and Muon's element-wise parts step runs of a unit's flat shard,
with the per-parameter step's numbers.

* On plain tensors: what a run is (back to back in one storage, in address order, one step
  class), state adopted into run buffers, the kept plan rejected by every change it must see,
  and the cases that fall back (shared tensors).
* On ``fully_shard`` models (2 threaded ranks): AdamW and Adam, foreach and fused, against the
  per-parameter path (:func:`~ragged_placement.optim._flat.per_parameter_step`) bitwise, torch
  FSDP2 bitwise and one process on the concatenated batch; one run per unit per call; the
  variants users write (parameter groups, weight decay on some parameters, ``amsgrad``,
  ``maximize``, a tensor ``lr``, clipping, ``zero_grad(set_to_none=False)``, freezing, a
  replaced gradient, a loaded state); state dicts, ``get/set_optimizer_state_dict`` into FSDP2
  and one process, DCP; CPU offload, FP8 units; Muon.
* On 4 gloo ranks: ``state_sharding`` zero1, zero2 and AMSP (the optimizer shard is a sub-run of
  the buffer).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from common_fsdp import ResidualMLP
from dist_utils import run_gloo, run_threaded
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from ragged_placement.fsdp import StateSharding, fully_shard
from ragged_placement.optim import Muon
from ragged_placement.optim._flat import (
    FlatStep,
    NotFlat,
    count_flat_steps,
    find_runs,
    per_parameter_step,
)
from ragged_placement.quant import BlockFP8Config

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

WORLD = 2
STEPS = 5
BATCH = 8
WIDTH = 24
TOL = 1e-5  # against one process: the gradients are averaged over ranks (fp32 rounding)


# -- runs on plain tensors ------------------------------------------------------------------------
def _views(buf: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    out, offset = [], 0
    for n in sizes:
        out.append(buf[offset : offset + n])
        offset += n
    return out


def _dense_runs(runs) -> list[list[int]]:
    return sorted(r.members[: r.dense] for r in runs)


def test_a_run_is_back_to_back_memory_in_address_order_of_one_step_class():
    """Views of one buffer listed out of order are one run in address order; a gap, another
    storage, a non-contiguous tensor or another step class starts a new one; an empty tensor
    joins a run of its class; every given list must tile the same runs."""
    buf = torch.zeros(20)
    a, b, c, d = _views(buf, [3, 4, 5, 2])
    other = torch.zeros(6)
    gap = buf[16:18]  # buf[14:16] is in none
    strided = torch.zeros(8)[::2]
    empty = buf[0:0]
    params = [c, a, other, b, strided, d, gap, empty]
    runs = find_runs([params], 1, [0] * 8)
    assert _dense_runs(runs) == [[1, 3, 0, 5], [2], [4], [6]]
    assert sorted(i for r in runs for i in r.members[r.dense :]) == [7]
    assert next(r for r in runs if r.dense == 4).numel == 14
    # the gradients of a and b in one buffer, of c and d in another: two runs
    ga, gb = _views(torch.zeros(7), [3, 4])
    gc, gd = _views(torch.zeros(7), [5, 2])
    grads = [gc, ga, torch.zeros(6), gb, torch.zeros(4), gd, torch.zeros(2), torch.zeros(0)]
    assert _dense_runs(find_runs([params, grads], 2, [0] * 8)) == [[0, 5], [1, 3], [2], [4], [6]]
    # b's step differs (and the empty parameter's, which joins b)
    runs = find_runs([params], 1, [0, 0, 0, 1, 0, 0, 0, 1])
    assert _dense_runs(runs) == [[0, 5], [1], [2], [3], [4], [6]]
    assert next(r for r in runs if r.members[0] == 3).members == [3, 7]


def _step_lists(n: int = 4):
    """``n`` parameters back to back in one buffer, their gradients in another, and state
    allocated per parameter (as torch's optimizers do)."""
    sizes = [3, 5, 2, 4][:n]
    params = _views(torch.randn(sum(sizes)), sizes)
    grads = _views(torch.randn(sum(sizes)), sizes)
    state = [torch.randn(k) for k in sizes]
    steps = [torch.tensor(2.0) for _ in sizes]
    return params, grads, state, steps


def test_state_is_adopted_into_one_buffer_per_run_and_the_plan_is_kept():
    """State that does not tile a run is copied into one buffer (values kept) and re-pointed;
    the next call over the same tensors reuses the plan: no copy, the same flat tensors."""
    params, grads, state, steps = _step_lists()
    values = [s.clone() for s in state]
    repointed = {}

    def repoint(k, i, view):
        repointed[i] = view

    with count_flat_steps() as stats:
        step = FlatStep([params, grads, state], 2, steps, repoint)
    assert stats.adopted == 4 and stats.runs == 1 and sorted(repointed) == [0, 1, 2, 3]
    assert all(torch.equal(state[i], v) for i, v in enumerate(values))  # the list is re-pointed
    assert all(state[i] is repointed[i] for i in range(4))
    flat = step.tensors[2][0]
    assert flat.numel() == 14 and flat.data_ptr() == state[0].data_ptr()
    step.steps[0].add_(1)
    step.finish()
    assert [s.item() for s in steps] == [3.0] * 4
    with count_flat_steps() as stats:
        again = FlatStep([params, grads, state], 2, steps, repoint)
    assert stats.adopted == 0 and stats.step_reads == 0
    assert again.tensors[2][0] is flat and again.tensors[0][0] is step.tensors[0][0]


def test_the_kept_plan_sees_every_change_it_must():
    """A write to a step count outside the flat step (its version), a state tensor replaced, a
    parameter re-pointed at other memory (``set_``) or gradients that no longer tile: the next
    call re-derives its runs (and reads the step values once)."""
    params, grads, state, steps = _step_lists()
    step = FlatStep([params, grads, state], 2, steps, lambda k, i, v: None)
    step.finish()
    steps[2].add_(1)  # a per-parameter step of one parameter
    with count_flat_steps() as stats:
        step = FlatStep([params, grads, state], 2, steps, lambda k, i, v: None)
    assert stats.step_reads == 1 and stats.runs == 3  # [0, 1], [2], [3]
    step.finish()
    state[0] = torch.zeros(3)  # a loaded state: its run [0, 1] is adopted again
    with count_flat_steps() as stats:
        FlatStep([params, grads, state], 2, steps, lambda k, i, v: None)
    assert stats.adopted == 2 and state[1].data_ptr() == state[0].data_ptr() + 12
    params[1].set_(torch.zeros(5))  # no longer in the buffer
    with count_flat_steps() as stats:
        FlatStep([params, grads, state], 2, steps, lambda k, i, v: None)
    assert stats.runs == 4
    grads = [g.clone() for g in grads]  # new gradients, each in its own storage
    with count_flat_steps() as stats:
        FlatStep([params, grads, state], 2, steps, lambda k, i, v: None)
    assert stats.runs == 4


def test_a_tensor_listed_twice_is_not_stepped_as_runs():
    """A step count shared by two parameters is stepped twice per step by the per-parameter
    path: ``NotFlat``, before anything changes."""
    params, grads, state, steps = _step_lists()
    steps[1] = steps[0]
    before = [s.data_ptr() for s in state]
    with pytest.raises(NotFlat):
        FlatStep([params, grads, state], 2, steps, lambda k, i, v: None)
    assert [s.data_ptr() for s in state] == before


# -- fully_shard models ---------------------------------------------------------------------------
def _block(width: int) -> ResidualMLP:
    return ResidualMLP(width, 2 * width, torch.tanh)


class Net(nn.Module):
    def __init__(self, width: int = WIDTH, blocks: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_block(width) for _ in range(blocks))
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


with torch.random.fork_rng():  # once per process: rank threads share the global RNG
    torch.manual_seed(0)
    INIT = Net().state_dict()
    _GEN = torch.Generator().manual_seed(0)
    DATA = (torch.randn(STEPS, BATCH, WIDTH, generator=_GEN),
            torch.randn(STEPS, BATCH, WIDTH, generator=_GEN))


def _net(runtime: str, mesh=None, **kwargs) -> Net:
    """The model with ``INIT``: one process (``"one"``), ours or torch FSDP2 per block and root."""
    m = Net()
    m.load_state_dict(INIT)
    if runtime != "one":
        shard = fully_shard if runtime == "ours" else torch_fully_shard
        for block in m.blocks:
            shard(block, mesh=mesh, **kwargs)
        shard(m, mesh=mesh, **kwargs)
    return m


def _local(t):
    if t is None:
        return None
    return (t._local_tensor if isinstance(t, DTensor) else t).detach().clone()


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _state(opt: torch.optim.Optimizer) -> list[dict]:
    """The optimizer state of every parameter, in order, as local tensors."""
    params = [p for g in opt.param_groups for p in g["params"]]
    return [{k: _local(v) for k, v in sorted(opt.state[p].items())} for p in params]


def _train(m: nn.Module, opt: torch.optim.Optimizer, rank: int, ws: int, variant=None,
           steps: range = range(STEPS)) -> list[float]:
    """``steps`` of ``DATA`` on this rank's rows (``variant``: hooks of a variant)."""
    x, y = DATA
    per = BATCH // ws
    rows = slice(rank * per, (rank + 1) * per)
    losses = []
    for s in steps:
        if variant is not None:
            variant.before_forward(m, opt, s)
        loss = F.mse_loss(m(x[s, rows]), y[s, rows])
        loss.backward()
        if variant is not None:
            variant.before_step(m, opt, s)
        opt.step()
        opt.zero_grad(set_to_none=variant is None or variant.set_to_none)
        losses.append(loss.item())
    return losses


# "default": neither flag, where torch picks its per-tensor loop for DTensor parameters
IMPLS = {"foreach": {"foreach": True}, "fused": {"fused": True}, "default": {}}


def _units_here(m: Net) -> int:
    """The units of ``m`` (its blocks and its root) holding elements on this rank: one run
    each, whatever its number of parameters."""
    units = [list(b.parameters()) for b in m.blocks] + [list(m.head.parameters())]
    return sum(any(p._local_tensor.numel() for p in ps) for ps in units)


def _adam_rank(rank: int, ws: int, cls_name: str, impl: str):
    mesh = init_device_mesh("cpu", (ws,))
    cls = getattr(torch.optim, cls_name)
    out = {}
    for path in ("flat", "per_parameter", "fsdp2"):
        m = _net("fsdp2" if path == "fsdp2" else "ours", mesh)
        opt = cls(m.parameters(), lr=1e-2, weight_decay=0.1, **IMPLS[impl])
        with count_flat_steps() as stats:
            if path == "per_parameter":
                with per_parameter_step():
                    losses = _train(m, opt, rank, ws)
            else:
                losses = _train(m, opt, rank, ws)
        out[path] = {
            "losses": losses,
            "params": {n: _full(p) for n, p in m.named_parameters()},
            "state": _state(opt) if path != "fsdp2" else None,
            "stats": stats,
            "units": _units_here(m) if path == "flat" else None,
        }
    return out


def _one_process(cls_name: str, impl: str) -> dict[str, torch.Tensor]:
    m = _net("one")
    opt = getattr(torch.optim, cls_name)(m.parameters(), lr=1e-2, weight_decay=0.1, **IMPLS[impl])
    _train(m, opt, 0, 1)
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def _assert_same_state(a: list[dict], b: list[dict], what: str, exact: bool = True) -> None:
    assert len(a) == len(b)
    for i, (sa, sb) in enumerate(zip(a, b)):
        assert sa.keys() == sb.keys(), what
        for k in sa:
            if exact:
                assert torch.equal(sa[k], sb[k]), f"{what}: parameter {i} {k}"
            else:
                torch.testing.assert_close(sa[k], sb[k], atol=1e-7, rtol=1e-6, msg=f"{what} {i} {k}")


# fused on CPU: torch's kernel computes the last ``numel % vector width`` elements of each tensor
# in scalar code, which rounds differently from its vector lanes
# (test_fused_cpu_kernel_rounds_tails_differently); a run puts those elements in vector lanes,
# and FSDP2's shards put others there. Measured after STEPS steps: flat vs per-parameter 3.0e-8,
# per-parameter vs FSDP2 6.0e-8, moments 1.9e-9.
FUSED_CPU_ATOL = 2e-7


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("cls_name", ["AdamW", "Adam"])
def test_adam_on_flat_shards_is_the_per_parameter_step_fsdp2_and_one_process(cls_name, impl):
    """torch's unchanged optimizer on our units steps one run per unit per call (no
    parameter left to the per-parameter path), with the per-parameter step's numbers bitwise
    (parameters, moments, step counts) and torch FSDP2's bitwise (``fused`` on CPU: to its
    kernel's rounding, see ``FUSED_CPU_ATOL``), and one process's on the concatenated batch."""
    ranks = run_threaded(_adam_rank, WORLD, cls_name, impl)
    ref = _one_process(cls_name, impl)
    exact = impl != "fused"
    for rank, out in enumerate(ranks):
        flat, per, fsdp2 = out["flat"], out["per_parameter"], out["fsdp2"]
        stats = flat["stats"]
        assert stats.calls == STEPS and stats.per_parameter == 0 and stats.step_reads == 1
        assert stats.runs == STEPS * flat["units"] and stats.elements == STEPS * len(flat["params"])
        assert per["stats"].calls == 0  # the reference took torch's path
        _assert_same_state(flat["state"], per["state"], f"rank {rank} state", exact)
        if exact:
            assert flat["losses"] == per["losses"] == fsdp2["losses"]
        for name, p in flat["params"].items():
            for path in ("per_parameter", "fsdp2"):
                if exact:
                    assert torch.equal(p, out[path]["params"][name]), f"rank {rank} {name} {path}"
                else:
                    torch.testing.assert_close(p, out[path]["params"][name], atol=FUSED_CPU_ATOL,
                                               rtol=0, msg=f"rank {rank} {name} {path}")
            torch.testing.assert_close(p, ref[name], atol=TOL, rtol=0, msg=f"{name} one process")


def test_fused_cpu_kernel_rounds_tails_differently():
    """Why ``fused`` on CPU is compared to rounding: torch's fused AdamW on one flat tensor and
    on its pieces differ only at elements in the last 15 of a piece (its scalar tail), never
    in the vector lanes."""
    from torch.optim.adam import _fused_adam

    torch.manual_seed(0)
    sizes = [1, 3, 7, 17, 64, 65, 130, 4097, 513] * 3
    flat = [torch.randn(sum(sizes)) for _ in range(4)]
    flat[3] = flat[3].abs()
    pieces = [t.clone() for t in flat]
    kwargs = dict(amsgrad=False, has_complex=False, beta1=0.9, beta2=0.999, lr=1e-3,
                  weight_decay=0.01, eps=1e-8, maximize=False, capturable=False,
                  differentiable=False, decoupled_weight_decay=True)
    for step in range(1, 4):
        _fused_adam([flat[0]], [flat[1]], [flat[2]], [flat[3]], [], [torch.tensor(float(step))],
                    None, None, **kwargs)
        split = [_views(t, sizes) for t in pieces]
        _fused_adam(split[0], split[1], split[2], split[3], [],
                    [torch.tensor(float(step)) for _ in sizes], None, None, **kwargs)
    tail = torch.cat([torch.arange(n) >= n - 15 for n in sizes])
    differ = torch.zeros_like(tail)
    for a, b in zip(flat, pieces):
        differ |= a != b
    assert differ.any()  # else the tolerance above would be needless
    assert not (differ & ~tail).any()


class Variant:
    """How a user drives AdamW: the optimizer it builds and what it does around each step."""

    set_to_none = True

    def __init__(self, name: str, **kwargs) -> None:
        self.name = name
        self.kwargs = kwargs

    def opt(self, m: Net, impl: str) -> torch.optim.Optimizer:
        return torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, **self.kwargs, **IMPLS[impl])

    def before_forward(self, m: Net, opt: torch.optim.Optimizer, step: int) -> None:
        pass

    def before_step(self, m: Net, opt: torch.optim.Optimizer, step: int) -> None:
        pass


class Groups(Variant):
    """Two groups, weight decay on the matrices only, another lr and betas for the rest."""

    def opt(self, m, impl):
        decay = [p for p in m.parameters() if p.ndim == 2]
        rest = [p for p in m.parameters() if p.ndim < 2]
        return torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0,
                                  "lr": 3e-3, "betas": (0.8, 0.95)}], lr=1e-2, weight_decay=0.1,
                                 **IMPLS[impl])


class Reversed(Variant):
    """The parameters listed in reverse (runs follow memory, not the list)."""

    def opt(self, m, impl):
        return torch.optim.AdamW(list(m.parameters())[::-1], lr=1e-2, **IMPLS[impl])


class TensorLR(Variant):
    """``lr`` as a tensor (``fused``; ``foreach`` needs ``capturable`` for it)."""

    def opt(self, m, impl):
        return torch.optim.AdamW(m.parameters(), lr=torch.tensor(1e-2), **IMPLS[impl])


class Clip(Variant):
    def before_step(self, m, opt, step):
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)


class KeepGrads(Variant):
    """``zero_grad(set_to_none=False)``: the next backward accumulates into zeroed gradients."""

    set_to_none = False


class Freeze(Variant):
    """Block 1's linear frozen for steps 1-2 (no gradient: it leaves the runs and its step
    count falls behind its unit's), trainable again from step 3."""

    def before_forward(self, m, opt, step):
        if step in (1, 3):
            m.blocks[1].fc1.requires_grad_(step == 3)


class ReplacedGrad(Variant):
    """At step 2 one gradient replaced by a copy in its own storage (it leaves its run)."""

    def before_step(self, m, opt, step):
        if step == 2:
            p = m.blocks[0].fc1.weight
            p.grad = p.grad.clone()


class LoadedState(Variant):
    """At step 3 the optimizer state loaded from a copy of its state dict (new tensors: adopted
    into run buffers again)."""

    def before_step(self, m, opt, step):
        if step == 3:
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))


VARIANTS = [
    Groups("groups"), Variant("amsgrad", amsgrad=True), Variant("maximize", maximize=True),
    Reversed("reversed"), Clip("clip"), KeepGrads("keep_grads"), Freeze("freeze"),
    ReplacedGrad("replaced_grad"), LoadedState("loaded_state"), TensorLR("tensor_lr"),
]


def _variants_rank(rank: int, ws: int, impl: str):
    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    for variant in VARIANTS:
        if isinstance(variant, TensorLR) and impl != "fused":
            continue
        res = {}
        for path in ("flat", "per_parameter"):
            m = _net("ours", mesh)
            opt = variant.opt(m, impl)
            with count_flat_steps() as stats:
                if path == "flat":
                    _train(m, opt, rank, ws, variant)
                else:
                    with per_parameter_step():
                        _train(m, opt, rank, ws, variant)
            res[path] = ({n: _local(p) for n, p in m.named_parameters()}, _state(opt), stats)
        out[variant.name] = res
    return out


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_what_users_do_around_the_step_keeps_the_per_parameter_numbers(impl):
    """Every variant (``VARIANTS``) steps runs and gives the per-parameter step's parameters,
    moments and step counts (bitwise with ``foreach``; ``fused`` on CPU to its kernel's
    rounding): groups with their own hyperparameters, weight decay on some parameters,
    ``amsgrad``, ``maximize``, a tensor ``lr``, clipping first, kept zeroed gradients,
    freezing and unfreezing, a replaced gradient, a loaded state."""
    ranks = run_threaded(_variants_rank, WORLD, impl)
    exact = impl != "fused"
    for rank, out in enumerate(ranks):
        for name, res in out.items():
            (params, state, stats), (ref_params, ref_state, ref_stats) = res["flat"], res["per_parameter"]
            what = f"rank {rank} {name}"
            assert stats.calls >= STEPS and ref_stats.calls == 0, what
            assert stats.runs < stats.elements, what
            _assert_same_state(state, ref_state, what, exact)
            for n, p in params.items():
                if exact:
                    assert torch.equal(p, ref_params[n]), f"{what} {n}"
                else:
                    torch.testing.assert_close(p, ref_params[n], atol=FUSED_CPU_ATOL, rtol=0,
                                               msg=f"{what} {n}")
            if name == "loaded_state":
                assert stats.adopted > 0, what
            if name == "freeze":  # the frozen step counts split their unit's run from step 3
                assert stats.step_reads >= 2, what


def _interop_rank(rank: int, ws: int, path: str):
    """Ours (flat step) for 3 steps; its full state dicts into one process, its DCP checkpoint
    into torch FSDP2 and into ours again; each continues for the last 2 steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    mesh = init_device_mesh("cpu", (ws,))
    first, rest = range(3), range(3, STEPS)
    full = StateDictOptions(full_state_dict=True)
    m = _net("ours", mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    _train(m, opt, rank, ws, steps=first)
    sd = opt.state_dict()
    params = list(m.parameters())
    layout = [
        (sorted(st), st["step"].shape, *((st[k].shape, st[k].placements) for k in ("exp_avg", "exp_avg_sq")))
        for st in (sd["state"][i] for i in range(len(params)))
    ]
    expected = [(["exp_avg", "exp_avg_sq", "step"], torch.Size([]), *[(p.shape, p.placements)] * 2)
                for p in params]
    steps = sorted({float(st["step"]) for st in sd["state"].values()})
    model_sd = get_model_state_dict(m, options=full)
    optim_sd = get_optimizer_state_dict(m, opt, options=full)
    dcp.save({"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)},
             checkpoint_id=path)

    one = Net()
    one_opt = torch.optim.AdamW(one.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    set_model_state_dict(one, model_sd, options=full)
    # a copy, as a checkpoint on disk would be: the state dict's step counts are the optimizer's
    # own tensors, which two optimizers sharing them would both step
    set_optimizer_state_dict(one, one_opt, copy.deepcopy(optim_sd), options=full)

    loaded = {}
    for runtime in ("fsdp2", "ours"):  # from the checkpoint
        model = _net(runtime, mesh)
        o = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, o)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, o, state["optim"])
        loaded[runtime] = (model, o)
    (fsdp2, fsdp2_opt), (resumed, resumed_opt) = loaded["fsdp2"], loaded["ours"]

    out = {"layout": (layout, expected), "steps": steps}
    with count_flat_steps() as stats:
        for name, model, o, r, w in (("ours", m, opt, rank, ws), ("fsdp2", fsdp2, fsdp2_opt, rank, ws),
                                     ("one", one, one_opt, 0, 1), ("resumed", resumed, resumed_opt, rank, ws)):
            _train(model, o, r, w, steps=rest)
            out[name] = {n: _full(p) for n, p in model.named_parameters()}
    out["stats"] = stats
    return out


def test_state_dicts_dcp_and_fsdp2_see_per_parameter_state(tmp_path):
    """After flat steps, ``state_dict()`` holds per-parameter state (each parameter's step,
    and moments that are DTensors of its shape and placements); ``get_optimizer_state_dict``'s
    full state dict loads into one process, its DCP checkpoint into torch FSDP2 and into ours,
    and each continues as ours does: FSDP2 and ours resumed bitwise, one process to 1e-5."""
    path = str(tmp_path / "ckpt")
    for rank, out in enumerate(run_threaded(_interop_rank, WORLD, path)):
        layout, expected = out["layout"]
        assert layout == expected and out["steps"] == [3.0]
        assert out["stats"].runs < out["stats"].elements  # ours and ours resumed stepped runs
        for n, p in out["ours"].items():
            assert torch.equal(out["fsdp2"][n], p), f"rank {rank} {n} FSDP2"
            assert torch.equal(out["resumed"][n], p), f"rank {rank} {n} resumed"
            torch.testing.assert_close(out["one"][n], p, atol=TOL, rtol=0, msg=f"{n} one process")


# -- Muon, CPU offload, FP8 units, per-state sharding ---------------------------------------------
class MatrixBlock(nn.Module):
    """A norm, then two matrices back to back (a unit's Muon matrices and AdamW vectors each
    lie in runs)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.q = nn.Linear(width, width, bias=False)
        self.k = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.k(torch.tanh(self.q(h)))


def _muon(m: nn.Module, nesterov: bool) -> Muon:
    matrices = [p for p in m.parameters() if p.ndim == 2]
    vectors = [p for p in m.parameters() if p.ndim < 2]
    return Muon([{"params": matrices}, {"params": vectors, "algorithm": "adamw", "lr": 3e-3}],
                lr=0.02, weight_decay=0.1, nesterov=nesterov)


def _blocks(matrices: bool, width: int) -> nn.Sequential:
    return nn.Sequential(*(MatrixBlock(width) if matrices else _block(width) for _ in range(2)))


with torch.random.fork_rng():
    torch.manual_seed(2)
    FEATURE_INIT = {(matrices, width): _blocks(matrices, width).state_dict()
                    for matrices in (False, True) for width in (WIDTH, 128)}


def _feature_model(feature: str, mesh) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The model of ``feature`` sharded by ours, and its data (``STEPS`` global batches)."""
    width = 128 if feature == "fp8" else WIDTH
    gen = torch.Generator().manual_seed(1)
    matrices = feature.startswith("muon")
    m = _blocks(matrices, width)
    m.load_state_dict(FEATURE_INIT[matrices, width])
    kwargs = {}
    if feature == "offload":
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    elif feature == "fp8":
        kwargs["quant"] = BlockFP8Config(block=(128, 128))
    elif feature in ("zero1", "zero2", "amsp"):
        kwargs["state_sharding"] = {
            "zero1": StateSharding(params=(), grads=(), optim=("inter", "intra")),
            "zero2": StateSharding(params=(), grads=("inter", "intra"), optim=("inter", "intra")),
            "amsp": StateSharding(params=("intra",), grads=("inter", "intra"), optim=("inter", "intra")),
        }[feature]
    for block in m:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(m, mesh=mesh, **kwargs)
    return m, torch.randn(STEPS, BATCH, width, generator=gen), torch.randn(STEPS, BATCH, width, generator=gen)


def _feature_rank(rank: int, ws: int, features: list[str]):
    """Per feature: the local parameters, the optimizer state and the flat-step counts after
    ``STEPS`` steps of the flat path and of the per-parameter path."""
    torch.set_num_threads(1)
    out = {}
    for feature in features:
        if feature in ("zero1", "zero2", "amsp"):
            mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("inter", "intra"))
        else:
            mesh = init_device_mesh("cpu", (ws,))
        res = {}
        for path in ("flat", "per_parameter"):
            m, x, y = _feature_model(feature, mesh)
            if feature.startswith("muon"):
                opt = _muon(m, nesterov=feature == "muon_nesterov")
            else:
                opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
            per = BATCH // ws
            reference = per_parameter_step() if path == "per_parameter" else contextlib.nullcontext()
            with count_flat_steps() as stats, reference:
                for s in range(STEPS):
                    F.mse_loss(m(x[s, rank * per : (rank + 1) * per]), y[s, rank * per : (rank + 1) * per]).backward()
                    opt.step()
                    opt.zero_grad()
            res[path] = ({n: _local(p) for n, p in m.named_parameters()}, _state(opt), stats)
        out[feature] = res
    return out


def _check_features(ranks: list[dict]) -> None:
    for rank, out in enumerate(ranks):
        for feature, res in out.items():
            (params, state, stats), (ref_params, ref_state, ref_stats) = res["flat"], res["per_parameter"]
            what = f"rank {rank} {feature}"
            assert stats.calls > 0 and ref_stats.calls == 0, what
            assert stats.runs < stats.elements and stats.per_parameter == 0, what
            _assert_same_state(state, ref_state, what)
            for n, p in params.items():
                assert torch.equal(p, ref_params[n]), f"{what} {n}"


def test_muon_cpu_offload_and_fp8_units_step_runs_with_the_per_parameter_numbers():
    """Muon (its momentum, weight decay and AdamW group on runs; Nesterov and plain
    momentum), AdamW with ``CPUOffloadPolicy`` (the runs are the host chunk's) and with FP8
    units (the runs are the chunk of the master weights): bitwise the per-parameter step."""
    _check_features(run_threaded(_feature_rank, WORLD, ["muon_nesterov", "muon", "offload", "fp8"]))


@pytest.mark.multiprocess
def test_per_state_sharding_steps_runs_of_the_optimizer_shard():
    """``state_sharding`` zero1, zero2 and AMSP on a 2x2 mesh: the optimizer shard is a sub-run
    of the buffer, and AdamW on it is bitwise the per-parameter step."""
    _check_features(run_gloo(_feature_rank, 4, ["zero1", "zero2", "amsp"]))
