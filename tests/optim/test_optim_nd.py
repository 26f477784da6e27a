"""Muon and Shampoo on parameters of 2-D meshes (FSDP x TP, HSDP) equal their single-device runs.

Parameters sharded over one mesh dim (HSDP, a plain parameter on an FSDP x TP mesh) take the
batched exchange over that dim's group; they must equal, bitwise, the per-matrix DTensor
redistribution path (forced here by patching the optimizers' routing predicate) with fewer
collectives (``CommDebugMode`` on 4 gloo processes).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import threading
import warnings
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_gloo, run_threaded
from hypothesis import given, settings
from hypothesis import strategies as st
from ragged_placement.optim import Muon, Shampoo
from ragged_placement.optim import muon as muon_module
from ragged_placement.optim import shampoo as shampoo_module
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from ragged_placement import RaggedShard

warnings.filterwarnings("ignore", category=FutureWarning)

SHAPES = [(8, 6), (12, 4), (4, 10), (3, 8, 4)]
LAYOUTS = [  # (dp, tp) placements of each parameter
    [RaggedShard((0,), (1, 1), split_factor=2), Shard(0)],   # colwise TP under FSDP
    [RaggedShard((0,), (2, 1)), Shard(1)],                    # rowwise TP under FSDP
    [RaggedShard((0,), (0, 1)), Replicate()],                 # plain parameter, FSDP x TP mesh
    [Replicate(), RaggedShard((0, 1), (1, 3))],               # HSDP: (replicate, shard), 3-D stack
]


def _fulls(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _train(rank: int, world_size: int, steps: int):
    mesh = init_device_mesh("cpu", (2, 2))
    params = [torch.nn.Parameter(distribute_tensor(f, mesh, pl)) for f, pl in zip(_fulls(0), LAYOUTS)]
    opt = Muon(params, lr=0.02, momentum=0.95, nesterov=True)
    for step in range(steps):
        for p, g in zip(params, _fulls(100 + step)):
            p.grad = distribute_tensor(g, mesh, p.placements)
        opt.step()
    assert opt.last_step_info.nd_matrices == 2  # the two TP layouts
    return [p.full_tensor() for p in params]


def _single_device(make_opt, steps: int) -> list[torch.nn.Parameter]:
    """The reference: full tensors on one device, the same gradients as the ranks see."""
    ref = [torch.nn.Parameter(f.clone()) for f in _fulls(0)]
    opt = make_opt(ref)
    for step in range(steps):
        for p, g in zip(ref, _fulls(100 + step)):
            p.grad = g
        opt.step()
    return ref


def test_muon_on_2d_meshes_matches_single_device():
    results = run_threaded(_train, 4, 5)
    ref = _single_device(lambda ps: Muon(ps, lr=0.02, momentum=0.95, nesterov=True), 5)
    for rank_result in results:
        for got, want in zip(rank_result, ref):
            # the same bf16 Newton-Schulz on the same full matrix: equal up to fp32 update order
            torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-6)


def _train_shampoo(rank: int, world_size: int, steps: int):
    from ragged_placement.optim import Shampoo

    mesh = init_device_mesh("cpu", (2, 2))
    params = [torch.nn.Parameter(distribute_tensor(f, mesh, pl)) for f, pl in zip(_fulls(0), LAYOUTS)]
    opt = Shampoo(params, lr=1e-2, max_preconditioner_dim=4, precondition_frequency=2, grafting="adam")
    for step in range(steps):
        for p, g in zip(params, _fulls(100 + step)):
            p.grad = distribute_tensor(g, mesh, p.placements)
        opt.step()
    return [p.full_tensor() for p in params]


def test_shampoo_on_2d_meshes_matches_single_device():
    from ragged_placement.optim import Shampoo

    results = run_threaded(_train_shampoo, 4, 4)
    ref = _single_device(
        lambda ps: Shampoo(ps, lr=1e-2, max_preconditioner_dim=4, precondition_frequency=2, grafting="adam"),
        4,
    )
    for rank_result in results:
        for got, want in zip(rank_result, ref):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


HSDP_LAYOUTS = [  # one sharded mesh dim, the other Replicate
    [Replicate(), RaggedShard((0,), (1, 1))],  # HSDP (replicate, shard), rows cut
    [Replicate(), Shard(0)],
    [RaggedShard((0,), (1, 3)), Replicate()],  # plain parameter on an (FSDP, TP) mesh
    [Replicate(), RaggedShard((0, 1), (1, 3))],  # 3-D stack, matrices cut
]
MATRICES = 6  # in SHAPES: three matrices and a stack of three
MUON_OPTS = {"lr": 0.02, "momentum": 0.95, "nesterov": True}
SHAMPOO_OPTS = {"lr": 1e-2, "max_preconditioner_dim": 4, "precondition_frequency": 2}
SHAMPOO_ATOL = {"rtol": 1e-5, "atol": 1e-6}  # test_shampoo_on_2d_meshes_matches_single_device's


def _every_nd_param_per_matrix(tensor: torch.Tensor) -> bool:
    """The routing before the batched N-D path: every parameter on an N-D mesh per matrix."""
    return isinstance(tensor, DTensor) and tensor.device_mesh.ndim > 1


@contextlib.contextmanager
def _per_matrix_path():
    with mock.patch.object(
        muon_module, "sharded_on_several_dims", _every_nd_param_per_matrix
    ), mock.patch.object(shampoo_module, "sharded_on_several_dims", _every_nd_param_per_matrix):
        yield


@contextlib.contextmanager
def _counting_matrix_math() -> Iterator[collections.Counter]:
    """Count, per rank, the matrices each Newton-Schulz call orthogonalizes (Muon) and the
    inverse roots (Shampoo's ``matrix_power`` calls)."""
    counts: collections.Counter = collections.Counter()
    lock = threading.Lock()

    def counting(fn):
        def wrapper(x, *args, **kwargs):
            with lock:
                counts[dist.get_rank() if dist.is_initialized() else 0] += math.prod(x.shape[:-2])
            return fn(x, *args, **kwargs)

        return wrapper

    with mock.patch.object(
        muon_module, "newton_schulz", counting(muon_module.newton_schulz)
    ), mock.patch.object(shampoo_module, "matrix_power", counting(shampoo_module.matrix_power)):
        yield counts


def _make(optimizer: str, params):
    return Muon(params, **MUON_OPTS) if optimizer == "muon" else Shampoo(params, **SHAMPOO_OPTS)


def _train_mesh(rank, world_size, optimizer, steps, mesh_shape, layouts):
    """Full parameters after ``steps`` and the collectives of each step (``CommDebugMode``)."""
    mesh = init_device_mesh("cpu", mesh_shape)
    params = [torch.nn.Parameter(distribute_tensor(f, mesh, pl)) for f, pl in zip(_fulls(0), layouts)]
    opt = _make(optimizer, params)
    counts = []
    for step in range(steps):
        for p, g in zip(params, _fulls(100 + step)):
            p.grad = distribute_tensor(g, mesh, p.placements)
        with CommDebugMode() as comm:
            opt.step()
        counts.append(comm.get_total_counts())
    return [p.full_tensor() for p in params], counts


def _reference(optimizer: str, steps: int):
    """One process on the full tensors, and its Newton-Schulz matrices / inverse roots."""
    with _counting_matrix_math() as math_counts:
        ref = _single_device(functools.partial(_make, optimizer), steps)
    return [p.detach() for p in ref], math_counts[0]


def _assert_matches_reference(optimizer: str, got, want) -> None:
    for a, b in zip(got, want):
        if optimizer == "muon":  # the same bf16 Newton-Schulz on the same full matrix
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        else:
            torch.testing.assert_close(a, b, **SHAMPOO_ATOL)


def test_one_sharded_dim_batched_equals_per_matrix_path_bitwise():
    """4 threaded ranks, 2x2 mesh, Muon and Shampoo: bitwise equal to the per-matrix path."""
    for optimizer in ("muon", "shampoo"):
        batched = run_threaded(_train_mesh, 4, optimizer, 3, (2, 2), HSDP_LAYOUTS)
        with _per_matrix_path():
            per_matrix = run_threaded(_train_mesh, 4, optimizer, 3, (2, 2), HSDP_LAYOUTS)
        for (got, _), (want, _) in zip(batched, per_matrix):
            for a, b in zip(got, want):
                assert torch.equal(a, b), (optimizer, (a - b).abs().max())


def _hsdp_gloo(rank: int, world_size: int, steps: int):
    out = {}
    for optimizer in ("muon", "shampoo"):
        with _counting_matrix_math() as batched_math:
            batched = _train_mesh(rank, world_size, optimizer, steps, (2, 2), HSDP_LAYOUTS)
        with _per_matrix_path(), _counting_matrix_math() as per_matrix_math:
            per_matrix = _train_mesh(rank, world_size, optimizer, steps, (2, 2), HSDP_LAYOUTS)
        out[optimizer] = (batched, batched_math[rank], per_matrix, per_matrix_math[rank])
    out["state_sharding"] = _state_sharding_gloo(rank, world_size, steps)
    return out


@pytest.mark.multiprocess
def test_hsdp_one_owner_per_matrix_in_the_world_gloo():
    """4 gloo ranks, 2x2 mesh, Muon and Shampoo (B=4 row slabs cut by the placements), 3 steps.

    Equal to one process, and bitwise to the per-matrix path; every Newton-Schulz (Shampoo:
    every inverse root) runs once in the world, where the per-matrix path runs it once per
    replica row (twice); collectives per step: per process group (the parameters shard over two
    mesh dims here), one all-to-all each way (none where no piece moves) and one all-gather
    over the replica dim, instead of one collective per matrix and direction. In the same spawn:
    Muon and Shampoo under ``fully_shard(state_sharding=...)``
    (:func:`_assert_state_sharding_matches_one_process`).
    """
    steps = 3
    results = run_gloo(_hsdp_gloo, 4, steps)
    for optimizer in ("muon", "shampoo"):
        want, ref_math = _reference(optimizer, steps)
        for (got, batched), _, (per_matrix_got, per_matrix), _ in (r[optimizer] for r in results):
            _assert_matches_reference(optimizer, got, want)
            assert all(torch.equal(a, b) for a, b in zip(got, per_matrix_got)), optimizer
            # two process groups x (2 all-to-alls + 1 all-gather); an all-to-all pair is
            # skipped where no item owned in the rank's row has a piece elsewhere
            assert all(4 <= c <= 6 for c in batched), (optimizer, batched)
            assert per_matrix == [2 * len(HSDP_LAYOUTS)] * steps, (optimizer, per_matrix)
        batched_math = [r[optimizer][1] for r in results]
        per_matrix_math = [r[optimizer][3] for r in results]
        assert sum(batched_math) == ref_math, (optimizer, batched_math, ref_math)
        assert sum(per_matrix_math) == 2 * ref_math, (optimizer, per_matrix_math, ref_math)
    assert _reference("muon", steps)[1] == MATRICES * steps
    _assert_state_sharding_matches_one_process([r["state_sharding"] for r in results], steps)


UNITS = {  # RaggedShard units per sharded-dim size; sums divide every SHAPES row count (4)
    1: [(1,)],
    2: [(1, 1), (0, 1), (1, 3), (2, 2), (4, 0)],
    3: [(1, 1, 2), (0, 2, 2), (1, 0, 3), (0, 0, 1), (2, 1, 1)],
}


def _random_layouts(draw, mesh_shape: tuple[int, ...]) -> list[list]:
    """Per parameter of SHAPES: one sharded mesh dim (random), the others Replicate."""
    layouts = []
    for shape in SHAPES:
        dim = draw(st.integers(0, len(mesh_shape) - 1))
        units = draw(st.sampled_from(UNITS[mesh_shape[dim]]))
        dims = (0,) if len(shape) == 2 else (0, 1)
        shard = draw(st.sampled_from([RaggedShard(dims, units), Shard(0)]))
        if isinstance(shard, Shard) and len(shape) == 3:
            shard = RaggedShard(dims, units)
        layouts.append([shard if m == dim else Replicate() for m in range(len(mesh_shape))])
    return layouts


@settings(max_examples=12, deadline=None)
@given(st.sampled_from([(2, 2), (3, 2), (2, 3), (2, 2, 2)]), st.data())
def test_one_owner_per_matrix_on_random_meshes_threaded(mesh_shape, data):
    """Random meshes (2-D and a 3-D mesh with two Replicate dims), sharded dims and cuts, 2
    steps: Muon and Shampoo equal one process, and the world runs each Newton-Schulz (each
    inverse root) exactly as often as one process does."""
    layouts = _random_layouts(data.draw, mesh_shape)
    world = math.prod(mesh_shape)
    for optimizer in ("muon", "shampoo"):
        want, ref_math = _reference(optimizer, 2)
        with _counting_matrix_math() as counts:
            results = run_threaded(_train_mesh, world, optimizer, 2, mesh_shape, layouts)
        for got, _ in results:
            _assert_matches_reference(optimizer, got, want)
        assert sum(counts.values()) == ref_math, (optimizer, layouts, dict(counts), ref_math)


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(12, 20), torch.nn.Linear(20, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _mlp_optimizer(optimizer: str, model: torch.nn.Module):
    mats = [p for n, p in model.named_parameters() if n.endswith("weight")]
    vecs = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    if optimizer == "muon":
        return Muon([{"params": mats}, {"params": vecs, "algorithm": "adamw", "lr": 1e-2}], lr=0.02)
    # epsilon 1e-3: the statistics of 8-sample batches are rank-deficient, and epsilon 1e-12
    # would amplify the reduce-scatter's summation order by (1e-12)^-0.25
    return Shampoo(mats + vecs, lr=1e-2, max_preconditioner_dim=8, precondition_frequency=2,
                   epsilon=1e-3)


def _mlp_train(optimizer: str, steps: int, rank: int = 0, world: int = 1, mesh=None, sharding=None):
    from ragged_placement.fsdp import fully_shard

    g = torch.Generator().manual_seed(0)
    torch.manual_seed(1)
    model = _MLP()
    x, y = torch.randn(steps, 8, 12, generator=g), torch.randn(steps, 8, 12, generator=g)
    if mesh is not None:
        for sub in (model.a, model):
            fully_shard(sub, mesh=mesh, state_sharding=sharding)
    opt = _mlp_optimizer(optimizer, model)
    for s in range(steps):
        torch.nn.functional.mse_loss(model(x[s].chunk(world)[rank]), y[s].chunk(world)[rank]).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in model.named_parameters()}


def _state_sharding_gloo(rank: int, world_size: int, steps: int):
    from ragged_placement.fsdp import StateSharding

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("inter", "intra"))
    shardings = {
        "hsdp": StateSharding.hsdp(mesh, "intra"),
        "amsp": StateSharding(params=("intra",), grads=("inter", "intra"), optim=("inter", "intra")),
    }
    out = {}
    for optimizer in ("muon", "shampoo"):
        for name, sharding in shardings.items():
            with _counting_matrix_math() as counts:
                got = _mlp_train(optimizer, steps, rank, world_size, mesh, sharding)
            out[optimizer, name] = (got, counts[rank])
    return out




def _assert_state_sharding_matches_one_process(results, steps: int) -> None:
    """``fully_shard(state_sharding=...)`` on the 2x2 mesh (run in the HSDP test's spawn): HSDP's
    ``(replicate, shard)`` parameters and AMSP's, Muon and Shampoo: equal to one process on the
    whole batch, and each Newton-Schulz (each inverse root) runs once in the world."""
    for optimizer in ("muon", "shampoo"):
        with _counting_matrix_math() as ref_counts:
            want = _mlp_train(optimizer, steps)
        for name in ("hsdp", "amsp"):
            for rank_out in results:
                got, _ = rank_out[optimizer, name]
                for k in want:
                    torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
            assert sum(r[optimizer, name][1] for r in results) == ref_counts[0], (optimizer, name)


def _train_mesh_and_submesh(rank: int, world_size: int, optimizer: str, steps: int):
    """Parameters on a 3-D mesh and on its 2-D submesh share the sharded dim's process group
    but not the replica rows: two exchanges."""
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c"))
    meshes = [mesh, mesh["b", "c"], mesh, mesh["b", "c"]]
    units = RaggedShard((0,), (1, 3))
    params = []
    for f, m, dims in zip(_fulls(0), meshes, [(0,), (0,), (0,), (0, 1)]):
        pl = [Replicate()] * (m.ndim - 1) + [RaggedShard(dims, units.local_units)]
        params.append(torch.nn.Parameter(distribute_tensor(f, m, pl)))
    opt = _make(optimizer, params)
    for step in range(steps):
        for p, g in zip(params, _fulls(100 + step)):
            p.grad = distribute_tensor(g, p.device_mesh, p.placements)
        opt.step()
    return [p.full_tensor() for p in params]


def test_parameters_on_a_mesh_and_its_submesh_threaded():
    """8 threaded ranks: a 2x2x2 mesh and its (b, c) submesh in one optimizer, Muon and
    Shampoo, 2 steps, equal one process (before: ``ValueError``, one exchange for both)."""
    for optimizer in ("muon", "shampoo"):
        want, _ = _reference(optimizer, 2)
        for got in run_threaded(_train_mesh_and_submesh, 8, optimizer, 2):
            _assert_matches_reference(optimizer, got, want)


def _strided_shard_is_refused(rank: int, world_size: int):
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (2, 2))
    placements = (_StridedShard(0, split_factor=2), Shard(0))
    local = torch.randn(2, 6, 4)  # an [8, 6, 4] stack, as FSDP2 + EP shards experts
    p = torch.nn.Parameter(DTensor.from_local(local, mesh, placements, run_check=False))
    p.grad = DTensor.from_local(torch.randn(2, 6, 4), mesh, placements, run_check=False)
    for opt in (Muon([p], lr=0.02), Shampoo([p], lr=0.02)):
        with CommDebugMode() as comm, pytest.raises(ValueError, match=r"_StridedShard.*fully_shard"):
            opt.step()
        assert comm.get_total_counts() == 0
    return True


def test_fsdp2_strided_shard_is_refused_naming_it_before_any_collective():
    """torch FSDP2's ``(_StridedShard, Shard(0))`` expert stacks: a ValueError naming the
    placement and the fix, not an error about combining with RaggedShard from inside a
    redistribution."""
    assert all(run_threaded(_strided_shard_is_refused, 4))
