"""DTensor factories, torch's local-shape/offset helpers and random ops on RaggedShard.

* ``torch.distributed.tensor.zeros/ones/empty/full`` give each rank its local shape; torch's
  ``compute_local_shape_and_global_offset`` gives the shape, and the offset where the local
  tensor is one box of the global tensor (``NotImplementedError`` where it is not);
  ``_state_dict_utils._distribute_tensors`` (``broadcast_from_rank0``) takes each rank's region.
* Random ops follow :mod:`ragged_placement.rng`'s contract: every rank holds its region of the
  single-device draw from the same generator state, bit for bit, whatever the world size, units,
  ``split_factor`` or mesh; the generator ends where the single-device draw leaves it.

The reference is ``reference_local`` (the placement written as slicing of the full tensor) and the
single-device op. Simulated ranks share one global RNG, so the threaded tests draw from per-rank
``torch.Generator``s; the gloo test checks the global-generator paths (``F.dropout``,
``torch.distributed.tensor.randn``) in real processes, and
``set_model_state_dict(..., broadcast_from_rank0=True)`` into a ``fully_shard`` model.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.distributed.tensor as dtensor
import torch.nn.functional as F
from common.placement import reference_local
from dist_utils import run_gloo, run_threaded
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed import _state_dict_utils
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ragged_placement import RaggedShard

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", message=".*DTensor random operators may not have complete support.*")
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))


@st.composite
def layout_case(draw):
    """``(mesh_shape, global_shape, placements)``: 1-D meshes of 1-8 ranks (prefix dims 1 or 2,
    ``split_factor`` 1-3, empty runs) and 2-D meshes (RaggedShard with Replicate / Shard, and the
    FSDP + TP pair ``(RaggedShard(sf=T), Shard(0))``)."""
    kind = draw(st.sampled_from(["1d", "1d_flat", "1d_strided", "2d_rep", "2d_rep_first", "2d_tp", "2d_shard1"]))
    if kind.startswith("1d"):
        mesh_shape = (draw(st.integers(1, 8)),)
    else:
        mesh_shape = draw(st.sampled_from([(2, 2), (2, 3), (3, 2), (2, 4), (4, 2), (1, 3)]))
    n = mesh_shape[1] if kind == "2d_rep_first" else mesh_shape[0]
    units = tuple(draw(st.lists(st.integers(0, 3), min_size=n, max_size=n).filter(lambda u: sum(u) > 0)))
    unit_rows = draw(st.integers(1, 3))
    cols = draw(st.integers(1, 3))
    if kind == "1d_flat":  # L = a * b rows over dims (0, 1): runs need not align with dim 0
        rows = unit_rows * sum(units)
        a = draw(st.sampled_from([d for d in range(1, rows + 1) if rows % d == 0]))
        return mesh_shape, (a, rows // a, cols), [RaggedShard((0, 1), units)]
    sf = draw(st.integers(1, 3)) if kind == "1d_strided" else 1
    if kind == "2d_tp":
        sf = mesh_shape[1]
    shape = (unit_rows * sum(units) * sf, cols + (mesh_shape[1] if kind == "2d_shard1" else 0))
    rs = RaggedShard((0,), units, split_factor=sf)
    placements = {
        "1d": [rs], "1d_strided": [rs], "2d_rep": [rs, Replicate()], "2d_rep_first": [Replicate(), rs],
        "2d_tp": [rs, Shard(0)], "2d_shard1": [rs, Shard(1)],
    }[kind]
    return mesh_shape, shape, placements


def _mesh(mesh_shape):
    return init_device_mesh("cpu", mesh_shape)


def _one_box(shape, mesh_shape, coord, placements):
    """The (offset, size) of the local tensor when it is one box of the global tensor (by the
    reference slicing of an index tensor), else None."""
    index = torch.arange(math.prod(shape)).reshape(shape)
    local = reference_local(index, mesh_shape, coord, placements)
    if local.ndim != len(shape):
        return None
    if local.numel() == 0:
        return "empty"
    offset = tuple(int(i) for i in torch.nonzero(index == local.reshape(-1)[0])[0])
    box = index[tuple(slice(o, o + s) for o, s in zip(offset, local.shape))]
    return offset if tuple(box.shape) == tuple(local.shape) and torch.equal(box, local) else None


def _check_shapes_and_factories(rank, world, mesh_shape, shape, placements):
    mesh = _mesh(mesh_shape)
    coord = tuple(mesh.get_coordinate())
    ones = torch.ones(shape)
    expected = tuple(reference_local(ones, mesh_shape, coord, placements).shape)
    for name, make in {
        "zeros": lambda: dtensor.zeros(*shape, device_mesh=mesh, placements=placements),
        "ones": lambda: dtensor.ones(*shape, device_mesh=mesh, placements=placements),
        "empty": lambda: dtensor.empty(*shape, device_mesh=mesh, placements=placements),
        "full": lambda: dtensor.full(shape, 3.0, device_mesh=mesh, placements=placements),
    }.items():
        d = make()
        assert tuple(d.to_local().shape) == expected, (name, tuple(d.to_local().shape), expected)
        assert tuple(d.shape) == tuple(shape) and d.placements == tuple(placements)
        if name != "empty":
            value = {"zeros": 0.0, "ones": 1.0, "full": 3.0}[name]
            assert torch.equal(d.full_tensor(), torch.full(shape, value)), name
    local_shape, empty = compute_local_shape_and_global_offset(shape, mesh, placements, skip_offset=True)
    assert local_shape == expected and empty == ()
    box = _one_box(shape, mesh_shape, coord, placements)
    if box is None:
        with pytest.raises(NotImplementedError, match="local_chunks"):
            compute_local_shape_and_global_offset(shape, mesh, placements)
    else:
        local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
        assert local_shape == expected
        if box != "empty":
            assert offset == box, (offset, box)
    # set_model_state_dict(broadcast_from_rank0=True): every rank's region of the full tensor,
    # into a materialized DTensor and into a meta one
    full = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    real = distribute_tensor(torch.zeros(shape), mesh, placements)
    meta = DTensor.from_local(torch.empty(expected, device="meta"), mesh, placements, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())
    state = {"real": (real, full), "meta": (meta, full), "plain": torch.ones(2)}
    _state_dict_utils._distribute_tensors(state, ["real", "meta", "plain"], torch.device("cpu"))
    ref = reference_local(full, mesh_shape, coord, placements)
    assert state["real"] is real and torch.equal(real.to_local(), ref)
    assert torch.equal(state["meta"].to_local(), ref) and state["meta"].placements == tuple(placements)
    return True


@SETTINGS
@given(case=layout_case())
def test_factories_and_local_shape_helpers_match_reference(case, one_torch_thread):
    mesh_shape, shape, placements = case
    assert all(run_threaded(_check_shapes_and_factories, math.prod(mesh_shape), mesh_shape, shape, placements))


def _draws(x: torch.Tensor, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Every random op of the contract applied in turn to ``x`` (a DTensor or the full tensor);
    the values after each op, and a final draw that shows where the generator ended."""
    out = {}
    with torch.no_grad():
        out["normal_"] = x.normal_(1.0, 2.0, generator=g).clone()
        out["uniform_"] = x.uniform_(-3.0, 3.0, generator=g).clone()
        out["bernoulli_"] = x.bernoulli_(0.3, generator=g).clone()
        out["kaiming_uniform_"] = torch.nn.init.kaiming_uniform_(x, a=math.sqrt(5), generator=g).clone()
        out["xavier_normal_"] = torch.nn.init.xavier_normal_(x, generator=g).clone()
    out["generator_after"] = torch.rand(4, generator=g)
    return out


def _check_random(rank, world, mesh_shape, shape, placements, seed):
    mesh = _mesh(mesh_shape)
    coord = tuple(mesh.get_coordinate())
    d = dtensor.zeros(*shape, device_mesh=mesh, placements=placements)
    got = _draws(d, torch.Generator().manual_seed(seed))
    want = _draws(torch.zeros(shape), torch.Generator().manual_seed(seed))
    for name, value in want.items():
        if name == "generator_after":
            assert torch.equal(got[name], value), "the generator must end where the single-device draw leaves it"
            continue
        local = got[name].to_local()
        assert torch.equal(local, reference_local(value, mesh_shape, coord, placements)), name
        assert got[name].placements == tuple(placements), name
    return True


@SETTINGS
@given(case=layout_case(), seed=st.integers(0, 2**31 - 1))
def test_random_ops_draw_each_rank_region_of_the_single_device_draw(case, seed, one_torch_thread):
    mesh_shape, shape, placements = case
    assert all(run_threaded(_check_random, math.prod(mesh_shape), mesh_shape, shape, placements, seed))


def _check_unsupported(rank, world):
    mesh = _mesh((world,))
    d = dtensor.zeros(4, 2, device_mesh=mesh, placements=[RaggedShard((0,), (1, 3))])
    g = torch.Generator().manual_seed(0)
    for name, call in {
        "bernoulli (tensor p)": lambda: torch.bernoulli(d + 0.5, generator=g),
        "exponential_": lambda: d.exponential_(),
        "random_": lambda: d.random_(0, 10),
    }.items():
        with pytest.raises(NotImplementedError, match="RaggedShard"):
            call()
    if "generator" in torch.ops.aten.randn_like.overloads():  # torch 2.13's randn_like(..., generator=)
        for call in (lambda: torch.randn_like(d, generator=g), lambda: torch.rand_like(d, generator=g)):
            with pytest.raises(NotImplementedError, match="RaggedShard"):
                call()
    from torch.distributed.tensor import _random

    if hasattr(_random, "_calc_first_shard_size"):  # torch 2.13's spec -> RNG offset helper
        with pytest.raises(NotImplementedError, match="ragged_placement.rng"):
            _random._calc_first_shard_size(d._spec)
    return True


def test_random_ops_without_an_exact_rule_raise(one_torch_thread):
    assert all(run_threaded(_check_unsupported, 2))


def _gloo_global_generator(rank: int, world_size: int) -> dict:
    """Paths that draw from the global generator, in real processes (each has its own)."""
    mesh = init_device_mesh("cpu", (world_size,))
    rs = RaggedShard((0,), (2, 0, 1, 3))
    results = {}
    torch.manual_seed(7)
    results["randn"] = dtensor.randn(12, 5, device_mesh=mesh, placements=[rs]).full_tensor()
    results["rand"] = dtensor.rand(12, 5, device_mesh=mesh, placements=[rs]).full_tensor()
    x = dtensor.ones(12, 5, device_mesh=mesh, placements=[rs], requires_grad=True)
    y = F.dropout(x, 0.25, training=True)
    y.sum().backward()
    results["dropout"], results["dropout_grad"] = y.full_tensor(), x.grad.full_tensor()
    results["randn_like"] = torch.randn_like(x).full_tensor()
    results["rand_like"] = torch.rand_like(x).full_tensor()
    results["randint_like"] = torch.randint_like(x, 0, 100).full_tensor()
    out, mask = torch.native_dropout(x.detach() * 3, 0.4, True)
    results["native_dropout"], results["native_dropout_mask"] = out.full_tensor(), mask.full_tensor()
    d = dtensor.zeros(12, 5, device_mesh=mesh, placements=[rs])
    results["init.normal_"] = torch.nn.init.normal_(d).full_tensor()
    mesh2 = init_device_mesh("cpu", (2, 2))
    results["2x2 randn"] = dtensor.randn(12, 5, device_mesh=mesh2,
                                         placements=[RaggedShard((0,), (1, 2), split_factor=2), Shard(0)]).full_tensor()
    results["generator_after"] = torch.rand(3)
    results["broadcast_from_rank0"] = _broadcast_from_rank0(rank, mesh)
    return results


def _broadcast_from_rank0(rank: int, mesh) -> bool:
    """``set_model_state_dict(..., broadcast_from_rank0=True)`` into a fully_shard model (its
    ``_distribute_tensors`` slices each full tensor per rank)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from ragged_placement.fsdp import fully_shard

    reference = _mlp()
    with torch.no_grad():
        for i, p in enumerate(reference.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) + 100 * i)
    model = _mlp()
    fully_shard(model, mesh=mesh)
    state = reference.state_dict() if rank == 0 else {}
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return all(torch.equal(p.full_tensor(), q.detach()) for p, q in zip(model.parameters(), reference.parameters()))


def _single_device_global_generator() -> dict:
    results = {}
    torch.manual_seed(7)
    results["randn"] = torch.randn(12, 5)
    results["rand"] = torch.rand(12, 5)
    x = torch.ones(12, 5, requires_grad=True)
    y = F.dropout(x, 0.25, training=True)
    y.sum().backward()
    results["dropout"], results["dropout_grad"] = y.detach(), x.grad
    results["randn_like"] = torch.randn_like(x)
    results["rand_like"] = torch.rand_like(x)
    results["randint_like"] = torch.randint_like(x, 0, 100)
    results["native_dropout"], results["native_dropout_mask"] = torch.native_dropout(x.detach() * 3, 0.4, True)
    results["init.normal_"] = torch.nn.init.normal_(torch.zeros(12, 5))
    results["2x2 randn"] = torch.randn(12, 5)
    results["generator_after"] = torch.rand(3)
    return results


@pytest.mark.multiprocess
def test_global_generator_paths_and_broadcast_from_rank0_on_4_gloo_ranks():
    want = _single_device_global_generator()
    for rank, got in enumerate(run_gloo(_gloo_global_generator, 4)):
        assert got.pop("broadcast_from_rank0") is True
        for name, value in want.items():
            assert torch.equal(got[name], value.detach()), (rank, name)


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))


def _init_(model: torch.nn.Module, g: torch.Generator) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                torch.nn.init.kaiming_uniform_(p, a=math.sqrt(5), generator=g)
            else:
                torch.nn.init.normal_(p, 0.0, 0.02, generator=g)


def _fully_shard_init(rank: int, world: int) -> dict:
    from ragged_placement.fsdp import fully_shard

    model = _mlp()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    _init_(model, torch.Generator().manual_seed(11))
    return {n: (p.placements, p.full_tensor()) for n, p in model.named_parameters()}


def test_fully_shard_init_equals_the_unsharded_init(one_torch_thread):
    """nn.init on the RaggedShard parameters of a fully_shard model (units with empty ranks)
    gives the parameters the same seed gives the unsharded model."""
    reference = _mlp()
    _init_(reference, torch.Generator().manual_seed(11))
    for got in run_threaded(_fully_shard_init, 3):
        for name, p in reference.named_parameters():
            placements, full = got[name]
            assert any(isinstance(q, RaggedShard) for q in placements)
            assert torch.equal(full, p.detach()), name
