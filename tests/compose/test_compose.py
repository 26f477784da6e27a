"""fully_shard composed with tensor parallel, HSDP and pipeline parallel, against one process.

One 4-rank gloo spawn runs every integration check (spawns are the expensive part):
(dp=2, tp=2) FSDP x TP training and a DCP save, HSDP on a (replicate=2, shard=2) mesh, (pp=2,
dp=2) pipelines with ScheduleGPipe and Schedule1F1B, the zero-bubble schedules (their separate
weight-gradient pass) beside torch FSDP2, and the DCP load on (dp=4). The reference is the same
model trained in this process on the whole batch.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from common.compose import (
    BATCH,
    CFG,
    LR,
    SEQ,
    STEPS,
    full_state_of,
    llama_batches,
    llama_init_state,
    llama_loss,
    llama_model,
    mean_over_ranks,
    pipeline_losses,
    train_llama,
)
from dist_utils import run_gloo
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import Shard

from ragged_placement.fsdp import fully_shard
from ragged_placement.models.llama import Llama, LlamaConfig, pipeline_stage
from ragged_placement.parallelize import parallelize_llama
from ragged_placement.placement import RaggedShard

pytestmark = pytest.mark.multiprocess


def _tp(rank: int, state, ckpt: str) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = llama_model(state)
    parallelize_llama(model, mesh["tp"])
    for block in model.layers.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    d = mesh["dp"].get_local_rank()
    half = BATCH // 2
    out = {"placements": {n: tuple(p.placements) for n, p in model.named_parameters()}}
    # The sharded locals are views of the unit's flat buffer; .grad are root-mesh DTensors.
    (flat,) = model.layers["0"].fsdp_unit.buffers
    wq = model.layers["0"].attention.wq.weight
    out["view"] = (
        wq._local_tensor.untyped_storage().data_ptr() == flat.sharded.untyped_storage().data_ptr()
    )
    out["mesh"] = wq.device_mesh.mesh_dim_names
    out["losses"] = mean_over_ranks(
        train_llama(model, [b[d * half : (d + 1) * half] for b in llama_batches()], clip=True)
    )
    b = llama_batches()[0][d * half : (d + 1) * half]
    llama_loss(model(b[:, :-1]), b[:, 1:]).backward()
    out["grad_placements"] = tuple(wq.grad.placements)
    out["grad_view"] = (
        wq.grad._local_tensor.untyped_storage().data_ptr()
        == flat.grads.sharded.untyped_storage().data_ptr()
    )
    model.zero_grad()
    out["full"] = full_state_of(model)
    dcp.save(model.state_dict(), checkpoint_id=ckpt)
    return out


def _hsdp(rank: int, state) -> list[float]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = llama_model(state)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert isinstance(model.layers["0"].attention.wq.weight.placements[1], RaggedShard)
    return mean_over_ranks(train_llama(model, [b[rank : rank + 1] for b in llama_batches()], clip=True))


def _pp(
    rank: int, state, schedule_cls, first_grads: dict | None = None, counts: list | None = None
) -> list[float]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    return pipeline_losses(mesh, state, schedule_cls, LR, first_grads=first_grads, counts=counts)


def _pp_deferred(rank: int, state) -> tuple[list[float], list[tuple[int, int]], dict, dict]:
    """1F1B with gradient sync deferred, and the first step's gradients with and without."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    counts: list[tuple[int, int]] = []
    grads: dict[str, torch.Tensor] = {}
    losses = pipeline_losses(
        mesh, state, Schedule1F1B, LR, deferred=True, first_grads=grads, counts=counts
    )
    per_micro_batch: dict[str, torch.Tensor] = {}
    _pp(rank, state, Schedule1F1B, first_grads=per_micro_batch)
    return losses, counts, grads, per_micro_batch


# -- the zero-bubble schedules: a weight-gradient pass of its own, after the input pass -----------
CFG4 = LlamaConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, hidden_dim=64)
ZERO_BUBBLE = {"zbv": ScheduleZBVZeroBubble, "interleaved_zb": ScheduleInterleavedZeroBubble,
               "dualpipev": ScheduleDualPipeV}
N_MICRO = 4


def _zero_bubble_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, CFG4.vocab_size), targets.reshape(-1))


def _zero_bubble_batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, CFG4.vocab_size, (BATCH * 2, SEQ + 1), generator=g)


def _zero_bubble_step(mesh, state, schedule: str, runtime: str, reshard: bool) -> dict:
    """One step of ``schedule`` over 4 stages of a 4-layer model, 2 per pipeline rank (the V
    schedules: stages p and 3 - p; InterleavedZeroBubble: p and p + 2), each stage's blocks and
    root sharded on ``mesh["dp"]`` by ``runtime``'s fully_shard (blocks with
    ``reshard_after_forward=reshard``; torchtitan's PP default is False), ``N_MICRO``
    micro-batches per step. Returns the full gradients by name and, for ours, how many times a
    gradient landed per parameter and stage (each unsharded parameter's gradient hook)."""
    p, d = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    cls = ZERO_BUBBLE[schedule]
    shard = fully_shard if runtime == "ours" else fsdp2_fully_shard
    indices = [p, 3 - p] if cls in (ScheduleZBVZeroBubble, ScheduleDualPipeV) else [p, p + 2]
    model = Llama(CFG4)
    model.load_state_dict(state)
    parts, stages, landings = [], [], {}
    for i in indices:
        part = pipeline_stage(model, i, 4)
        for block in part.layers.values():
            shard(block, mesh=mesh["dp"], reshard_after_forward=reshard)
        shard(part, mesh=mesh["dp"])
        if runtime == "ours":
            for name, unit in part.fsdp_units():
                for slot, u in zip(unit.slots, unit.unsharded_params):
                    key = (i, f"{name}.{slot.fqn}".strip("."))
                    landings[key] = 0
                    u.register_hook(lambda g, key=key: landings.__setitem__(key, landings[key] + 1))
        parts.append(part)
        stages.append(PipelineStage(part, i, 4, torch.device("cpu"), group=mesh["pp"].get_group()))
    b = _zero_bubble_batch()[d * BATCH : (d + 1) * BATCH]
    sched = cls(stages, N_MICRO, loss_fn=_zero_bubble_loss)
    if p == 0:
        sched.step(b[:, :-1], target=b[:, 1:])
    else:
        sched.step(target=b[:, 1:])
    grads = {}
    for part in parts:
        for n, param in part.named_parameters():
            grads[n] = None if param.grad is None else param.grad.full_tensor()
    return {"grads": grads, "landings": landings}


def _zero_bubble(rank: int) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    torch.manual_seed(0)
    state = Llama(CFG4).state_dict()  # the same on every rank: each seeds the same generator
    out = {}
    for schedule in ZERO_BUBBLE:
        for runtime in ("ours", "fsdp2"):
            out[schedule, runtime, False] = _zero_bubble_step(mesh, state, schedule, runtime, False)
    for runtime in ("ours", "fsdp2"):  # blocks resharded after forward
        out["zbv", runtime, True] = _zero_bubble_step(mesh, state, "zbv", runtime, True)
    return out


def _sac_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else (
        CheckpointPolicy.PREFER_RECOMPUTE)


def _zero_bubble_with_selective_checkpointing(rank: int, state) -> dict[str, str]:
    """ZBV over both stages of a 2-layer model on each rank alone (a pipeline group of one:
    no rank waits on another when one raises), the blocks under selective activation
    checkpointing, sharded over all 4 ranks: the error each runtime raises."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    mesh = init_device_mesh("cpu", (1, 4), mesh_dim_names=("pp", "dp"))
    out = {}
    for runtime in ("ours", "fsdp2"):
        shard = fully_shard if runtime == "ours" else fsdp2_fully_shard
        stages = []
        for i in (0, 1):
            part = pipeline_stage(llama_model(state), i, 2)
            for name, block in list(part.layers.items()):
                block = checkpoint_wrapper(block, context_fn=functools.partial(
                    create_selective_checkpoint_contexts, _sac_policy))
                part.layers[name] = block
                shard(block, mesh=mesh["dp"], reshard_after_forward=False)
            shard(part, mesh=mesh["dp"])
            stages.append(PipelineStage(part, i, 2, torch.device("cpu"),
                                        group=mesh["pp"].get_group()))
        b = llama_batches()[0][rank : rank + 1]
        with pytest.raises((NotImplementedError, RuntimeError)) as e:
            ScheduleZBVZeroBubble(stages, 1, loss_fn=llama_loss).step(b[:, :-1], target=b[:, 1:])
        out[runtime] = f"{e.type.__name__}: {e.value}"
    return out


def _load_dp4(rank: int, ckpt: str) -> dict[str, torch.Tensor]:
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    torch.manual_seed(1)  # different values: everything must come from the checkpoint
    model = Llama(CFG)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=ckpt)
    model.load_state_dict(sd)
    return full_state_of(model)


def _worker(rank: int, world_size: int, state, ckpt: str) -> dict:
    torch.set_num_threads(1)
    out = {"tp": _tp(rank, state, ckpt)}
    out["hsdp"] = _hsdp(rank, state)
    out["gpipe_counts"] = []
    out["gpipe"] = _pp(rank, state, ScheduleGPipe, counts=out["gpipe_counts"])
    out["1f1b"] = _pp(rank, state, Schedule1F1B)
    out["1f1b_deferred"] = _pp_deferred(rank, state)
    out["zero_bubble"] = _zero_bubble(rank)
    out["zero_bubble_sac"] = _zero_bubble_with_selective_checkpointing(rank, state)
    out["dp4"] = _load_dp4(rank, ckpt)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("ckpt_dp2_tp2"))
    state = llama_init_state()
    ref_model = llama_model(state)
    ref = {"clip": train_llama(ref_model, llama_batches(), clip=True),
           "final": ref_model.state_dict()}
    ref["noclip"] = train_llama(llama_model(state), llama_batches(), clip=False)
    torch.manual_seed(0)
    zb_model = Llama(CFG4)
    b = _zero_bubble_batch()
    _zero_bubble_loss(zb_model(b[:, :-1]), b[:, 1:]).backward()
    ref["zero_bubble"] = {n: p.grad for n, p in zb_model.named_parameters()}
    return {"ref": ref, "ranks": run_gloo(_worker, 4, state, ckpt), "ckpt": ckpt}


def _close(a: list[float], b: list[float], tol: float = 1e-5) -> None:
    assert len(a) == len(b) == STEPS
    assert max(abs(x - y) for x, y in zip(a, b)) < tol, (a, b)


def test_fsdp_tp_layout_and_losses(results):
    tp = results["ranks"][0]["tp"]
    pl = tp["placements"]
    # colwise wq (TP-local 128 rows) fits in one dp rank's chunk: the plan gives it to one of
    # them whole, with the strided variant so that the global row order is dp-inside-tp
    wq_dp, wq_tp = pl["layers.0.attention.wq.weight"]
    assert wq_tp == Shard(0)
    assert wq_dp in (
        RaggedShard((0,), (0, 1), split_factor=2),
        RaggedShard((0,), (1, 0), split_factor=2),
    )
    assert pl["layers.0.attention.wo.weight"][1] == Shard(1)
    assert pl["layers.0.attention.wo.weight"][0].split_factor == 1
    assert pl["layers.0.attention_norm.weight"][1].is_replicate()
    assert tp["view"] and tp["mesh"] == ("dp", "tp")
    assert tp["grad_placements"] == pl["layers.0.attention.wq.weight"] and tp["grad_view"]
    for r in results["ranks"]:
        _close(r["tp"]["losses"], results["ref"]["clip"])
    # Adam's normalized update turns summation-order noise in near-zero gradients into ~lr*1e-3.
    for k, v in results["ref"]["final"].items():
        torch.testing.assert_close(tp["full"][k], v, atol=1e-4, rtol=0)


def test_hsdp_losses(results):
    for r in results["ranks"]:
        _close(r["hsdp"], results["ref"]["clip"])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_losses(results, schedule):
    last = [r[schedule] for r in results["ranks"] if r[schedule]]
    assert len(last) == 2  # the dp ranks of the last stage
    for losses in last:
        _close(losses, results["ref"]["noclip"])


def test_pipeline_schedule_drives_our_units_as_fsdp2s(results):
    # The stages are torch.distributed.fsdp.FSDPModule instances: the schedule turns gradient
    # sync off for the micro-batches and reduces once per unit after the last one, through
    # fully_shard.state(stage) (ragged_placement.fsdp.fsdp2_state), as it does for FSDP2's;
    # test_pipeline_losses checks the values (the schedule divides by the micro-batches after)
    for r in results["ranks"]:
        counts = r["gpipe_counts"]
        assert len(counts) == STEPS and all(rs == units > 0 for rs, units in counts), counts


def test_pipeline_gradient_sync_deferred_to_the_last_micro_batch(results):
    # the user's own deferral (sync off around the step, reduce_gradients() after it) composes
    # with the schedule's: still one reduce-scatter per unit per step, reduce_gradients() a no-op
    outs = [r["1f1b_deferred"] for r in results["ranks"]]
    for _, counts, deferred, per_micro_batch in outs:
        assert len(counts) == STEPS and all(rs == units > 0 for rs, units in counts), counts
        # the same gradients as reducing every micro-batch, up to summation order
        assert deferred.keys() == per_micro_batch.keys() and deferred
        for k, g in deferred.items():
            torch.testing.assert_close(g, per_micro_batch[k], atol=1e-6, rtol=1e-5)
    last = [losses for losses, *_ in outs if losses]
    assert len(last) == 2
    # Adam turns summation-order noise in near-zero gradients into ~lr*1e-3 parameter noise
    for losses in last:
        _close(losses, results["ref"]["noclip"], tol=2e-4)


def test_dcp_dp2_tp2_to_dp4_and_single_process(results):
    saved = results["ranks"][0]["tp"]["full"]
    for r in results["ranks"]:
        assert r["dp4"].keys() == saved.keys()
        for k, v in saved.items():
            assert torch.equal(r["dp4"][k], v), k
    torch.manual_seed(2)
    single = Llama(CFG).state_dict()
    dcp.load(single, checkpoint_id=results["ckpt"])
    assert single.keys() == saved.keys()
    for k, v in saved.items():
        assert torch.equal(single[k], v), k


def _zero_bubble_grads(results, key) -> dict[str, torch.Tensor | None]:
    """The gradients of every stage, from the ranks that hold them (dp rank 0 of each pp rank;
    the dp ranks hold the same full gradients)."""
    out: dict[str, torch.Tensor | None] = {}
    for r in results["ranks"]:
        for name, g in r["zero_bubble"][key]["grads"].items():
            out.setdefault(name, g)
    return out


@pytest.mark.parametrize("schedule", list(ZERO_BUBBLE))
def test_zero_bubble_weight_pass_finds_our_parameters_and_accumulates_once(results, schedule):
    """The zero-bubble schedules compute weight gradients in a pass of their own, which looks
    the stage's ``parameters()`` (ours: the sharded ones) up among the autograd accumulators of
    the forward's graph (ours: the unsharded ones'). With torchtitan's PP setting
    (``reshard_after_forward=False``) every gradient is bit for bit torch FSDP2's, and within
    1e-6 of one process on the whole batch (ZBV also with the blocks resharded after forward);
    each parameter's gradient lands once per micro-batch. Before, ours raised
    ``KeyError: <AccumulateGrad>`` in ``stage_backward_weight``."""
    ref = results["ref"]["zero_bubble"]
    for reshard in (False, True) if schedule == "zbv" else (False,):
        ours = _zero_bubble_grads(results, (schedule, "ours", reshard))
        assert ours.keys() == ref.keys()
        for name, g in ref.items():
            torch.testing.assert_close(ours[name], g, atol=1e-6, rtol=0, msg=f"{name} {reshard}")
        for r in results["ranks"]:
            landings = r["zero_bubble"][schedule, "ours", reshard]["landings"]
            assert landings and set(landings.values()) == {N_MICRO}, landings
    fsdp2 = _zero_bubble_grads(results, (schedule, "fsdp2", False))
    for name, g in _zero_bubble_grads(results, (schedule, "ours", False)).items():
        assert torch.equal(g, fsdp2[name]), name


def test_zero_bubble_with_resharding_blocks_trains_where_fsdp2_loses_gradients(results):
    """With ``reshard_after_forward=True`` FSDP2's blocks register their sharded parameters
    after forward, which the input pass reads: the weight pass misses those blocks' gradients
    (stages past the first), with no error. Ours matches one process there (above)."""
    ref = results["ref"]["zero_bubble"]
    fsdp2 = _zero_bubble_grads(results, ("zbv", "fsdp2", True))
    off = [n for n, g in ref.items() if fsdp2[n] is None or (fsdp2[n] - g).abs().max() > 1e-4]
    assert off and all(n.startswith("layers.") and not n.startswith("layers.0.") for n in off), off


def test_pipelining_rows_wrap_the_split_backward_and_uninstall_restores_them(one_torch_thread):
    """``ragged_placement._install.PIPELINING_PATCHES``: once torch.distributed.pipelining is
    imported (this module imports it), the first root forward of our units wraps its
    ``stage_backward_input``/``stage_backward_weight`` (checked against torch's originals
    first); ``uninstall()`` puts torch's functions back, and the next install wraps them
    again."""
    import torch.distributed.pipelining._backward as backward
    import torch.distributed.pipelining.stage as stage

    from ragged_placement import _install
    from ragged_placement.fsdp.api import _FSDP2_HOOKS

    names = ("stage_backward_input", "stage_backward_weight")
    _install.install_fsdp2(_FSDP2_HOOKS)
    _install.install_pipelining()
    try:
        for name in names:
            assert getattr(stage, name).__wrapped__ is getattr(backward, name)
        _install.uninstall()
        assert all(getattr(stage, name) is getattr(backward, name) for name in names)
        assert _install.changed_rows(_install.PIPELINING_PATCHES) == []
    finally:
        RaggedShard((0,), (1,))
        _install.install_fsdp2(_FSDP2_HOOKS)
        _install.install_pipelining()
    assert all(getattr(stage, name).__wrapped__ is getattr(backward, name) for name in names)


def test_zero_bubble_with_selective_checkpointing_raises_naming_the_combination(results):
    """A zero-bubble weight pass through a selectively checkpointed region (torch's checkpoint
    lets backward through it once: the input pass did) fails with torch FSDP2 in torch's
    checkpoint ("Trying to backward an extra time"); ours raises ``NotImplementedError`` naming
    the schedules, the checkpointing and the fixes. (Before, ours failed inside the
    recomputation: "aten.mul.Tensor got mixed torch.Tensor and DTensor".)"""
    for r in results["ranks"]:
        errors = r["zero_bubble_sac"]
        assert errors["fsdp2"].startswith("RuntimeError: Trying to backward an extra time")
        assert errors["ours"].startswith("NotImplementedError: a zero-bubble pipeline schedule")
        assert "selective activation checkpointing" in errors["ours"]
        assert "full activation checkpointing" in errors["ours"] and "Schedule1F1B" in errors["ours"]
