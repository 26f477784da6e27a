"""Expert parallelism composed with FSDP on the MoE model, against one process.

The reference is the same :class:`MoETransformer` in one process on the concatenated batch; the
distributed runs (4 gloo ranks) shard experts by expert over ``ep`` and FSDP over the rest, with
ours or torch's FSDP2 (torchtitan's pattern). The router is initialized so that no top-k
decision is a near tie: every step of the reference asserts that, for every token of every MoE
layer, the k-th and (k+1)-th router scores differ by at least ``MARGIN``, so a distributed run
whose scores match to rounding picks the same experts and the comparison is exact, not
statistical.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from common.moe import AMSP, BATCH, CFG, STEPS, WORLD, batches, full_state, loss_of, make_model
from common_fsdp import global_loss
from dist_utils import recording_collectives, run_gloo, run_threaded
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.experimental import implicit_replication

from ragged_placement.fsdp import StateSharding
from ragged_placement.fsdp import fully_shard as ours_fully_shard
from ragged_placement.models.moe import (
    GroupedExperts,
    MoE,
    MoEConfig,
    MoETransformer,
    RouterGate,
    TopKRouter,
    run_experts,
    update_expert_bias,
)
from ragged_placement.parallelize import parallelize_moe
from ragged_placement.quant import BlockFP8Config, convert_to_fp8_linear, fp8_linear
from ragged_placement.testing.profiling import CollectiveMeter

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

LR, WD = 3e-3, 0.1
# AdamW moves an entry by lr * err / (|g| + eps) for a gradient error err: with torch's eps=1e-8
# entries whose gradient is numerically zero (about 1e-9, its sign set by rounding) move by up to
# 4e-5 in 5 steps, in ours and in torch FSDP2 alike; eps=1e-6 bounds that below the tolerance.
EPS = 1e-6
MARGIN = 1e-4  # smallest gap between the k-th and (k+1)-th router score the reference allows
ATOL = 1e-5
GRAD_ATOL = 1e-7  # the first step's gradients (the largest is about 1e-2)


def _record_margins(model: nn.Module) -> list[float]:
    """Install hooks that append, per router call, the smallest gap between the k-th and the
    (k+1)-th choice score (score plus expert bias) over its tokens."""
    margins: list[float] = []

    def hook(router: TopKRouter, args, out) -> None:
        x, bias = args
        scores = router.scores(x).detach()
        if bias is not None:
            scores = scores + bias
        top = torch.topk(scores, router.top_k + 1, dim=-1).values
        margins.append((top[:, -2] - top[:, -1]).min().item())

    for m in model.modules():
        if isinstance(m, TopKRouter):
            m.register_forward_hook(hook)
    return margins


# Variants of the training loop, the same in one process and distributed:
# "plain"; "accum": two microbatches per step; "blocked": DeepSeek-V3's expert bias updated every
# step, and at step BLOCKED_STEP expert BLOCKED of every MoE layer gets a bias that keeps every
# token away from it (its gradient must then be exactly zero, AdamW still decays it).
BLOCKED, BLOCKED_STEP = 3, 2
BIASED = replace(CFG, load_balance_coeff=1e-3)


def _config(variant: str) -> MoEConfig:
    return BIASED if variant == "blocked" else CFG


def _step(model: nn.Module, opt, x, y, step: int, variant: str, group=None) -> torch.Tensor:
    """One optimizer step on ``(x, y)``; returns the (local) loss."""
    if variant == "blocked":
        for m in model.modules():
            if isinstance(m, MoE):
                m.expert_bias[BLOCKED] = -1e3 if step == BLOCKED_STEP else 0.0
    micro = 2 if variant == "accum" else 1
    total = 0.0
    for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
        loss = loss_of(model, xm, ym) / micro
        loss.backward()
        total += loss.detach()
    if variant == "blocked":
        if step == BLOCKED_STEP:
            _assert_blocked_grads_zero(model)
        update_expert_bias(model, group)
    if step == 0:  # AdamW is nearly blind to a gradient's scale: compare the first gradients
        model.first_grads = {
            k: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
            for k, p in model.named_parameters()
        }
    opt.step()
    opt.zero_grad()
    return total


def _assert_blocked_grads_zero(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            for w in (m.w1, m.w2, m.w3):
                g = w.grad.full_tensor() if isinstance(w.grad, DTensor) else w.grad
                assert torch.count_nonzero(g[BLOCKED]) == 0
                assert torch.count_nonzero(g) > 0


def train_reference(variant: str = "plain") -> tuple[list[float], dict]:
    """AdamW on the whole batch in one process; asserts the routing margin of every step."""
    model = make_model(_config(variant))
    margins = _record_margins(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS, foreach=False)
    losses = [
        _step(model, opt, x, y, s, variant).item() for s, (x, y) in enumerate(batches())
    ]
    assert min(margins) >= MARGIN, f"a top-k decision is a near tie: margin {min(margins)}"
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, model.first_grads


def _sharded_model(mesh, runtime: str, variant: str, ac: bool, meta: bool, **kw) -> nn.Module:
    """The model of :func:`make_model` under EP x FSDP on ``mesh`` (2-D ``(dp_mod_ep, ep)``):
    ``ac`` checkpoints every block, ``meta`` builds it on the meta device and copies the
    reference initialization into the sharded parameters after ``to_empty``; ``kw`` goes to
    :func:`parallelize_moe`."""
    cfg = _config(variant)
    if meta:
        with torch.device("meta"):
            model = MoETransformer(cfg)
    else:
        model = make_model(cfg)
    if ac:
        for block in model.layers.values():
            checkpoint(block)
    parallelize_moe(model, mesh, shard_fn=None if runtime == "ours" else fsdp2_fully_shard, **kw)
    if meta:
        model.to_empty(device="cpu")
        model.init_buffers()
        init = make_model(cfg).state_dict()
        with torch.no_grad(), implicit_replication():
            for k, v in model.state_dict().items():
                v.copy_(init[k])
    return model


def _train_distributed(model: nn.Module, rank: int, ws: int, variant: str) -> list[float]:
    """AdamW with each rank on its ``BATCH / ws`` rows; the losses are the global means."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS, foreach=False)
    per = BATCH // ws
    losses = []
    for s, (x, y) in enumerate(batches()):
        rows = slice(rank * per, (rank + 1) * per)
        losses.append(global_loss(_step(model, opt, x[rows], y[rows], s, variant), ws))
    return losses


def _ep_runs(rank: int, ws: int, runs: list[tuple]) -> list:
    """Every ``(ep, runtime, variant, ac, meta)`` of ``runs`` on one gloo world: its global
    losses and full state dict."""
    out = []
    for ep, runtime, variant, ac, meta in runs:
        mesh = init_device_mesh("cpu", (ws // ep, ep), mesh_dim_names=("dp_mod_ep", "ep"))
        model = _sharded_model(mesh, runtime, variant, ac, meta)
        losses = _train_distributed(model, rank, ws, variant)
        out.append((losses, full_state(model), model.first_grads))
    return out


EXPERT_SHARDINGS = {
    "projected": None,
    "zero1": StateSharding(params=(), grads=(), optim=("inter",)),
    "zero3": StateSharding(params=("inter",), grads=("inter",), optim=("inter",)),
}


def _state_sharded_runs(rank: int, ws: int, expert_shardings: list[str]) -> list:
    """AMSP on the 2x2 ``(inter, intra)`` mesh with EP over ``intra``, the experts' state
    sharded as ``EXPERT_SHARDINGS[name]`` says, for each name: losses, full state, first
    gradients, and the dims of the experts' and the dense units' collectives."""
    out = []
    for name in expert_shardings:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("inter", "intra"))
        model = _sharded_model(mesh, "ours", "plain", False, False, ep_dim="intra",
                               state_sharding=AMSP, expert_state_sharding=EXPERT_SHARDINGS[name])
        losses = _train_distributed(model, rank, ws, "plain")
        by_dims = {
            part: sorted({key for m in mods for key in m._fsdp_state.unit.stats.by_dims})
            for part, mods in (("experts", [b.moe.experts for b in model.layers.values()
                                            if b.moe_enabled]),
                               ("dense", [model, *model.layers.values()]))
        }
        out.append((losses, full_state(model), model.first_grads, by_dims))
    return out


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _check(run, reference) -> None:
    (losses, state, grads), (ref_losses, ref_state, ref_grads) = run, reference
    assert len(losses) == STEPS
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < ATOL
    assert _max_diff(grads, ref_grads) < GRAD_ATOL
    assert _max_diff(state, ref_state) < ATOL


@pytest.fixture(scope="module")
def reference():
    return train_reference()


@pytest.mark.multiprocess
def test_ep_fsdp_matches_one_process_and_fsdp2(reference):
    """EP 2 x FSDP 2 and EP 4 (experts whole on each rank), ours and torch FSDP2 + the same EP,
    5 AdamW steps: every rank's full parameters and the losses within 1e-5 of one process."""
    runs = [(ep, rt, "plain", False, False) for ep in (2, 4) for rt in ("ours", "fsdp2")]
    results = run_gloo(_ep_runs, WORLD, runs)
    for rank_results in results:
        for run in rank_results:
            _check(run, reference)


@pytest.mark.multiprocess
def test_ep_fsdp_checkpointing_meta_init_accumulation_and_an_idle_expert(reference):
    """On EP 2 x FSDP 2 against one process: activation checkpointing of every block; meta-device
    init; gradient accumulation (two microbatches); and an expert no token reaches in one step
    (its gradient exactly zero, not the last step's; AdamW's decay and moments as in one process),
    with the auxiliary-loss-free bias updated from the token counts of all ranks."""
    runs = [
        (2, "ours", "plain", True, False),
        (2, "ours", "plain", False, True),
        (2, "ours", "accum", False, False),
        (2, "ours", "blocked", False, False),
    ]
    results = run_gloo(_ep_runs, WORLD, runs)
    references = {v: reference if v == "plain" else train_reference(v) for v in ("plain", "accum", "blocked")}
    for rank_results in results:
        for run, (_, _, variant, _, _) in zip(rank_results, runs):
            _check(run, references[variant])


@pytest.mark.multiprocess
def test_ep_with_amsp_state_sharding_matches_one_process(reference):
    """4 gloo ranks as 2x2 ``(inter, intra)``, EP over ``intra``: the dense units under AMSP
    over both dims, the experts' state sharded over ``inter`` (AMSP's projection, ZeRO-2 there;
    ZeRO-1 and ZeRO-3), 5 AdamW steps: every rank's full parameters and the losses within 1e-5
    of one process, and each state reduced over the dims it names."""
    names = list(EXPERT_SHARDINGS)
    results = run_gloo(_state_sharded_runs, WORLD, names)
    both = [(kind, (dim,)) for kind in ("all_gather", "reduce_scatter") for dim in ("inter", "intra")]
    experts = {  # the nested runtime's collectives (ZeRO-3 over one dim is the runtime without it)
        "projected": [("all_gather", ("inter",)), ("reduce_scatter", ("inter",))],
        "zero1": [("all_gather", ("inter",)), ("all_reduce", ("inter",))],
        "zero3": [],
    }
    for rank_results in results:
        for name, (*run, by_dims) in zip(names, rank_results):
            _check(tuple(run), reference)
            assert by_dims == {"experts": experts[name], "dense": both}, name


def test_run_experts_loop_against_the_formula_and_grouped_mm():
    """The per-expert loop is the per-expert SwiGLU bit for bit, and agrees with
    ``torch._grouped_mm``'s CPU forward to fp32 rounding (its kernel accumulates in another
    order), with an expert that receives no token."""
    g = torch.Generator().manual_seed(0)
    w1, w3 = torch.randn(4, 16, 8, generator=g), torch.randn(4, 16, 8, generator=g)
    w2 = torch.randn(4, 8, 16, generator=g)
    x = torch.randn(10, 8, generator=g)
    counts = [3, 0, 5, 2]
    loop = run_experts(w1, w2, w3, x, counts, use_grouped_mm=False)
    grouped = run_experts(w1, w2, w3, x, counts, use_grouped_mm=True)
    torch.testing.assert_close(grouped, loop, rtol=1e-6, atol=1e-5)
    rows = torch.split(x, counts)
    expect = torch.cat([
        (F.silu(r @ w1[e].T) * (r @ w3[e].T)) @ w2[e].T for e, r in enumerate(rows)
    ])
    assert torch.equal(loop, expect)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_moe_layer_matches_a_per_token_reference(score_func):
    """Each token's output is the shared expert's plus the gate-weighted sum of its top-k
    experts' (DeepSeek-V3's bias steering the choice only), forward and backward."""
    cfg = replace(CFG, score_func=score_func, route_norm=True, route_scale=2.0,
                  load_balance_coeff=1e-3)
    torch.manual_seed(0)
    moe = MoE(cfg)
    moe.expert_bias.copy_(torch.linspace(-0.1, 0.1, cfg.num_experts))
    x = torch.randn(2, 5, cfg.dim, requires_grad=True)
    out = moe(x)
    flat = x.reshape(-1, cfg.dim)
    scores = moe.router.scores(flat)
    chosen = torch.topk(scores + moe.expert_bias, cfg.top_k, dim=-1).indices
    rows = []
    for t in range(flat.shape[0]):
        gates = scores[t, chosen[t]]
        gates = gates / gates.sum() * cfg.route_scale
        y = moe.shared_experts(flat[t:t + 1])
        for gate, e in zip(gates, chosen[t].tolist()):
            w1, w2, w3 = (w[e] for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3))
            y = y + gate * ((F.silu(flat[t:t + 1] @ w1.T) * (flat[t:t + 1] @ w3.T)) @ w2.T)
        rows.append(y)
    expect = torch.cat(rows).reshape(out.shape)
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-6)
    (gx,) = torch.autograd.grad(out.square().sum(), x)
    (ex,) = torch.autograd.grad(expect.square().sum(), x)
    torch.testing.assert_close(gx, ex, rtol=1e-5, atol=1e-6)
    assert torch.equal(moe.tokens_per_expert, torch.bincount(chosen.flatten(), minlength=8))


def test_bad_routing_arguments_raise_value_errors():
    with pytest.raises(ValueError, match="top_k=9 exceeds num_experts=8"):
        replace(CFG, top_k=9)
    with pytest.raises(ValueError, match="top_k=3 exceeds num_experts=2"):
        TopKRouter(8, 2, 3)
    with pytest.raises(ValueError, match="score_func"):
        replace(CFG, score_func="relu")
    with pytest.raises(ValueError, match="n_dense_layers"):
        replace(CFG, n_dense_layers=4)


ZERO1 = StateSharding(params=(), grads=(), optim=("dp_mod_ep", "ep"))


def _experts_in_fp8(model: MoETransformer, quant: BlockFP8Config) -> MoETransformer:
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            m.quant = quant
    return model


def _experts_cut_inside(experts: GroupedExperts, ep_mesh) -> GroupedExperts:
    """``experts`` with each stack a ``Shard(1)`` DTensor on ``ep_mesh``: every expert's matrix
    cut between the ranks (expert tensor parallelism), which the FP8 gather refuses."""
    rank, size = ep_mesh.get_local_rank(), ep_mesh.size()
    for name, p in list(experts.named_parameters()):
        local = p.detach().chunk(size, dim=1)[rank].clone()
        dt = DTensor.from_local(local, ep_mesh, [Shard(1)], run_check=False)
        experts.register_parameter(name, nn.Parameter(dt))
    return experts


def _bad_parallel_calls(rank: int, ws: int) -> dict:
    """``parallelize_moe`` with bad arguments on a threaded world of 4: each raises
    ``ValueError`` with no collective."""
    mesh = init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp_mod_ep", "ep"))
    errors = {}
    calls = [
        ("ep", lambda: parallelize_moe(MoETransformer(replace(CFG, num_experts=6)), mesh)),
        ("ep_dim", lambda: parallelize_moe(MoETransformer(CFG), mesh, ep_dim="expert")),
        ("state_sharding", lambda: parallelize_moe(
            MoETransformer(CFG), mesh, state_sharding=StateSharding(params=("ep",), grads=("ep",), optim=("ep",)))),
        ("expert_state_sharding", lambda: parallelize_moe(
            MoETransformer(CFG), mesh, expert_state_sharding=StateSharding(
                params=(), grads=(), optim=("dp_mod_ep", "ep")))),
        ("unknown dim", lambda: parallelize_moe(
            MoETransformer(CFG), mesh, state_sharding=StateSharding((), (), ("inter",)))),
        ("shard_fn", lambda: parallelize_moe(
            MoETransformer(CFG), mesh, shard_fn=fsdp2_fully_shard, state_sharding=ZERO1)),
        ("quant", lambda: parallelize_moe(MoETransformer(CFG), mesh, quant="fp8")),
        ("quant with FSDP2", lambda: parallelize_moe(
            MoETransformer(CFG), mesh, shard_fn=fsdp2_fully_shard, quant=BlockFP8Config())),
        ("reshard_after_forward", lambda: parallelize_moe(
            MoETransformer(CFG), mesh, expert_state_sharding=StateSharding((), (), ("dp_mod_ep",)),
            reshard_after_forward=2)),
        ("quant of the experts", lambda: parallelize_moe(
            _experts_in_fp8(MoETransformer(CFG), BlockFP8Config(block=(64, 64))), mesh,
            quant=QUANT)),
        ("quant with experts cut", lambda: ours_fully_shard(
            _experts_cut_inside(GroupedExperts(CFG.dim, CFG.moe_hidden_dim, 8), mesh["ep"]),
            mesh=mesh["dp_mod_ep"], quant=QUANT)),
    ]
    with recording_collectives() as record:
        for name, call in calls:
            try:
                call()
            except ValueError as exc:
                errors[name] = str(exc)
    errors["collectives"] = record.calls
    return errors


def test_bad_expert_parallel_arguments_raise_before_any_collective():
    for errors in run_threaded(_bad_parallel_calls, WORLD):
        assert "ep=4 does not divide num_experts=6" in errors["ep"]
        assert "'expert'" in errors["ep_dim"]
        assert "state_sharding=" in errors["state_sharding"]
        assert "over the ep dim 'ep' only" in errors["state_sharding"]
        assert "expert_state_sharding=" in errors["expert_state_sharding"]
        assert "names the ep dim 'ep'" in errors["expert_state_sharding"]
        assert "names ['inter'], not a dim of the mesh" in errors["unknown dim"]
        assert ("state_sharding=P() G() OS(dp_mod_ep,ep) with shard_fn=torch.distributed.fsdp."
                in errors["shard_fn"]), errors["shard_fn"]
        assert "only ragged_placement.fsdp.fully_shard takes a per-state" in errors["shard_fn"]
        assert "quant=BlockFP8Config(" in errors["quant with FSDP2"]
        assert ("torch FSDP2 has no block-wise FP8 all-gather; only ragged_placement.fsdp."
                "fully_shard takes quant" in errors["quant with FSDP2"])
        assert ("reshard_after_forward=2 with expert_state_sharding=" in
                errors["reshard_after_forward"])
        assert "quant must be a BlockFP8Config or None, got 'fp8'" in errors["quant"]
        assert "quant=BlockFP8Config(block=(128, 128)" in errors["quant of the experts"]
        assert "already computes in FP8 with BlockFP8Config(block=(64, 64)" in errors[
            "quant of the experts"]
        assert "w1 ((Shard(dim=1),))" in errors["quant with experts cut"]
        assert "quant composes with tensor-parallel parameters only" in errors[
            "quant with experts cut"]
        assert errors["collectives"] == {}


# -- block-wise FP8 ---------------------------------------------------------------------------
QUANT = BlockFP8Config()


def _fp8(model: MoETransformer) -> MoETransformer:
    """The one-process FP8 model: every ``nn.Linear`` an ``FP8Linear`` (what ``fully_shard(...,
    quant=QUANT)`` converts in the dense units) and the experts computing in FP8."""
    convert_to_fp8_linear(model, QUANT)
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            m.quant = QUANT
    return model


def _expert_all_gathers(mesh, runtime: str, rank: int, ws: int, **kw) -> list[int]:
    """``[calls, bytes]`` of the expert units' all-gathers over ``dp_mod_ep`` in one forward
    and backward on EP 2 x FSDP 2 (``CollectiveMeter``: the dense units gather over both
    dims)."""
    model = _sharded_model(mesh, runtime, "plain", False, False, **kw)
    x, y = batches(1)[0]
    per = BATCH // ws
    with CollectiveMeter() as meter:
        loss_of(model, x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
    return meter.by_dims(mesh)[("all_gather", ("dp_mod_ep",))][:2]


def _fp8_runs(rank: int, ws: int) -> list:
    """``quant=QUANT`` on EP 2 x FSDP 2 and with AMSP on 2x2 ``(inter, intra)``, EP over
    ``intra``: per run, losses, full state, first gradients, the type of every Linear, the
    experts' ``quant`` and ``(calls, bytes, steps)`` of the expert units' all-gathers (EP 2 x
    FSDP 2: the ``CollectiveMeter``'s in one forward and backward; AMSP, where the dense units
    refresh over ``inter`` too: the expert units' own counts of their refreshes over ``inter``
    in the 5 steps); last, ``[calls, bytes]`` of torch FSDP2 + the same EP in bf16 in one
    forward and backward."""
    out = []
    for names, kw in ((("dp_mod_ep", "ep"), {}),
                      (("inter", "intra"), {"ep_dim": "intra", "state_sharding": AMSP})):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
        model = _sharded_model(mesh, "ours", "plain", False, False, quant=QUANT, **kw)
        losses = _train_distributed(model, rank, ws, "plain")
        experts = [b.moe.experts for b in model.layers.values() if b.moe_enabled]
        if "state_sharding" in kw:
            counts = [m._fsdp_state.unit.stats.by_dims[("all_gather", ("inter",))]
                      for m in experts]
            gathers = (sum(c[0] for c in counts), sum(c[1] for c in counts), STEPS)
        else:
            gathers = (*_expert_all_gathers(mesh, "ours", rank, ws, quant=QUANT), 1)
        kinds = {type(m).__name__ for m in model.modules() if isinstance(m, nn.Linear)}
        quant = [m.quant for m in experts]
        out.append((losses, full_state(model), model.first_grads, kinds, quant, gathers))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_mod_ep", "ep"))
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    out.append(_expert_all_gathers(mesh, "fsdp2", rank, ws, mp_policy=bf16))
    return out


# FP8 against the one-process FP8 model (tests/quant/test_fsdp_fp8.py's reference): the master weights
# differ by fp32 reduction order (~1e-8) after each step, which can flip the FP8 rounding of a
# single weight or activation element; AdamW then moves that entry by up to ~lr. Measured on EP
# 2 x FSDP 2, 5 steps: first gradients 2.6e-8 apart, losses 1.9e-6, parameters 4.0e-5 (29 of the
# 1,024 entries of one dense FP8Linear weight beyond 1e-6). Bounds: GRAD_ATOL, ATOL for the
# losses, 1e-4 for the parameters.
FP8_PARAM_ATOL = 1e-4


# The expert units' FP8 all-gather (FP8 bytes and one fp32 scale per 128 x 128 block of each
# expert matrix, uneven sends, 16-byte aligned) against FSDP2 + EP's bf16 one: 0.505x measured.
FP8_GATHER_RATIO = 0.51


@pytest.mark.multiprocess
def test_fp8_ep_fsdp_matches_one_process_fp8():
    """``parallelize_moe(..., quant=BlockFP8Config())`` on EP 2 x FSDP 2 and with AMSP on 2x2
    (EP over ``intra``), 5 AdamW steps, against
    the same FP8 model in one process (every ``nn.Linear`` an ``FP8Linear`` but the router gate,
    the experts computing per expert matrix in FP8): first gradients within 1e-7, losses within
    1e-5, parameters within 1e-4 (see ``FP8_PARAM_ATOL``); the routing margin asserted as in
    the fp32 tests. The expert units all-gather FP8 blocks and scales: at most 0.51x the bytes
    of torch FSDP2 + the same EP's bf16 all-gather of the same experts, per all-gather and per
    step."""
    model = _fp8(make_model())
    margins = _record_margins(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS, foreach=False)
    ref_losses = [_step(model, opt, x, y, s, "plain").item() for s, (x, y) in enumerate(batches())]
    assert min(margins) >= MARGIN, f"a top-k decision is a near tie: margin {min(margins)}"
    ref_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for *runs, (bf16_calls, bf16_bytes) in run_gloo(_fp8_runs, WORLD):
        assert bf16_calls == 4  # 2 expert units, forward and backward
        for losses, state, grads, kinds, quant, (calls, nbytes, steps) in runs:
            assert kinds == {"FP8Linear", "RouterGate"} and quant == [QUANT, QUANT]
            assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < ATOL
            assert _max_diff(grads, model.first_grads) < GRAD_ATOL
            assert _max_diff(state, ref_state) < FP8_PARAM_ATOL
            assert calls >= 4  # 2 units: forward and backward, or (AMSP) a refresh a step
            assert nbytes / calls <= FP8_GATHER_RATIO * bf16_bytes / bf16_calls
            assert nbytes / steps <= FP8_GATHER_RATIO * bf16_bytes


def test_fp8_experts_quantize_each_expert_matrix():
    """``run_experts(..., quant=)`` is ``fp8_linear`` per expert matrix (its own 128 x 128
    blocks and scales), not the parameters' dtype; the router gate is no FP8 candidate."""
    g = torch.Generator().manual_seed(0)
    w1, w3 = torch.randn(3, 16, 8, generator=g), torch.randn(3, 16, 8, generator=g)
    w2 = torch.randn(3, 8, 16, generator=g)
    w1[1] *= 100  # one expert's scale must not leak into the others'
    x = torch.randn(7, 8, generator=g)
    counts = [2, 0, 5]
    out = run_experts(w1, w2, w3, x, counts, quant=QUANT)
    rows = torch.split(x, counts)
    expect = torch.cat([
        fp8_linear(F.silu(fp8_linear(r, w1[e], config=QUANT)) * fp8_linear(r, w3[e], config=QUANT),
                   w2[e], config=QUANT)
        for e, r in enumerate(rows)
    ])
    assert torch.equal(out, expect)
    assert not torch.allclose(out, run_experts(w1, w2, w3, x, counts), atol=1e-4)
    router = TopKRouter(8, 3, 1)
    convert_to_fp8_linear(router, QUANT)
    assert type(router.gate) is RouterGate
