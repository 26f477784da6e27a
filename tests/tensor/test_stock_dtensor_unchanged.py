"""Importing ragged_placement, or using it, leaves stock DTensor, FSDP2 and gloo unchanged.

One script (:func:`_stock_script`) exercises DTensor without any RaggedShard: Shard / Replicate /
Partial / ``_StridedShard`` redistributions on a 1-D mesh of 4 and a 2x2 mesh (even and uneven
shapes), ops, factories, random ops, ``from_local``, distributed checkpoint save/load, torch's
debug helpers (sharding-cache info, ``CommDebugMode`` counts, ``visualize_sharding``'s boxes),
plain gloo groups (``new_group``, their worker threads) and torch FSDP2 training (FSDP and
HSDP, AdamW, ``register_fsdp_forward_method``). It runs three times on 4 gloo processes: with
every module of the package imported first (which must patch nothing), with the package also
used first (a RaggedShard DTensor and our ``fully_shard`` trained a step, so every patch row is
in place), and without it (this module imports nothing from the package, so that run never
loads it). Every recorded value must be equal: tensors bit for bit, errors by type and
message. The ranks are forked from multiprocessing's fork server (as ``run_gloo``'s are), which
preloads torch alone.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import tempfile
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.multiprocess

WORLD = 4
# ragged_placement.testing.launch.PRELOAD, not imported from there: this module must not load the package
PRELOAD = ("torch", "torch.distributed.tensor", "torch.distributed.checkpoint")


def _record(results: dict, name: str, fn) -> None:
    """``results[name]`` = ``fn()`` (tensors as plain local tensors), or the error it raised."""
    from torch.distributed.tensor import DTensor

    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001 - errors are part of the recorded behaviour
        value = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if isinstance(value, DTensor):
        value = ("DTensor", tuple(value.shape), tuple(map(str, value.placements)), value.to_local().detach().clone())
    elif isinstance(value, torch.Tensor):
        value = value.detach().clone()
    results[name] = value


def _redistributions(results: dict, mesh, prefix: str, t: torch.Tensor, layouts: dict) -> None:
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    for src_name, src in layouts.items():
        _record(results, f"{prefix} distribute {src_name}", lambda: distribute_tensor(t, mesh, src))
        for dst_name, dst in layouts.items():
            def redistribute():
                d = distribute_tensor(t, mesh, src)
                with CommDebugMode() as comm:
                    e = d.redistribute(mesh, dst)
                return ("counts", comm.get_total_counts(), e.to_local().clone())

            _record(results, f"{prefix} {src_name} -> {dst_name}", redistribute)


def _stock_script(rank: int, results: dict, ckpt_dir: str) -> None:
    import torch.distributed.checkpoint as dcp
    import torch.distributed.tensor as dtensor
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor import debug
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (WORLD,))
    mesh2 = init_device_mesh("cpu", (2, 2))
    g = torch.Generator().manual_seed(0)
    even, uneven = torch.randn(8, 6, generator=g), torch.randn(7, 5, generator=g)
    layouts_1d = {"S0": [Shard(0)], "S1": [Shard(1)], "R": [Replicate()], "P": [Partial()], "Pmax": [Partial("max")]}
    _redistributions(results, mesh, "1d even", even, layouts_1d)
    _redistributions(results, mesh, "1d uneven", uneven, layouts_1d)
    layouts_2d = {
        "S0,S1": [Shard(0), Shard(1)], "S0,S0": [Shard(0), Shard(0)], "R,S0": [Replicate(), Shard(0)],
        "S1,R": [Shard(1), Replicate()], "P,S1": [Partial(), Shard(1)], "R,R": [Replicate(), Replicate()],
        "SS0,S0": [_StridedShard(0, split_factor=2), Shard(0)],
    }
    _redistributions(results, mesh2, "2d even", even, layouts_2d)
    _redistributions(results, mesh2, "2d uneven", uneven, layouts_2d)

    # ops
    a = distribute_tensor(even, mesh, [Shard(0)])
    w = distribute_tensor(torch.randn(6, 3, generator=g), mesh, [Replicate()])
    _record(results, "op add mul", lambda: (a * 2 + a).full_tensor())
    _record(results, "op matmul", lambda: a @ w)
    _record(results, "op sum", lambda: a.sum())
    _record(results, "op mean dim", lambda: a.mean(dim=1))
    _record(results, "op softmax", lambda: F.softmax(a, dim=-1))
    _record(results, "op view", lambda: a.view(8, 3, 2))
    _record(results, "op cat", lambda: torch.cat([a, a], dim=1))
    _record(results, "op t", lambda: a.t())
    b = distribute_tensor(even, mesh2, [Shard(0), Shard(1)])
    _record(results, "op 2d linear", lambda: F.linear(b, distribute_tensor(torch.ones(4, 6), mesh2, [Replicate()] * 2)))
    _record(results, "op 2d norm", lambda: torch.linalg.vector_norm(b))
    # autograd through a redistribution
    x = distribute_tensor(even.clone().requires_grad_(), mesh, [Shard(0)])
    (x.redistribute(mesh, [Replicate()]) * 3).sum().backward()
    _record(results, "autograd grad", lambda: x.grad)

    # factories, local shape helper
    for name in ("zeros", "ones", "empty"):
        make = getattr(dtensor, name)
        _record(results, f"factory {name}", lambda: tuple(make(7, 5, device_mesh=mesh, placements=[Shard(0)]).to_local().shape))
    _record(results, "factory full", lambda: dtensor.full((7, 5), 2.0, device_mesh=mesh2, placements=[Shard(0), Shard(1)]))
    _record(results, "factory randn", lambda: dtensor.randn(7, 5, device_mesh=mesh, placements=[Shard(0)]))
    for name, placements, m in (("S0", [Shard(0)], mesh), ("S0,S1", [Shard(0), Shard(1)], mesh2),
                                ("SS0,S0", [_StridedShard(0, split_factor=2), Shard(0)], mesh2)):
        _record(results, f"local shape {name}", lambda: compute_local_shape_and_global_offset((7, 5), m, placements))

    # random ops (CPU: no RNG tracker, every rank draws from its own generator)
    torch.manual_seed(1234 + rank)
    r = distribute_tensor(torch.zeros(8, 6), mesh, [Shard(0)])
    _record(results, "random normal_", lambda: r.normal_())
    _record(results, "random uniform_", lambda: torch.nn.init.uniform_(r, -1, 1))
    _record(results, "random kaiming", lambda: torch.nn.init.kaiming_uniform_(r))
    _record(results, "random randn_like", lambda: torch.randn_like(r))
    _record(results, "random dropout", lambda: F.dropout(r, 0.5))
    _record(results, "random generator", lambda: torch.nn.init.normal_(r, generator=torch.Generator().manual_seed(3)))

    # from_local
    local = torch.arange(12.0).reshape(2, 6) + rank
    _record(results, "from_local S0", lambda: DTensor.from_local(local, mesh, [Shard(0)]).full_tensor())
    _record(results, "from_local R run_check", lambda: DTensor.from_local(torch.ones(3), mesh, [Replicate()], run_check=True))
    _record(results, "from_local uneven shape", lambda: DTensor.from_local(
        uneven[[2, 2, 2, 1][rank] * 0: [2, 2, 2, 1][rank]], mesh, [Shard(0)], shape=uneven.shape, stride=uneven.stride()))

    # distributed checkpoint: save sharded, load into other layouts
    state = {"a": distribute_tensor(uneven, mesh, [Shard(0)]), "b": distribute_tensor(even, mesh2, [Shard(0), Shard(1)])}
    dcp.save(state, checkpoint_id=ckpt_dir)
    target = {"a": distribute_tensor(torch.zeros(7, 5), mesh, [Shard(1)]),
              "b": distribute_tensor(torch.zeros(8, 6), mesh2, [Replicate(), Shard(0)])}
    dcp.load(target, checkpoint_id=ckpt_dir)
    _record(results, "dcp a", lambda: target["a"])
    _record(results, "dcp b", lambda: target["b"])

    # debug helpers
    _record(results, "debug cache info", lambda: tuple(debug._get_python_sharding_prop_cache_info()))
    _record(results, "debug fast path stats", lambda: tuple(debug._get_fast_path_sharding_prop_cache_stats()))
    _record(results, "debug clear", lambda: debug._clear_sharding_prop_cache())
    _record(results, "debug cache info after clear", lambda: tuple(debug._get_python_sharding_prop_cache_info()))

    from torch.distributed.tensor.debug import _visualize_sharding

    for name, placements in layouts_2d.items():  # what visualize_sharding computes (it needs rich or tabulate)
        _record(results, f"debug visualize boxes {name}", lambda: [
            _visualize_sharding._compute_local_shape_and_global_offset((7, 5), (2, 2), lambda i: (r // 2, r % 2)[i],
                                                                       placements)
            for r in range(WORLD)
        ])

    # plain gloo groups: torch's worker threads, a collective
    from torch.distributed import distributed_c10d as c10d

    group = dist.new_group(list(range(WORLD)))
    _record(results, "gloo threads", lambda: [g._get_backend(torch.device("cpu")).options._threads
                                                for g in (dist.group.WORLD, group, mesh2.get_group(0))])
    _record(results, "gloo class", lambda: c10d.ProcessGroupGloo.__module__ + "." + c10d.ProcessGroupGloo.__qualname__)
    t = torch.arange(4.0) + rank
    dist.all_reduce(t, group=group)
    _record(results, "gloo all_reduce", lambda: t)

    # torch FSDP2: FSDP over the 1-D mesh, HSDP over the 2x2 one
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for name, m in (("fsdp", mesh), ("hsdp", hsdp)):
        _fsdp2_training(results, name, m, rank)


def _fsdp2_training(results: dict, name: str, mesh, rank: int) -> None:
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.score = lambda x: model(x).sum(-1)
    register_fsdp_forward_method(model, "score")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(12, 6, generator=torch.Generator().manual_seed(rank))
    for step in range(3):
        loss = model(x).square().mean() + model.score(x).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        _record(results, f"fsdp2 {name} loss {step}", lambda: loss.detach())
    for fqn, p in model.named_parameters():
        _record(results, f"fsdp2 {name} param {fqn}", lambda: p)
        _record(results, f"fsdp2 {name} adam {fqn}", lambda: opt.state[p]["exp_avg_sq"])


def _use_the_package(rank: int) -> None:
    """A RaggedShard DTensor and our fully_shard, one training step: every patch row installed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from ragged_placement import RaggedShard, _compat, _install
    from ragged_placement.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    d = distribute_tensor(torch.arange(12.0).reshape(6, 2), mesh, [RaggedShard((0,), (1, 2, 0, 3))])
    assert torch.equal(d.full_tensor(), torch.arange(12.0).reshape(6, 2))
    model = fully_shard(torch.nn.Linear(4, 4), mesh=mesh)
    model(torch.ones(2, 4)).sum().backward()
    assert _install.installed() and len(_install._applied_fsdp2) == len(_install.FSDP2_PATCHES) + len(_install.OPTIM_PATCHES)
    dist.barrier()
    _compat.clear_sharding_caches()  # the script records the caches' statistics


def _child(rank: int, run: str, port: int, out_dir: str) -> None:
    warnings.filterwarnings("ignore")
    if run != "without":
        import importlib
        import pkgutil

        import ragged_placement  # the point of this run: import every module of the package
        from ragged_placement import _install

        for info in pkgutil.walk_packages(ragged_placement.__path__, "ragged_placement."):
            importlib.import_module(info.name)
        assert not _install.installed() and not _install._applied_fsdp2
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False)  # the parent hosts it
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    try:
        if run == "used":
            _use_the_package(rank)
        results: dict = {}
        _stock_script(rank, results, os.path.join(out_dir, "ckpt"))
        loaded = "ragged_placement" in __import__("sys").modules
        results["package loaded"] = loaded
        torch.save(results, os.path.join(out_dir, f"{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _host_store():
    """The ranks' TCP store, hosted here on a port the OS picks as it binds (as
    ragged_placement.testing.launch.host_store does; not imported: see PRELOAD)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        yield store.port
    finally:
        del store


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


RUNS = ("imported", "used", "without")


def test_stock_dtensor_fsdp2_and_gloo_give_the_same_results_with_and_without_the_package():
    multiprocessing.set_forkserver_preload(list(PRELOAD))  # if this starts the server
    with tempfile.TemporaryDirectory() as root:
        dirs = {run: os.path.join(root, run) for run in RUNS}
        runs = {}
        for run in RUNS:  # one after the other: 4 ranks at a time on a small machine
            os.makedirs(dirs[run])
            with _host_store() as port:
                runs[run] = mp.start_processes(_child, args=(run, port, dirs[run]), nprocs=WORLD,
                                               join=False, start_method="forkserver")
                deadline = time.monotonic() + 600
                while not runs[run].join(timeout=1.0):
                    assert time.monotonic() < deadline, f"the stock script ({run}) did not finish"
        for rank in range(WORLD):
            want = torch.load(os.path.join(dirs["without"], f"{rank}.pt"), weights_only=False)
            assert not want.pop("package loaded")
            assert len(want) > 200  # the script really ran
            assert want["gloo threads"] == [2, 2, 2], want["gloo threads"]  # torch's default
            assert sum(k.startswith("fsdp2 ") for k in want) == 2 * (3 + 2 * 4)
            assert not any(isinstance(want[k], str) for k in want if k.startswith(("fsdp2", "gloo all")))
            for run in ("imported", "used"):
                got = torch.load(os.path.join(dirs[run], f"{rank}.pt"), weights_only=False)
                assert got.pop("package loaded")
                assert got.keys() == want.keys()
                different = [k for k in want if not _equal(got[k], want[k])]
                assert not different, (run, {k: (got[k], want[k]) for k in different[:3]})
