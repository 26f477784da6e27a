"""``offload_policy=CPUOffloadPolicy()`` as FSDP2: sharded parameters, gradients and optimizer
state on CPU, the chunk staged host-to-device before each all-gather and the reduced gradient
device-to-host after each reduce-scatter.

The mesh here is a CPU one, so both devices are the CPU, but the unit stages through the same
copies a CUDA run makes (its ``CommStats`` counts them). One world of 4 real gloo ranks runs every
training (the module-scoped ``runs`` fixture): ours and torch FSDP2 with
``CPUOffloadPolicy(pin_memory=False)`` against the one-process reference in fp32 (1e-5), the
same with ``MixedPrecisionPolicy(bf16, fp32)`` against FSDP2 (within 1e-4; measured bitwise
equal) and bitwise against ours without offload, HSDP on a 2x2 mesh, and a meta-device build
materialized with ``to_empty(device="cpu")``.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from common.surface import (
    INIT,
    Net,
    X,
    Y,
    assert_matches,
    surface_net,
    surface_optimizer,
    surface_reference,
    surface_steps,
)
from common_fsdp import full
from dist_utils import run_gloo, run_threaded
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from ragged_placement.fsdp import fully_shard
from ragged_placement.fsdp.buffer import check_move_target
from ragged_placement.quant import BlockFP8Config

WORLD = 4
OFFLOAD = CPUOffloadPolicy(pin_memory=False)
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
# Measured (torch 2.13 CPU, 4 gloo ranks, 5 steps, bf16 params / fp32 reduce, both offloading):
# ours and FSDP2 gave bitwise-equal losses and parameters (fp32: 2.4e-7 and 1.2e-7 apart).
BF16_TOL = 1e-4


def _build(runtime: str, mesh: DeviceMesh, offload: OffloadPolicy, mp: MixedPrecisionPolicy,
           meta: bool) -> Net:
    """The surface tests' net, one unit per block plus the root, sharded by ``runtime``."""
    shard = fully_shard if runtime == "ours" else torch_fully_shard
    if meta:
        with torch.device("meta"):
            m = Net()
    else:
        m = surface_net()
    for block in m.blocks:
        shard(block, mesh=mesh, mp_policy=mp, offload_policy=offload)
    shard(m, mesh=mesh, mp_policy=mp, offload_policy=offload)
    if meta:
        m.to_empty(device="cpu")
        m.load_state_dict(INIT)  # full tensors: each rank copies its run
    return m


def _check_step(m: Net) -> None:
    """After a backward with offload: every unit staged its chunk once per all-gather and its
    gradient chunk once per reduce-scatter, and nothing of the sharded state left the CPU."""
    for name, unit in m.fsdp_units():
        s = unit.stats
        (flat,) = unit.buffers
        chunk_bytes = flat.sharded.numel() * flat.sharded.element_size()
        assert s.all_gathers >= 1 and s.reduce_scatters == 1, name
        assert (s.h2d_copies, s.d2h_copies) == (s.all_gathers, s.reduce_scatters), name
        assert s.h2d_bytes == s.all_gathers * chunk_bytes, name
        assert s.d2h_bytes == flat.grads.sharded.numel() * flat.grads.sharded.element_size(), name
        assert flat.sharded_device == flat.offload_device == torch.device("cpu"), name
        for p in unit.sharded_params:
            assert isinstance(p, DTensor) and p._local_tensor.device.type == "cpu", name
            assert p.grad._local_tensor.device.type == "cpu", name
        unit.stats.reset()


def _train(rank: int, ws: int, runtime: str, offload: OffloadPolicy,
           mp: MixedPrecisionPolicy = MixedPrecisionPolicy(), meta: bool = False,
           hsdp: bool = False):
    """``STEPS`` AdamW steps on this rank's part of the batch: the global losses and the full
    parameters. ``hsdp``: a ``(2, ws // 2)`` (replicate, shard) mesh."""
    if hsdp:
        mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = DeviceMesh("cpu", list(range(ws)))
    m = _build(runtime, mesh, offload, mp, meta)
    opt = surface_optimizer(m.parameters(), sgd=False)
    checked = runtime == "ours" and isinstance(offload, CPUOffloadPolicy)
    if checked:
        for _, unit in m.fsdp_units():
            unit.stats.reset()
    losses = surface_steps(m, opt, rank, ws, _check_step if checked else None)
    if checked:  # AdamW's moments follow the parameters: on CPU
        states = [v for st in opt.state.values() for v in st.values() if isinstance(v, DTensor)]
        assert states and all(v._local_tensor.device.type == "cpu" for v in states)
    return losses, {k: full(v) for k, v in m.named_parameters()}


RUNS = {
    "ours": ("ours", OFFLOAD),
    "fsdp2": ("fsdp2", OFFLOAD),
    "ours_bf16": ("ours", OFFLOAD, BF16),
    "fsdp2_bf16": ("fsdp2", OFFLOAD, BF16),
    "ours_bf16_no_offload": ("ours", OffloadPolicy(), BF16),
    "ours_meta": ("ours", OFFLOAD, MixedPrecisionPolicy(), True),
    "ours_hsdp": ("ours", OFFLOAD, MixedPrecisionPolicy(), False, True),
    "fsdp2_hsdp": ("fsdp2", OFFLOAD, MixedPrecisionPolicy(), False, True),
}


def _all_runs(rank: int, ws: int):
    return {name: _train(rank, ws, *args) for name, args in RUNS.items()}


@pytest.fixture(scope="module")
def runs():
    """Rank 0's results of every run in :data:`RUNS` (one gloo world for all of them)."""
    return run_gloo(_all_runs, WORLD)[0]


def test_cpu_offload_trains_as_the_reference_and_fsdp2(runs):
    ref = surface_reference()
    assert_matches(runs["ours"], ref, "ours")
    assert_matches(runs["fsdp2"], ref, "fsdp2")


def test_cpu_offload_with_bf16_mixed_precision_trains_as_fsdp2(runs):
    ours, theirs = runs["ours_bf16"], runs["fsdp2_bf16"]
    assert ours[0] == pytest.approx(theirs[0], abs=BF16_TOL)
    for k, v in ours[1].items():
        torch.testing.assert_close(v, theirs[1][k], atol=BF16_TOL, rtol=0, msg=k)
    assert ours[0] != pytest.approx(surface_reference()[0], abs=1e-6)  # bf16 really ran
    # the H2D copy with the cast gives what the cast without offload gives, bit for bit
    assert ours[0] == runs["ours_bf16_no_offload"][0]
    for k, v in runs["ours_bf16"][1].items():
        assert torch.equal(v, runs["ours_bf16_no_offload"][1][k]), k


def test_cpu_offload_hsdp_trains_as_the_reference_and_fsdp2(runs):
    """The D2H copy follows the all-reduce over the replicas and the averaging."""
    ref = surface_reference()
    assert_matches(runs["ours_hsdp"], ref, "ours hsdp")
    assert_matches(runs["fsdp2_hsdp"], ref, "fsdp2 hsdp")


def test_cpu_offload_meta_device_init_with_to_empty_cpu(runs):
    assert_matches(runs["ours_meta"], surface_reference(), "meta")


def _bad_input(rank: int, ws: int):
    mesh = DeviceMesh("cpu", list(range(ws)))
    if not torch.accelerator.is_available():  # FSDP2 raises RuntimeError from pin_memory()
        with pytest.raises(ValueError, match=r"offload_policy=.*pin_memory=True needs an accel"):
            fully_shard(surface_net(), mesh=mesh, offload_policy=CPUOffloadPolicy())
    with pytest.raises(ValueError, match="offload_policy must be a torch.distributed.fsdp"):
        fully_shard(surface_net(), mesh=mesh, offload_policy="cpu")
    with pytest.raises(ValueError, match="offload_policy.pin_memory must be a bool"):
        fully_shard(surface_net(), mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=None))
    m = fully_shard(surface_net(), mesh=mesh, offload_policy=OFFLOAD)
    unit = m.fsdp_unit
    (flat,) = unit.buffers
    assert unit.stats.h2d_copies == 0 and flat.offload_device == torch.device("cpu")
    m.to("cpu").to("meta").to_empty(device="cpu").bfloat16()  # moves that keep it on CPU
    assert flat.sharded.device.type == "cpu" and flat.sharded.dtype == torch.bfloat16
    # a move to another device than CPU is refused (a CPU-only torch cannot make a CUDA
    # tensor, so the unit's check is called as apply_ calls it)
    with pytest.raises(ValueError, match=r"offloads its sharded parameters \(offload_policy="):
        check_move_target(flat, torch.device("cuda", 0), torch.float32, "inp.weight")
    plain = fully_shard(surface_net(), mesh=mesh).fsdp_unit.buffers[0]
    assert plain.offload_device is None and plain.sharded_device == plain.device
    return True


def test_cpu_offload_bad_input_and_moves():
    assert all(run_threaded(_bad_input, 2))


with torch.random.fork_rng():
    torch.manual_seed(0)
    FP8_INIT = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 128)).state_dict()


def _fp8_train(rank: int, ws: int, offload: OffloadPolicy):
    """3 AdamW steps of a block-FP8 unit (the chunk staged to the device, then quantized)."""
    m = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 128))
    m.load_state_dict(FP8_INIT)
    mesh = DeviceMesh("cpu", list(range(ws)))
    fully_shard(m, mesh=mesh, quant=BlockFP8Config(block=(128, 128)), offload_policy=offload)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(3):
        loss = m(torch.randn(4, 256, generator=gen)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, m.fsdp_unit.stats.h2d_copies, m.fsdp_unit.buffers[0].sharded.device.type


def test_cpu_offload_fp8_unit_trains_as_without_offload():
    offloaded = run_threaded(_fp8_train, 2, OFFLOAD)
    plain = run_threaded(_fp8_train, 2, OffloadPolicy())
    assert [r[0] for r in offloaded] == [r[0] for r in plain]  # bitwise
    assert [r[1:] for r in offloaded] == [(3, "cpu")] * 2  # the root gathers once a step
    assert [r[1] for r in plain] == [0, 0]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


class _FakeEvent:
    """Stands for a CUDA event of an asynchronous staging copy (CPU-only torch has none)."""

    log: list[_FakeEvent] = []

    def __init__(self, kind: str) -> None:
        self.kind, self.synchronized = kind, False
        _FakeEvent.log.append(self)

    def synchronize(self) -> None:
        self.synchronized = True


def _async_staging_is_waited_for(rank: int, ws: int) -> dict[str, bool]:
    """With the staging copies asynchronous (pinned memory on a GPU; here forced on CPU with
    fake events), every copy is waited for before the host can write the chunk or read the
    gradient: after a forward that keeps the root's gather, and after backward."""
    mesh = DeviceMesh("cpu", list(range(ws)))
    m = _build("ours", mesh, OFFLOAD, MixedPrecisionPolicy(), meta=False)
    x, y = X[0, rank * 2 : rank * 2 + 2], Y[0, rank * 2 : rank * 2 + 2]
    mine = lambda: [e for e in _FakeEvent.log if e.rank == rank]  # noqa: E731
    m(x).sum()  # a forward no backward follows: the root keeps its gather
    forward = mine()
    forward_waited = bool(forward) and all(e.synchronized for e in forward)  # checked now
    F.mse_loss(m(x), y).backward()
    backward = mine()[len(forward):]
    return {
        "forward": forward_waited,
        "backward": {e.kind for e in backward} == {"h2d", "d2h"}
        and all(e.synchronized for e in backward),
    }


def test_cpu_offload_async_staging_copies_are_waited_for_before_the_host_uses_them(monkeypatch):
    import inspect

    import torch.distributed as dist

    from ragged_placement.fsdp import offload as offload_module

    def recorded(device):
        caller = inspect.stack()[1].function  # to_device or to_host
        event = _FakeEvent("h2d" if caller == "to_device" else "d2h")
        event.rank = dist.get_rank()
        return event

    # patched once for both rank threads (a per-thread patch of a class would race)
    monkeypatch.setattr(
        offload_module.OffloadStaging, "_asynchronous", lambda self, device: True
    )
    monkeypatch.setattr(offload_module, "_recorded_event", recorded)
    _FakeEvent.log.clear()
    for result in run_threaded(_async_staging_is_waited_for, 2):
        assert result == {"forward": True, "backward": True}
