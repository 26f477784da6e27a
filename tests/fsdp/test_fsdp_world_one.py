"""A mesh dim of size 1 costs nothing: on one rank no collective is issued, the unsharded
parameters are the sharded chunk itself and gradients land where backward accumulated them;
on a mesh with a size-1 dim only the other dims communicate (``ShardComm`` in
``ragged_placement/fsdp/mesh.py``)."""

from __future__ import annotations

import copy

import pytest
import torch
from common_fsdp import shard_blocks
from dist_utils import run_gloo

pytestmark = pytest.mark.multiprocess

CFG = dict(n_layer=2, n_embd=64, n_head=2, block_size=16)


def _batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(rank)
    return [(torch.randint(256, (2, 16), generator=g), torch.randint(256, (2, 16), generator=g))
            for _ in range(steps)]


def _full(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.full_tensor() if isinstance(p, DTensor) else p.detach()


def _train(model, opt, batches, meter_cls=None) -> tuple[list[float], list, list]:
    """Steps over ``batches``; each step's loss, full parameters and the collectives it issued
    (``CollectiveMeter.by_group`` and ``CommDebugMode``'s total)."""
    from torch.distributed.tensor.debug import CommDebugMode

    from ragged_placement.testing.profiling import CollectiveMeter

    losses, params, comms = [], [], []
    for x, y in batches:
        with CommDebugMode() as debug, CollectiveMeter() as meter:
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
        params.append([_full(p).clone() for p in model.parameters()])
        comms.append((dict(meter.by_group), debug.get_total_counts()))
    return losses, params, comms


def _in_place_checks(model) -> dict:
    """One forward and backward of ``model`` (ours), recording where the parameters that the
    blocks compute with live, and where backward accumulated each unit's gradients; compared
    with the sharded chunks and the sharded ``.grad`` afterwards."""
    units = [u for _, u in model.fsdp_units()]
    seen: dict[int, int] = {}  # id(unsharded param) -> data_ptr of its accumulated .grad
    handles = [p.register_post_accumulate_grad_hook(lambda p: seen.__setitem__(id(p),
                                                                                p.grad.data_ptr()))
               for u in units for p in u.unsharded_params if p.requires_grad]
    used: list[tuple[int, int]] = []  # (data_ptr of the parameter a block computes with, of chunk)
    sharded = {id(m): list(m.parameters()) for m in model.layers}

    def record(module, args):
        for p in module.parameters():
            used.append(p.data_ptr())

    hooks = [m.register_forward_pre_hook(record) for m in model.layers]
    x, y = _batches(0, 1)[0]
    model(x, y).backward()
    for h in hooks + handles:
        h.remove()
    chunks = {p._local_tensor.data_ptr() for ps in sharded.values() for p in ps}
    landed = []
    for u in units:
        for b in u.buffers:
            if len(b.plan.segments) != 1:
                continue
            for p_u, p_s in zip(b.unsharded_params, b.sharded_params):
                if p_u.requires_grad:
                    landed.append(seen[id(p_u)] == p_s.grad._local_tensor.data_ptr())
    shares = [b.gather.gathered.data_ptr() == b.sharded.data_ptr() for u in units
              for b in u.buffers]
    return {"computed_on_chunks": set(used) <= chunks, "n_used": len(used), "landed": landed,
            "shares": shares}


def _one_rank(rank: int, ws: int) -> dict:
    from ragged_placement.optim import Muon
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from ragged_placement.models import GPT, GPTConfig

    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    plain = GPT(GPTConfig(**CFG))
    batches = _batches(rank, 3)
    out = {}
    for name, make_opt in {
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
        "muon": lambda ps: Muon([{"params": [p for p in ps if p.ndim == 2]},
                                 {"params": [p for p in ps if p.ndim != 2],
                                  "algorithm": "adamw"}], lr=1e-2),
    }.items():
        ref, ours = copy.deepcopy(plain), copy.deepcopy(plain)
        shard_blocks(ours, "ours", mesh=mesh)
        out[name] = (_train(ref, make_opt(list(ref.parameters())), batches),
                     _train(ours, make_opt(list(ours.parameters())), batches))
    ours = copy.deepcopy(plain)
    shard_blocks(ours, "ours", mesh=mesh)
    out["in_place"] = _in_place_checks(ours)
    # mixed precision (bf16 compute, fp32 reduction) against FSDP2 on the same one-rank mesh
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    runs = {}
    for runtime in ("ours", "fsdp2"):
        model = copy.deepcopy(plain)
        shard_blocks(model, runtime, mesh=mesh, mp_policy=mp)
        runs[runtime] = _train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), batches)
    out["mixed"] = runs
    return out


def test_one_rank_issues_no_collective_and_trains_exactly_as_a_plain_module():
    """World size 1 (fp32, a GPT's blocks and root sharded): 3 steps of AdamW and of Muon
    issue no collective (c10d meter and CommDebugMode) and give losses and parameters bitwise
    equal to the plain module's; the blocks compute on views of the sharded chunks, a
    one-segment buffer's ``.grad`` lands where backward accumulated it (no copy); with bf16
    compute and fp32 reduction ours issues nothing and gives FSDP2's losses and parameters
    bitwise."""
    out = run_gloo(_one_rank, 1)[0]
    for name in ("adamw", "muon"):
        (ref_losses, ref_params, _), (losses, params, comms) = out[name]
        assert comms == [({}, 0)] * 3, (name, comms)
        assert losses == ref_losses, name
        for step_ref, step in zip(ref_params, params):
            assert all(torch.equal(a, b) for a, b in zip(step_ref, step)), name
    checks = out["in_place"]
    assert checks["computed_on_chunks"] and checks["n_used"] > 0
    assert checks["landed"] and all(checks["landed"]), checks["landed"]
    assert all(checks["shares"]), checks["shares"]
    (losses, params, comms), (theirs, their_params, _) = (
        out["mixed"]["ours"], out["mixed"]["fsdp2"])
    assert comms == [({}, 0)] * 3, comms
    assert losses == theirs
    for a, b in zip(params[-1], their_params[-1]):
        assert torch.equal(a, b)


def _size_one_dims(rank: int, ws: int) -> dict:
    from ragged_placement.optim import Muon
    from torch.distributed.device_mesh import init_device_mesh

    from ragged_placement.fsdp import StateSharding
    from ragged_placement.models import GPT, GPTConfig

    torch.manual_seed(0)
    plain = GPT(GPTConfig(**CFG))
    batches = _batches(rank, 2)
    out = {}
    for shape in ((2, 1), (1, 2)):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("rep", "shard"))
        for runtime in ("ours", "fsdp2"):
            model = copy.deepcopy(plain)
            shard_blocks(model, runtime, mesh=mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            out[(shape, runtime)] = _train(model, opt, batches)
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("a", "b"))
    for sharding in (StateSharding(params=("b",), grads=("b",), optim=("a", "b")),
                     StateSharding(params=(), grads=("b",), optim=("a", "b"))):
        model = copy.deepcopy(plain)
        shard_blocks(model, "ours", mesh=mesh, state_sharding=sharding)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        out[str(sharding)] = _train(model, opt, batches)
    model = copy.deepcopy(plain)
    hsdp = init_device_mesh("cpu", (2, 1), mesh_dim_names=("rep", "shard"))
    shard_blocks(model, "ours", mesh=hsdp)
    ps = list(model.parameters())
    opt = Muon([{"params": [p for p in ps if p.ndim == 2]},
                {"params": [p for p in ps if p.ndim != 2], "algorithm": "adamw"}], lr=1e-2)
    out["muon"] = _train(model, opt, batches)
    return out


def test_a_size_one_mesh_dim_issues_nothing():
    """World size 2: HSDP on a (2, 1) mesh all-reduces over the replicas and issues nothing
    over its one-rank shard dim (neither all-gather, reduce-scatter nor the unused-gradient
    flags); on a (1, 2) mesh it all-gathers and reduce-scatters over the shard dim and issues
    no all-reduce of gradients over its one replica. Both match FSDP2 on the same mesh bitwise.
    State shardings on a (2, 1) mesh with the size-1 dim in them, and Muon on the (2, 1) HSDP
    mesh, issue nothing over one rank either."""
    out = run_gloo(_size_one_dims, 2)
    for rank_out in out:
        for key, (losses, params, comms) in rank_out.items():
            if "fsdp2" in key:  # FSDP2 all-reduces over the one replica of a (1, 2) mesh
                continue
            for groups, _ in comms:
                assert groups and all(len(ranks) == 2 for _, ranks in groups), (key, groups)
        for shape, kinds in {(2, 1): {"all_reduce"},
                             (1, 2): {"all_gather", "reduce_scatter", "all_reduce"}}.items():
            (losses, params, comms) = rank_out[(shape, "ours")]
            for groups, _ in comms:
                assert {kind for kind, _ in groups} == kinds, (shape, groups)
            if shape == (1, 2):  # only the unused-gradient flags: one byte per parameter
                n = len(params[0])
                assert all(groups[("all_reduce", (0, 1))][:2] == [1, n] for groups, _ in comms)
            theirs, their_params, _ = rank_out[(shape, "fsdp2")]
            assert losses == theirs, shape
            for a, b in zip(params[-1], their_params[-1]):
                assert torch.equal(a, b), shape
