"""Units whose parameters have several dtypes (fp32 norms next to float64 / bf16 matrices),
against one process and torch FSDP2 (threaded ranks), and the c10d ops such a unit issues on
real gloo ranks: one coalesced all-gather per pass and one reduce-scatter per backward for all
its dtypes."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_gloo, run_threaded
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2MixedPrecision
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor.debug import CommDebugMode

from ragged_placement.fsdp import MixedPrecisionPolicy, fully_shard

WORLD = 2
VOCAB, DIM, SEQ, BATCH, STEPS, LR = 64, 16, 8, 4, 5, 1e-2


class Block(nn.Module):
    """An fp32 norm feeding matrices in ``dtype`` (the mixed block of HF-style models)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.norm = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, 4 * DIM).to(dtype)
        self.proj = nn.Linear(4 * DIM, DIM).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x).to(self.fc.weight.dtype)  # the matrices' dtype, or mp's param_dtype
        return x + self.proj(torch.relu(self.fc(h))).to(x.dtype)


class Model(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(dtype) for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False).to(dtype)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x).to(self.head.weight.dtype)).float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _model(dtype: torch.dtype) -> Model:
    g = torch.Generator().manual_seed(0)
    m = Model(dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return (
        torch.randint(VOCAB, (BATCH, SEQ), generator=g),
        torch.randint(VOCAB, (BATCH, SEQ), generator=g),
    )


def _train(m: nn.Module, rank: int, ws: int, on_step=None) -> list[float]:
    """``STEPS`` AdamW steps on this rank's share of each batch; the mean losses. ``on_step``:
    a context manager factory entered around each forward and backward."""
    opt = torch.optim.AdamW(m.parameters(), lr=LR, foreach=False)
    per = BATCH // ws
    losses = []
    for s in range(STEPS):
        x, y = _batch(s)
        with on_step() if on_step is not None else contextlib.nullcontext():
            loss = m(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
            loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if ws > 1:
            torch.distributed.all_reduce(total)
        losses.append(total.item() / ws)
    return losses


def _sharded_training(rank: int, ws: int, runtime: str, dtype: torch.dtype, mp: bool = False):
    mesh = DeviceMesh("cpu", list(range(ws)))
    m = _model(dtype)
    if runtime == "ours":
        shard, policy = fully_shard, MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    else:  # "fsdp2", or "fsdp2_mixed": FSDP2 on our units
        shard, policy = fsdp2_fully_shard, FSDP2MixedPrecision(torch.bfloat16, torch.float32)
    kw = {"mp_policy": policy} if mp else {}
    if runtime == "fsdp2":  # FSDP2 needs one dtype per unit: fp32 modules get units of their own
        for norm in [b.norm for b in m.layers] + [m.norm, m.emb]:
            shard(norm, mesh=mesh, **kw)
    for block in m.layers:
        shard(block, mesh=mesh, **kw)
    shard(m, mesh=mesh, **kw)
    facts = {}
    if runtime == "ours":
        units = [u for _, u in m.fsdp_units()]
        facts["mixed"] = all(len(u.buffers) == 2 for u in units)  # one flat buffer per dtype
        facts["part_dtypes"] = all(
            [b.orig_dtype for b in u.buffers] == [torch.float32, dtype] for u in units
        )
        facts["views"] = all(
            sp.dtype == part.orig_dtype
            and sp._local_tensor.untyped_storage().data_ptr()
            == part.sharded.untyped_storage().data_ptr()
            for u in units
            for part in u.buffers
            for sp in part.sharded_params
        )
        for u in units:
            u.stats.reset()
    losses = _train(m, rank, ws)
    if runtime == "ours":
        # one all-gather per pass for both parts (blocks gather again in backward) and one
        # reduce-scatter per step
        root, *blocks = [u for _, u in m.fsdp_units()]
        facts["collectives"] = (root.stats.all_gathers, root.stats.reduce_scatters) == (
            STEPS,
            STEPS,
        ) and all((b.stats.all_gathers, b.stats.reduce_scatters) == (2 * STEPS, STEPS) for b in blocks)
        facts["grads_freed"] = all(p.grad is None for p in m.parameters())
    return facts, losses


def test_fp32_norms_with_float64_matrices_match_one_process_and_fsdp2():
    ref = _train(_model(torch.float64), 0, 1)
    ours = run_threaded(_sharded_training, WORLD, "ours", torch.float64)
    theirs = run_threaded(_sharded_training, WORLD, "fsdp2", torch.float64)
    for (facts, losses), (_, their_losses) in zip(ours, theirs):
        assert facts and all(facts.values()), facts
        assert losses == pytest.approx(ref, abs=1e-5)
        assert losses == pytest.approx(their_losses, abs=1e-5)
    assert ref[-1] < ref[0] - 0.1  # it trains
    # torch 2.13's FSDP2 accepts the mixed unit at fully_shard, then refuses it at the first
    # forward (its trainable parameters must share one dtype, with or without mp_policy)
    with pytest.raises(AssertionError, match="uniform original parameter dtype"):
        run_threaded(_sharded_training, WORLD, "fsdp2_mixed", torch.float64)


# FSDP2 runs the same model with the norms in units of their own (it cannot mix dtypes in one).
def test_fp32_norms_with_bf16_matrices_under_bf16_mixed_precision_match_fsdp2():
    ours = run_threaded(_sharded_training, WORLD, "ours", torch.bfloat16, True)
    theirs = run_threaded(_sharded_training, WORLD, "fsdp2", torch.bfloat16, True)
    for (facts, losses), (_, their_losses) in zip(ours, theirs):
        assert facts and all(facts.values()), facts
        assert losses == pytest.approx(their_losses, abs=1e-5)
    ref = _train(_model(torch.bfloat16), 0, 1)
    assert ours[0][1] == pytest.approx(ref, abs=5e-2)


def _fp8_refused(rank: int, ws: int) -> None:
    from ragged_placement.quant import BlockFP8Config

    with pytest.raises(ValueError, match=r"share a dtype, got torch\.float32: norm\.weight"):
        fully_shard(
            Block(torch.bfloat16), mesh=DeviceMesh("cpu", list(range(ws))),
            quant=BlockFP8Config(block=(16, 16)),
        )


def test_fp8_unit_with_several_dtypes_is_refused_naming_the_parameters():
    run_threaded(_fp8_refused, WORLD)


# c10d ops per step on gloo, for all units: the root gathers once (kept for backward), each of
# the 2 blocks twice (forward, backward); each unit reduce-scatters once. Every unit's parts
# (fp32, float64; several equal segments each, so each part's reduce-scatter runs packed) go
# into one coalesced op, and nothing else runs in forward and backward.
OPS_PER_STEP = {
    "allgather_into_tensor_coalesced_": 1 + 2 * 2,
    # gloo's reduce-scatter (a sum) is an all-to-all (_compat), one per part: fp32 and float64
    "alltoall_base_": 2 * (1 + 2),
    "allreduce_": 1,  # one byte per parameter: which ones no rank used (their .grad is None)
}
GLOO_CONFIGS = {
    "default": {},
    "reshard_after_forward=2": {"reshard_after_forward": 2},  # blocks only
    "cpu_offload": {"offload_policy": CPUOffloadPolicy(pin_memory=False)},
}


def _coalesced_on_gloo(rank: int, ws: int) -> dict[str, tuple]:
    """Per configuration: the losses, the c10d ops of each step, and the units' counters."""
    torch.set_num_threads(1)
    mesh = DeviceMesh("cpu", list(range(ws)))
    out = {}
    for name, kw in GLOO_CONFIGS.items():
        m = _model(torch.float64)
        for block in m.layers:
            fully_shard(block, mesh=mesh, **kw)
        fully_shard(m, mesh=mesh, **{k: v for k, v in kw.items() if k != "reshard_after_forward"})
        units = [u for _, u in m.fsdp_units()]
        assert all(len(u.buffers) == 2 for u in units)
        ops_per_step = []

        @contextlib.contextmanager
        def counted():
            with CommDebugMode() as comm:
                yield
            ops_per_step.append(
                {str(k).rsplit(".", 1)[-1]: v for k, v in comm.get_comm_counts().items()}
            )

        losses = _train(m, rank, ws, counted)
        stats = [
            (u.stats.all_gathers, u.stats.reduce_scatters, u.stats.post_forward_all_gathers,
             u.stats.h2d_copies, u.stats.all_gather_bytes,
             STEPS * sum(b.unsharded.numel() * b.unsharded.element_size() for b in u.buffers))
            for u in units
        ]
        out[name] = (losses, ops_per_step, stats)
    return out


@pytest.mark.multiprocess
def test_unit_with_several_dtypes_issues_one_collective_per_pass_and_part_on_gloo():
    """On 4 gloo ranks a unit of fp32 and float64 parameters issues one coalesced all-gather
    per pass and one all-to-all per part per backward (gloo's reduce-scatter; also gathering backward over the
    pair with ``reshard_after_forward=2``, and with CPU offload), trains as one process, and its
    counters say one collective each with the parts' bytes summed."""
    ref = _train(_model(torch.float64), 0, 1)
    for out in run_gloo(_coalesced_on_gloo, 4):
        assert set(out) == set(GLOO_CONFIGS)
        for name, (losses, ops_per_step, stats) in out.items():
            assert losses == pytest.approx(ref, abs=1e-5), name
            assert ops_per_step == [OPS_PER_STEP] * STEPS, name
            root, *blocks = stats
            offloaded = name == "cpu_offload"
            # (all-gathers, reduce-scatters, of them over the pair, h2d copies: 1 per part and gather)
            assert root[:4] == (STEPS, STEPS, 0, 2 * STEPS if offloaded else 0), name
            pairs = STEPS if name == "reshard_after_forward=2" else 0
            for b in blocks:
                assert b[:4] == (2 * STEPS, STEPS, pairs, 4 * STEPS if offloaded else 0), name
            assert root[4] == root[5] and all(b[4] == 2 * b[5] for b in blocks), name
