"""Moves and casts of a module after ``fully_shard`` (``to_empty``, ``.to``, ``.double()``,
``.bfloat16()``, ``.float()``): parameters stay views of their unit's flat buffer and training
matches one process and torch FSDP2, or the call raises naming the parameter. Threaded ranks."""

from __future__ import annotations

import pytest
import torch
from common_fsdp import global_loss, rows, shard_blocks
from dist_utils import run_threaded
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.experimental import implicit_replication

from ragged_placement.fsdp import fully_shard
from ragged_placement.models import GPT, GPTConfig, StdlibCorpus

WORLD = 2
BATCH = 4
SEQ = 16
STEPS = 5
LR = 1e-2
CFG = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=SEQ)
CORPUS = StdlibCorpus(max_bytes=1 << 16)
torch.manual_seed(0)
INIT = GPT(CFG).state_dict()  # built once: threads must not race on the global RNG


def _model() -> GPT:
    m = GPT(CFG)
    m.load_state_dict(INIT)
    return m


def _train(m: nn.Module, opt: torch.optim.Optimizer, rank: int, ws: int) -> list[float]:
    dtype = next(m.parameters()).dtype
    losses = []
    for s in range(STEPS):
        x, y = CORPUS.batch(s, BATCH, SEQ)
        loss = m(rows(x, rank, ws), rows(y, rank, ws))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_loss(loss.detach().to(dtype), ws))  # the loss in the model's dtype
    return losses


def _reference(cast) -> list[float]:
    m = cast(_model())
    return _train(m, torch.optim.AdamW(m.parameters(), lr=LR, foreach=False), 0, 1)


def _views_of_units(m: nn.Module, dtype: torch.dtype) -> bool:
    """Every sharded parameter (and gradient) views its unit's flat buffer, one storage per
    buffer, in ``dtype``; unsharded storages are freed."""
    units = [b for _, u in m.fsdp_units() for b in u.buffers]
    ok = {p._local_tensor.untyped_storage().data_ptr() for p in m.parameters()} == {
        u.sharded.untyped_storage().data_ptr() for u in units
    }
    for u in units:
        ok &= u.sharded.dtype == dtype and u.unsharded.untyped_storage().nbytes() == 0
        for p in u.sharded_params:
            ok &= p.dtype == dtype
            ok &= p._local_tensor.untyped_storage().data_ptr() == u.sharded.untyped_storage().data_ptr()
            if p.grad is not None:
                g = p.grad._local_tensor
                ok &= g.untyped_storage().data_ptr() == u.grads.sharded.untyped_storage().data_ptr()
                ok &= g.dtype == dtype
    return bool(ok)


# Casts applied after fully_shard, and the same cast of the one-process reference model.
CASTS = {
    # the silent bug: to_empty of a CPU-built model left the all-gather reading the
    # stale buffer; here it is followed by loading the initial values
    "to_empty": (lambda m: m.to_empty(device="cpu"), lambda m: m, torch.float32),
    "to_float64": (lambda m: m.to(torch.float64), lambda m: m.double(), torch.float64),
    # bf16 round trip: the parameters are INIT rounded to bf16, trained in fp32
    "bf16_float": (
        lambda m: m.bfloat16().float(),
        lambda m: m.bfloat16().float(),
        torch.float32,
    ),
    "to_cpu": (lambda m: m.to("cpu"), lambda m: m, torch.float32),
}


def _cast_and_train(rank: int, ws: int, runtime: str, name: str):
    mesh = DeviceMesh("cpu", list(range(ws)))
    cast, _, dtype = CASTS[name]
    m = shard_blocks(_model(), runtime, mesh=mesh)
    params_before = list(m.parameters())
    opt = torch.optim.AdamW(params_before, lr=LR, foreach=False)  # built before the cast
    ptrs = [p._local_tensor.data_ptr() for p in params_before]
    cast(m)
    if name == "to_empty":  # FSDP2's load_state_dict takes no full tensors: copy_ them in
        with torch.no_grad(), implicit_replication():
            for n, p in m.named_parameters():
                p.copy_(INIT[n])
    same_objects = all(a is b for a, b in zip(params_before, m.parameters()))
    facts = {"same_objects": same_objects}
    if runtime == "ours":
        facts["views"] = _views_of_units(m, dtype)
        if name == "to_cpu":  # a no-op keeps the buffers
            facts["kept"] = ptrs == [p._local_tensor.data_ptr() for p in m.parameters()]
    losses = _train(m, opt, rank, ws)
    if runtime == "ours":
        facts["views_after_training"] = _views_of_units(m, dtype)
    return facts, losses


@pytest.mark.parametrize("name", list(CASTS))
def test_cast_after_fully_shard_keeps_views_and_trains_like_one_process_and_fsdp2(name):
    ref = _reference(CASTS[name][1])
    ours = run_threaded(_cast_and_train, WORLD, "ours", name)
    theirs = run_threaded(_cast_and_train, WORLD, "fsdp2", name)
    for (facts, losses), (their_facts, their_losses) in zip(ours, theirs):
        assert all(facts.values()), facts
        assert losses == pytest.approx(ref, abs=1e-5)
        assert losses == pytest.approx(their_losses, abs=1e-5)
    assert ref[-1] < ref[0] - 0.3  # it trains


def _grads_move_and_bad_moves(rank: int, ws: int):
    mesh = DeviceMesh("cpu", list(range(ws)))
    m = shard_blocks(_model(), "ours", mesh=mesh)
    x, y = CORPUS.batch(0, 2, SEQ)
    m(x, y).backward()
    grads = {n: p.grad.full_tensor() for n, p in m.named_parameters()}
    m.double()  # gradients are cast with the parameters, into the unit's new flat gradient
    moved = _views_of_units(m, torch.float64) and all(
        torch.equal(p.grad.full_tensor(), grads[n].double()) for n, p in m.named_parameters()
    )
    with pytest.raises(ValueError, match=r"maps sharded parameter ln_1\.weight .* to Tensor: only device and dtype"):
        m._apply(lambda t: torch.zeros(3))
    m.set_requires_gradient_sync(False)
    m(x, y).backward()
    with pytest.raises(ValueError, match=r"set_requires_gradient_sync\(False\) are pending"):
        m.float()
    return moved


def test_gradients_move_with_parameters_and_bad_moves_raise_naming_the_parameter():
    assert all(run_threaded(_grads_move_and_bad_moves, WORLD))


FP8_CFG = GPTConfig(n_layer=1, n_embd=128, n_head=4, block_size=SEQ)  # whole 128x128 blocks
torch.manual_seed(0)
FP8_INIT = {k: v.bfloat16().float() for k, v in GPT(FP8_CFG).state_dict().items()}


def _fp8_moves(rank: int, ws: int):
    from ragged_placement.quant import BlockFP8Config

    mesh = DeviceMesh("cpu", list(range(ws)))
    quant = BlockFP8Config(block=(128, 128))

    def sharded(m: GPT) -> GPT:
        for block in m.layers:
            fully_shard(block, mesh=mesh, quant=quant)
        return fully_shard(m, mesh=mesh, quant=quant)

    x = torch.arange(2 * SEQ).reshape(2, SEQ) % FP8_CFG.vocab_size
    plain = GPT(FP8_CFG)
    plain.load_state_dict(FP8_INIT)
    with torch.no_grad():
        expect = sharded(plain)(x)
    with torch.device("meta"):
        meta = GPT(FP8_CFG)
    sharded(meta).to_empty(device="cpu")
    meta.load_state_dict(FP8_INIT)
    cast = GPT(FP8_CFG)
    cast.load_state_dict(FP8_INIT)
    sharded(cast).bfloat16().float()  # FP8_INIT is bf16-exact: the round trip changes nothing
    with torch.no_grad():
        outs = [meta(x), cast(x)]
    with pytest.raises(ValueError, match=r"FP8 unit holding attn\.qkv\.weight to torch\.float64"):
        cast.double()
    return all(torch.equal(o, expect) for o in outs) and _views_of_units(meta, torch.float32)


def test_fp8_units_materialize_from_meta_and_cast_or_raise():
    assert all(run_threaded(_fp8_moves, WORLD))
