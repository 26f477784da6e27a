"""``fully_shard(state_sharding=...)`` (issue 25's runtime) with the training features around it,
each against one process on the whole batch (and torch FSDP2 where it has the configuration):
gradient accumulation, activation checkpointing, meta-device init, bf16 mixed precision,
parameters written outside an optimizer, the collectives per mesh dim seen by torch's
``CommDebugMode``, bad input; on 4 gloo ranks as a 2x2 ``("inter", "intra")`` mesh (one spawn
for all of them) and two partial points on 8 threaded ranks as a 2x2x2 mesh."""

from __future__ import annotations

import re
from collections.abc import Callable
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from common.state_sharding import (
    BATCH,
    BOTH,
    MLP,
    SHARDINGS,
    STEPS,
    TOL,
    mlp_adamw,
    mlp_data,
    mlp_reference,
)
from dist_utils import run_gloo, run_threaded
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torch.utils.checkpoint import checkpoint

from ragged_placement._compat import DataParallelMeshDims
from ragged_placement.fsdp import StateSharding, fully_shard
from ragged_placement.fsdp.nested_refresh import ChunkRefresh
from ragged_placement.fsdp.unit import UnitState

# drawn once (threaded ranks must not race on the global RNG that mlp_data seeds)
INIT, X, Y = mlp_data()
ACCUMULATED = ("amsp", "zero2", "zero1")
SEED = 11
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
# bf16 parameters in forward and backward: ours and FSDP2 HSDP cast and sum alike (measured:
# bitwise equal). One fp32 process differs by bf16's rounding of the gradients, which can flip
# AdamW's (about lr-sized) steps on small ones: parameters within 5 steps * lr, output 2e-2
# (measured: 0.040 and 0.016, the same for FSDP2 HSDP).
BF16_PARAMS_VS_FP32 = 5e-2
BF16_OUT_VS_FP32 = 2e-2
NODES = ("nodes", "groups", "gpus")
PARTIAL_8 = {
    "partial": StateSharding(params=("gpus",), grads=("groups", "gpus"), optim=NODES),
    # optim ranks params-major (gpus, then nodes, then groups): out of the mesh's order
    "out_of_order": StateSharding(params=("gpus",), grads=("nodes", "gpus"), optim=NODES),
}


# -- one process, the reference (test_fsdp_state_sharding._reference) -----------------------


def _seeded_init() -> dict[str, torch.Tensor]:
    """``reset_parameters()`` of each linear in module order after ``manual_seed(SEED)``."""
    m = MLP()
    torch.manual_seed(SEED)
    for lin in (m.a, m.b, m.c):
        lin.reset_parameters()
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


# -- helpers run on every rank ---------------------------------------------------------------


def _sharded(mesh: DeviceMesh, sharding: StateSharding) -> MLP:
    m = MLP()
    m.load_state_dict(INIT)
    for sub in (m.a, m.b, m):
        fully_shard(sub, mesh=mesh, state_sharding=sharding)
    return m


def _units(m: nn.Module) -> list:
    """The FSDP units of ``m``, innermost first (the root last)."""
    return [sub._fsdp_state.unit for sub in m.modules() if hasattr(sub, "_fsdp_state")][::-1]


def _counts(m: nn.Module) -> dict[tuple[str, tuple[str, ...]], list[int]]:
    """``by_dims`` summed over the units: (kind, dims) -> [count, bytes]."""
    out: dict[tuple[str, tuple[str, ...]], list[int]] = {}
    for unit in _units(m):
        for key, (n, nbytes) in unit.stats.by_dims.items():
            entry = out.setdefault(key, [0, 0])
            entry[0] += n
            entry[1] += nbytes
    return out


def _full(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in m.state_dict().items()}


def _rows(rank: int, ws: int) -> slice:
    per = BATCH // ws
    return slice(rank * per, (rank + 1) * per)


def _train(m: nn.Module, rank: int, ws: int) -> torch.Tensor:
    """``STEPS`` AdamW steps on this rank's rows; the eval output on ``X[STEPS]``."""
    opt = mlp_adamw(m.parameters())
    rows = _rows(rank, ws)
    for s in range(STEPS):
        # .float(): a bf16 output against fp32 targets (torch 2.11's mse_loss backward refuses
        # mixed dtypes; 2.13 promotes, to the same values)
        F.mse_loss(m(X[s, rows]).float(), Y[s, rows]).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        return m(X[STEPS])


# -- 1. gradient accumulation ----------------------------------------------------------------


def _accumulate(rank: int, ws: int, mesh: DeviceMesh, sharding: StateSharding, last: bool):
    """``STEPS`` steps of two micro-batches (halves of this rank's rows, losses halved), sync
    off on the first (and ``set_is_last_backward(False)`` where ``last``). Returns the full
    parameters, the collectives per dim set, and what the first micro-batch of step 0 left:
    reductions issued, the unsharded gradient elements held, whether a sharded ``.grad`` is
    set."""
    m = _sharded(mesh, sharding)
    opt = mlp_adamw(m.parameters())
    rows = _rows(rank, ws)
    half = (rows.stop - rows.start) // 2
    between = None
    for s in range(STEPS):
        for micro in range(2):
            m.set_requires_gradient_sync(micro == 1)
            if last:
                m.set_is_last_backward(micro == 1)
            lo = rows.start + micro * half
            (F.mse_loss(m(X[s, lo:lo + half]), Y[s, lo:lo + half]) / 2).backward()
            if s == 0 and micro == 0:
                reduced = {k: v[0] for k, v in _counts(m).items() if k[0] != "all_gather"}
                held = sum(g.numel() for u in _units(m) for b in u.buffers
                           for g in b.grads.unsharded if g is not None)
                graded = any(p.grad is not None for p in m.parameters())
                between = (reduced, held, graded)
        opt.step()
        # the step leaves the refreshes it issued in flight (waited on at each unit's next
        # unshard); every stepped unit that refreshes has one
        in_flight = [u.refresh._work is not None for u in _units(m)
                     if u.state is UnitState.SHARDED and isinstance(u.refresh, ChunkRefresh)]
        assert in_flight and all(in_flight)
        opt.zero_grad()
    return _full(m), {k: v[0] for k, v in _counts(m).items()}, between


# -- 2. activation checkpointing ---------------------------------------------------------------


class CheckpointedMLP(MLP):
    """``MLP`` whose blocks ``a`` and ``b`` run under ``torch.utils.checkpoint`` (recomputed,
    with their pre-forward hooks, in backward)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(checkpoint(self.a, x, use_reentrant=False))
        return self.c(torch.relu(checkpoint(self.b, h, use_reentrant=False)))


def _checkpointed(rank: int, ws: int, mesh: DeviceMesh, how: str):
    m = CheckpointedMLP() if how == "utils" else MLP()
    m.load_state_dict(INIT)
    if how == "wrapper":
        m.a, m.b = checkpoint_wrapper(m.a), checkpoint_wrapper(m.b)
    for sub in (m.a, m.b, m):
        fully_shard(sub, mesh=mesh, state_sharding=SHARDINGS["amsp"])
    out = _train(m, rank, ws)
    return out, _full(m)


# -- 3. meta-device init -------------------------------------------------------------------------


def _meta_init(rank: int, ws: int, mesh: DeviceMesh, sharding: StateSharding):
    with torch.device("meta"):
        m = MLP()
    for sub in (m.a, m.b, m):
        fully_shard(sub, mesh=mesh, state_sharding=sharding)
    m.to_empty(device="cpu")
    torch.manual_seed(SEED)
    for lin in (m.a, m.b, m.c):
        lin.reset_parameters()
    initialized = _full(m)
    return initialized, _train(m, rank, ws), _full(m)


# -- 4. bf16 mixed precision -------------------------------------------------------------------


def _bf16(rank: int, ws: int, mesh: DeviceMesh, runtime: str, sharding: StateSharding | None):
    m = MLP()
    m.load_state_dict(INIT)
    for sub in (m.a, m.b, m):
        if runtime == "ours":
            fully_shard(sub, mesh=mesh, state_sharding=sharding, mp_policy=BF16)
        else:
            fsdp2_fully_shard(sub, mesh=mesh, mp_policy=BF16)
    out = _train(m, rank, ws).float()  # the output is in param_dtype
    return out, _full(m)


# -- 6. CommDebugMode --------------------------------------------------------------------------

_KINDS = {
    "allgather_into_tensor_coalesced_": "all_gather", "_allgather_base_": "all_gather",
    "allgather_": "all_gather", "broadcast_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "allreduce_": "all_reduce",
    "alltoall_base_": "reduce_scatter",  # gloo's reduce-scatter (_compat), this runtime's only
}


def _nbytes(x: object) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(_nbytes(t) for t in x)


class DimsCommMode(CommDebugMode):
    """``CommDebugMode`` that also files each c10d collective under (kind, mesh dims of its
    group, from ``dims_of``: group ranks -> dims) with its bytes (all-gather: output,
    reduce-scatter: input, all-reduce: the tensor), as ``CommStats.by_dims`` counts them."""

    def __init__(self, dims_of: dict[tuple[int, ...], tuple[str, ...]]) -> None:
        super().__init__()
        self.dims_of = dims_of
        self.by_dims: dict[tuple[str, tuple[str, ...]], list[int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        schema = getattr(func, "_schema", None)
        namespace, _, name = schema.name.partition("::") if schema is not None else ("", "", "")
        if namespace == "c10d" and name in _KINDS:
            kind = _KINDS[name]
            group = next(a for a in args if isinstance(a, torch.ScriptObject))
            ranks = tuple(dist.get_process_group_ranks(dist.ProcessGroup.unbox(group)))
            payload = args[1] if kind == "reduce_scatter" else args[0]
            entry = self.by_dims.setdefault((kind, self.dims_of[ranks]), [0, 0])
            entry[0] += 1
            entry[1] += _nbytes(payload)
        return super().__torch_dispatch__(func, types, args, kwargs)


def _amsp_formula(numels: list[int], size: int) -> dict[tuple[str, tuple[str, ...]], list[int]]:
    """Collectives and bytes of one AMSP step on a 2x2 mesh (P = intra, G = O = both) for units
    of ``numels`` parameters (unpadded; the root last, kept for backward), parameters of
    ``size`` bytes: each unit refreshes over inter (the parameter chunk, 1/|intra|),
    all-gathers over intra in forward and backward (the whole unit), reduce-scatters over intra
    (the whole unit) then over inter (the parameter chunk)."""
    *blocks, root = numels
    total = sum(numels) * size
    return {
        ("all_gather", ("inter",)): [len(numels), total // 2],
        ("all_gather", ("intra",)): [2 * len(blocks) + 1, (2 * sum(blocks) + root) * size],
        ("reduce_scatter", ("intra",)): [len(numels), total],
        ("reduce_scatter", ("inter",)): [len(numels), total // 2],
    }


def _comm_debug(rank: int, ws: int, mesh: DeviceMesh):
    """AMSP, per step: (what ``CommDebugMode`` saw by dims, its total count, ``by_dims``'s
    increment), and the units' parameter counts."""
    m = _sharded(mesh, SHARDINGS["amsp"])
    sm = _units(m)[0].dp
    dims_of = {
        tuple(dist.get_process_group_ranks(level.group)): level.dims
        for level in (sm.params, sm.grads, sm.refresh, sm.reduce, sm.optim, sm.replicate)
        if level.group is not None
    }
    opt = mlp_adamw(m.parameters())
    rows = _rows(rank, ws)
    steps = []
    F.mse_loss(m(X[0, rows]), Y[0, rows]).backward()  # unmeasured: the first forward's refresh
    opt.step()
    opt.zero_grad()
    for s in range(1, STEPS):
        before = _counts(m)
        with DimsCommMode(dims_of) as mode:
            F.mse_loss(m(X[s, rows]), Y[s, rows]).backward()
            opt.step()
            opt.zero_grad()
        after = _counts(m)
        delta = {k: [v[0] - before.get(k, [0, 0])[0], v[1] - before.get(k, [0, 0])[1]]
                 for k, v in after.items()}
        steps.append((mode.by_dims, mode.get_total_counts(), delta))
    numels = [sum(p.numel() for p in u.sharded_params) for u in _units(m)]
    return steps, numels, len(list(m.parameters()))


# -- 8. parameters written outside an optimizer ------------------------------------------------


def _scaled(init: dict[str, torch.Tensor], factor: float) -> dict[str, torch.Tensor]:
    return {k: v * factor + 0.01 for k, v in init.items()}


def _writes(rank: int, ws: int, mesh: DeviceMesh, checkpoint_dir: str):
    """AMSP: the eval output and the refreshes (all-gathers over inter) of each forward after
    each way of writing the sharded parameters, and of a second forward with no write."""
    m = _sharded(mesh, SHARDINGS["amsp"])
    refresh = ("all_gather", ("inter",))

    def forward() -> tuple[torch.Tensor, int]:
        before = _counts(m).get(refresh, [0])[0]
        with torch.no_grad():
            out = m(X[STEPS])
        return out, _counts(m).get(refresh, [0])[0] - before

    out = {"init": forward(), "again": forward()}
    m.load_state_dict(_scaled(INIT, 0.5))
    out["load_state_dict"] = forward()
    with torch.no_grad(), implicit_replication():
        for k, p in m.named_parameters():
            p.copy_(_scaled(INIT, -1.0)[k])
    out["copy_"] = forward()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(2.0)
    out["mul_"] = forward()
    m.to_empty(device="cpu")
    m.load_state_dict(_scaled(INIT, 0.25))
    out["to_empty"] = forward()
    dcp.save(get_model_state_dict(m), checkpoint_id=checkpoint_dir)
    m.load_state_dict(_scaled(INIT, 2.0))
    forward()
    dcp.load(get_model_state_dict(m), checkpoint_id=checkpoint_dir)  # in place, as documented
    out["dcp.load"] = forward()
    out["again_after"] = forward()
    return out


# -- 7. bad input ------------------------------------------------------------------------------


def _fresh() -> MLP:
    m = MLP()
    m.load_state_dict(INIT)
    return m


def _bad_calls(mesh: DeviceMesh) -> dict[str, Callable[[], object]]:
    """Calls that must each raise before any collective, by what is wrong."""
    bad = StateSharding(params=("intra",), grads=BOTH, optim=BOTH)
    amsp_model = fully_shard(_fresh(), mesh=mesh, state_sharding=SHARDINGS["amsp"])
    calls = {
        "dim not in mesh": lambda: fully_shard(
            _fresh(), mesh=mesh, state_sharding=StateSharding(("gpus",), ("gpus",), ("gpus",))),
        "nesting rule": lambda: StateSharding(params=BOTH, grads=("intra",), optim=BOTH),
        "out of mesh order": lambda: fully_shard(
            _fresh(), mesh=mesh, state_sharding=StateSharding((), (), ("intra", "inter"))),
        "tp dim named": lambda: bad.validate(mesh, tp_dims=("intra",)),
        "not a StateSharding": lambda: fully_shard(
            _fresh(), mesh=mesh, state_sharding={"params": ("intra",)}),
        "shards nothing": lambda: fully_shard(
            _fresh(), mesh=mesh, state_sharding=StateSharding((), (), ())),
        "offload": lambda: fully_shard(_fresh(), mesh=mesh, state_sharding=bad,
                                       offload_policy=CPUOffloadPolicy(pin_memory=False)),
        "int reshard_after_forward": lambda: fully_shard(
            _fresh(), mesh=mesh, state_sharding=bad, reshard_after_forward=2),
        "set_requires_all_reduce": lambda: amsp_model.set_requires_all_reduce(False),
        "set_custom_all_gather": lambda: amsp_model.set_custom_all_gather(lambda *a, **k: None),
        "set_custom_reduce_scatter": lambda: amsp_model.set_custom_reduce_scatter(
            lambda *a, **k: None),
    }
    if DataParallelMeshDims is not None:
        calls["dp_mesh_dims"] = lambda: fully_shard(
            _fresh(), mesh=mesh, state_sharding=bad,
            dp_mesh_dims=DataParallelMeshDims(shard="intra"))
    return calls


def _tp_call() -> Callable[[], object]:
    """A state_sharding naming the tensor-parallel dim of a unit with TP parameters (on the
    whole ``("dp", "tp")`` mesh, whose ``tp`` dim the parameters are sharded over)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    lin = parallelize_module(nn.Linear(8, 8), mesh["tp"], ColwiseParallel())
    tp = StateSharding(params=("tp",), grads=("tp",), optim=("dp", "tp"))
    return lambda: fully_shard(lin, mesh=mesh, state_sharding=tp)


def _bad_input(mesh: DeviceMesh) -> dict[str, tuple[str, str, int, int]]:
    """Per bad call: the exception's type and message, and the c10d collectives and process
    groups it issued."""
    calls = _bad_calls(mesh)
    calls["tp dim in fully_shard"] = _tp_call()
    out = {}
    for name, call in calls.items():
        new_group = mock.patch.object(dist, "new_group", wraps=dist.new_group)
        with new_group as groups, CommDebugMode() as mode:
            try:
                call()
                raised = ("", "")
            except (ValueError, TypeError) as e:
                raised = (type(e).__name__, str(e))
        out[name] = (*raised, mode.get_total_counts(), groups.call_count)
    return out


# -- the 4-rank spawn --------------------------------------------------------------------------


def _every_feature(rank: int, ws: int, checkpoint_dir: str):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=BOTH)
    r = {"accumulate": {}, "checkpoint": {}, "meta": {}, "bf16": {}}
    for name in ACCUMULATED:
        r["accumulate"][name] = _accumulate(rank, ws, mesh, SHARDINGS[name], last=False)
    r["accumulate"]["amsp_last"] = _accumulate(rank, ws, mesh, SHARDINGS["amsp"], last=True)
    r["checkpoint"]["none"] = _train(_sharded(mesh, SHARDINGS["amsp"]), rank, ws)
    for how in ("wrapper", "utils"):
        r["checkpoint"][how] = _checkpointed(rank, ws, mesh, how)
    for name in ("amsp", "zero1"):
        r["meta"][name] = _meta_init(rank, ws, mesh, SHARDINGS[name])
    for name in ("amsp", "hsdp_inter"):
        r["bf16"][name] = _bf16(rank, ws, mesh, "ours", SHARDINGS[name])
    r["bf16"]["fsdp2_hsdp"] = _bf16(rank, ws, mesh, "fsdp2", None)  # sharded over intra
    swapped = DeviceMesh("cpu", mesh.mesh.T, mesh_dim_names=("intra", "inter"))
    r["bf16"]["fsdp2_hsdp_inter"] = _bf16(rank, ws, swapped, "fsdp2", None)
    r["comm"] = _comm_debug(rank, ws, mesh)
    r["writes"] = _writes(rank, ws, mesh, checkpoint_dir)
    r["bad"] = _bad_input(mesh)
    return r


@pytest.fixture(scope="module")
def every_feature(tmp_path_factory):
    return run_gloo(_every_feature, 4, str(tmp_path_factory.mktemp("dcp")))


def _assert_params(full: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], what: str,
                   atol: float = TOL) -> None:
    assert full.keys() == ref.keys(), what
    for k, v in ref.items():
        torch.testing.assert_close(full[k], v, atol=atol, rtol=0, msg=f"{what} {k}")


@pytest.mark.multiprocess
def test_gradient_accumulation_reduces_once_per_step(every_feature):
    """Two micro-batches per step, sync off on the first: parameters as one process on the
    whole batch; every reduction once per step, none after the first micro-batch, which leaves
    the whole model's unsharded gradients held (this plan pads nothing) and no ``.grad``
    (nested.py's docstring)."""
    ref, _ = mlp_reference()
    numel = sum(v.numel() for v in ref.values())
    for rank in every_feature:
        for name, (full, counts, between) in rank["accumulate"].items():
            sharding = SHARDINGS[name.removesuffix("_last")]
            _assert_params(full, ref, name)
            p = sharding.params
            refresh = tuple(d for d in sharding.optim if d not in p)
            # before the first forward, then after each step (issued by the step)
            want = {("all_gather", refresh): 3 * (STEPS + 1)}
            if p:
                want[("all_gather", p)] = 2 * 5 * STEPS  # two forwards, two backwards
                want[("reduce_scatter", p)] = 3 * STEPS
            grads = tuple(d for d in sharding.grads if d not in p)
            if grads:
                want[("reduce_scatter", grads)] = 3 * STEPS
            rest = tuple(d for d in BOTH if d not in sharding.grads)
            if rest:
                want[("all_reduce", rest)] = 3 * STEPS
            assert counts == want, name
            reduced, held, graded = between
            assert reduced == {} and held == numel and not graded, name


@pytest.mark.multiprocess
def test_activation_checkpointing_under_amsp_equals_no_checkpointing(every_feature):
    ref, ref_out = mlp_reference()
    for rank in every_feature:
        plain = rank["checkpoint"]["none"]
        torch.testing.assert_close(plain, ref_out, atol=TOL, rtol=0)
        for how in ("wrapper", "utils"):
            out, full = rank["checkpoint"][how]
            assert torch.equal(out, plain), how  # recomputation changes no value
            _assert_params(full, ref, how)


@pytest.mark.multiprocess
def test_meta_init_with_reset_parameters_equals_one_process(every_feature):
    """The RNG contract on the nested layout: ``reset_parameters()`` of the sharded parameters
    draws the single-device tensors, then trains as one process."""
    init = _seeded_init()
    ref, ref_out = mlp_reference(init)
    for rank in every_feature:
        for name, (initialized, out, full) in rank["meta"].items():
            for k, v in init.items():
                assert torch.equal(initialized[k], v), (name, k)
            torch.testing.assert_close(out, ref_out, atol=TOL, rtol=0, msg=name)
            _assert_params(full, ref, name)


@pytest.mark.multiprocess
def test_bf16_mixed_precision_matches_fsdp2_hsdp(every_feature):
    """``param_dtype=bf16, reduce_dtype=fp32``: AMSP and hsdp-over-inter bitwise equal to
    FSDP2 HSDP with the same policy (sharded over intra, and over inter on the swapped mesh);
    all of them within bf16's rounding of one fp32 process."""
    ref, ref_out = mlp_reference()
    for rank in every_feature:
        theirs_out, theirs = rank["bf16"]["fsdp2_hsdp"]
        for name in ("amsp", "hsdp_inter", "fsdp2_hsdp_inter"):
            out, full = rank["bf16"][name]
            assert torch.equal(out, theirs_out), name
            assert full.keys() == theirs.keys()
            assert all(torch.equal(full[k], v) for k, v in theirs.items()), name
        _assert_params(theirs, ref, "bf16", BF16_PARAMS_VS_FP32)
        torch.testing.assert_close(theirs_out, ref_out, atol=BF16_OUT_VS_FP32, rtol=0)
        assert theirs["a.weight"].dtype == torch.float32


@pytest.mark.multiprocess
def test_comm_debug_mode_sees_by_dims_and_the_formula_per_step(every_feature):
    """AMSP, per step: the c10d collectives ``CommDebugMode`` sees, by the mesh dims of their
    group, equal ``by_dims``'s increment plus two all-reduces over both dims that move no
    state: one byte per parameter (:func:`~ragged_placement.fsdp.state.drop_unused_grads`) and
    one byte per unit (the refresh agreement, :func:`~ragged_placement.fsdp.state.
    agree_on_refreshes`), and ``by_dims`` equals the formula from the parameter counts."""
    for rank in every_feature:
        steps, numels, n_params = rank["comm"]
        formula = _amsp_formula(numels, 4)
        for seen, total, delta in steps:
            assert delta == formula
            assert seen == {**delta, ("all_reduce", BOTH): [2, n_params + len(numels)]}
            assert total == sum(n for n, _ in seen.values())


@pytest.mark.multiprocess
def test_parameters_written_outside_the_optimizer_are_refreshed(every_feature):
    """``load_state_dict``, ``copy_`` and an in-place op on the sharded parameters,
    ``to_empty`` then a load, and ``dcp.load`` into ``get_model_state_dict``'s tensors: the
    next forward sees the new values (one refresh over inter per unit); a forward with no
    write in between refreshes nothing."""
    ref = MLP()

    def expected(state: dict[str, torch.Tensor]) -> torch.Tensor:
        ref.load_state_dict(state)
        with torch.no_grad():
            return ref(X[STEPS])

    want = {
        "init": (expected(INIT), 3), "again": (expected(INIT), 0),
        "load_state_dict": (expected(_scaled(INIT, 0.5)), 3),
        "copy_": (expected(_scaled(INIT, -1.0)), 3),
        "mul_": (expected({k: 2 * v for k, v in _scaled(INIT, -1.0).items()}), 3),
        "to_empty": (expected(_scaled(INIT, 0.25)), 3),
        "dcp.load": (expected(_scaled(INIT, 0.25)), 3),
        "again_after": (expected(_scaled(INIT, 0.25)), 0),
    }
    for rank in every_feature:
        assert rank["writes"].keys() == want.keys()
        for name, (out, refreshes) in rank["writes"].items():
            torch.testing.assert_close(out, want[name][0], atol=TOL, rtol=0, msg=name)
            assert refreshes == want[name][1], name


# what each bad call's message names: the argument and the value or the fix
BAD_MESSAGES = {
    "dim not in mesh": ("ValueError", r"params=\('gpus',\).*not a dim of the mesh"),
    "nesting rule": ("ValueError", r"params ⊆ grads ⊆ optim.*add \['inter'\] to grads"),
    "out of mesh order": ("ValueError", r"optim=\('intra', 'inter'\).*out of the mesh's order"),
    "tp dim named": ("ValueError", r"tensor-parallel dim\(s\) \['intra'\]"),
    "not a StateSharding": ("TypeError", r"state_sharding must be .*StateSharding, got dict"),
    "shards nothing": ("ValueError", r"state_sharding=P\(\) G\(\) OS\(\) shards no state"),
    "offload": ("ValueError", r"offload_policy=CPUOffloadPolicy\(pin_memory=False\) with "
                r"state_sharding=.*; pass offload_policy=OffloadPolicy\(\), or drop "
                r"state_sharding"),
    "int reshard_after_forward": ("ValueError", r"reshard_after_forward=2 with state_sharding"),
    "dp_mesh_dims": ("ValueError", r"^dp_mesh_dims=DataParallelMeshDims\(.*\) with state_sharding"),
    "set_requires_all_reduce": ("ValueError", r"set_requires_all_reduce\(False\) on FSDPMLP"),
    "set_custom_all_gather": ("ValueError", r"custom all-gather .* on FSDPMLP"),
    "set_custom_reduce_scatter": ("ValueError", r"custom all-gather .* on FSDPMLP"),
    "tp dim in fully_shard": ("ValueError", r"parameter weight is tensor-parallel over mesh dim.*mesh=mesh\[.dp.\]"),
}


@pytest.mark.multiprocess
def test_bad_input_raises_naming_the_argument_before_any_collective(every_feature):
    for rank in every_feature:
        names = set(BAD_MESSAGES) - ({"dp_mesh_dims"} if DataParallelMeshDims is None else set())
        assert rank["bad"].keys() == names
        for name, (kind, message, collectives, groups) in rank["bad"].items():
            want_kind, pattern = BAD_MESSAGES[name]
            assert kind == want_kind, (name, kind, message)
            assert re.search(pattern, message), (name, message)
            assert collectives == 0, (name, collectives)
            assert groups == 0, (name, groups)


# -- 5. 8 ranks as 2x2x2 -----------------------------------------------------------------------


def _partial_points(rank: int, ws: int):
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=NODES)
    out = {}
    for name, sharding in PARTIAL_8.items():
        m = _sharded(mesh, sharding)
        eval_out = _train(m, rank, ws)
        local = sum(p.to_local().numel() for p in m.parameters())
        out[name] = (eval_out, _full(m), local)
    return out


def test_partial_points_on_2x2x2_match_one_process():
    """AMSP's partial sharding inside a node on 8 ranks, and a point whose optimizer ranks are
    out of mesh order: parameters, eval output, and 1/8 of the parameters per rank. Threaded
    ranks (2 s; 8 gloo processes take minutes on 2 busy cores): the groups and their rank
    order are what is new here, the gloo collectives are the 2x2 tests'."""
    ref, ref_out = mlp_reference()
    numel = sum(v.numel() for v in ref.values())
    ranks = run_threaded(_partial_points, 8)
    for name in PARTIAL_8:
        for results in ranks:
            out, full, _ = results[name]
            torch.testing.assert_close(out, ref_out, atol=TOL, rtol=0, msg=name)
            _assert_params(full, ref, name)
        assert sum(r[name][2] for r in ranks) == numel, name
