"""Meta-device initialization (torchtitan's recipe) against one process and torch FSDP2.

``with torch.device("meta"): model = ...``, ``fully_shard`` every block and the root,
``model.to_empty(device=...)``, then initialize the sharded parameters in place. Threaded ranks.
"""

from __future__ import annotations

import pytest
import torch
from common_fsdp import train_steps
from dist_utils import run_threaded
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication

from ragged_placement.fsdp import fully_shard
from ragged_placement.testing.profiling import AllocationMeter
from ragged_placement.models import GPT, GPTConfig, StdlibCorpus
from ragged_placement.models.llama import Llama, LlamaConfig
from ragged_placement.parallelize import parallelize_llama

WORLD = 2
BATCH = 4
SEQ = 16
STEPS = 5
LR = 1e-2
CFG = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=SEQ)
CORPUS = StdlibCorpus(max_bytes=1 << 16)
torch.manual_seed(0)
INIT = GPT(CFG).state_dict()  # built once: threads must not race on the global RNG
LLAMA = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, hidden_dim=64)
LLAMA_INIT = Llama(LLAMA).state_dict()


def init_weights(model: GPT) -> None:
    """A deterministic ``init_weights``: matrices copied from full tensors, the rest by
    ``nn.init`` fills (what GPT's own init gives them), all on the sharded parameters."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                with implicit_replication():  # torch's rule for a plain full tensor source
                    module.weight.copy_(INIT[f"{name}.weight"])
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.constant_(module.bias, 0.0)


def _train(model: nn.Module, rank: int, ws: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    return train_steps(model, opt, (CORPUS.batch(s, BATCH, SEQ) for s in range(STEPS)), rank, ws)


def _reference() -> list[float]:
    m = GPT(CFG)
    m.load_state_dict(INIT)
    return _train(m, 0, 1)


def _meta_sharded(runtime: str, mesh: DeviceMesh) -> GPT:
    with torch.device("meta"):
        m = GPT(CFG)
    shard = fully_shard if runtime == "ours" else fsdp2_fully_shard
    for block in m.layers:
        shard(block, mesh=mesh)
    shard(m, mesh=mesh)
    return m


def _meta_init_and_train(rank: int, ws: int, runtime: str):
    mesh = DeviceMesh("cpu", list(range(ws)))
    with AllocationMeter() as at_shard:
        m = _meta_sharded(runtime, mesh)
    assert all(p.is_meta for p in m.parameters())
    with AllocationMeter() as at_materialize:
        m.to_empty(device="cpu")
    init_weights(m)
    facts = {}
    if runtime == "ours":
        units = [b for _, u in m.fsdp_units() for b in u.buffers]
        chunk = [u.chunk_numel * 4 for u in units]
        unshard = [u.chunk_numel * ws * 4 for u in units]
        storages = {p._local_tensor.untyped_storage().data_ptr() for p in m.parameters()}
        facts = {
            # fully_shard on meta allocates nothing bigger than the plan digests it checks;
            # to_empty one unit at a time: its chunk, one parameter's result, and its
            # all-gather buffer (created and freed at once, as FSDP2 does at its first unshard)
            "shard_max": max(at_shard.nbytes, default=0) <= 1024 < min(chunk),
            "materialize_max": max(at_materialize.nbytes) <= max(unshard),
            # and keeps exactly the unit chunks: one storage per unit, of its chunk's size
            "storages": storages == {u.sharded.untyped_storage().data_ptr() for u in units},
            "chunks": [u.sharded.untyped_storage().nbytes() for u in units] == chunk,
            "views": all(
                sp._local_tensor.untyped_storage().data_ptr()
                == u.sharded.untyped_storage().data_ptr()
                for u in units
                for sp in u.sharded_params
            ),
            "unsharded_freed": all(u.unsharded.untyped_storage().nbytes() == 0 for u in units),
            "device": all(u.device == torch.device("cpu") for u in units),
        }
    full = {n: p.full_tensor() for n, p in m.named_parameters()}
    initialized = all(torch.equal(full[n], INIT[n]) for n in full)
    return facts, initialized, _train(m, rank, ws)


def test_meta_init_allocates_chunks_only_and_trains_like_one_process_and_fsdp2():
    ref = _reference()
    ours = run_threaded(_meta_init_and_train, WORLD, "ours")
    theirs = run_threaded(_meta_init_and_train, WORLD, "fsdp2")
    for facts, initialized, losses in ours:
        assert facts and all(facts.values()), facts
        assert initialized
        assert losses == pytest.approx(ref, abs=1e-5)
        assert losses == pytest.approx(theirs[0][2], abs=1e-5)
    assert theirs[0][1]  # FSDP2 took the same initialization
    assert ref[-1] < ref[0] - 0.3  # it trains


def _forward_on_meta(rank: int, ws: int):
    mesh = DeviceMesh("cpu", list(range(ws)))
    m = _meta_sharded("ours", mesh)
    x, y = CORPUS.batch(0, 2, SEQ)
    with pytest.raises(ValueError, match=r"wte\.weight.*meta device.*to_empty"):
        m(x, y)
    half = GPT(CFG)
    with torch.device("meta"):
        half.layers[0] = GPT(CFG).layers[0]
    with pytest.raises(ValueError, match=r"layers\.0\..*meta device but .* is not"):
        fully_shard(half, mesh=mesh)


def test_forward_on_meta_and_half_meta_units_raise_naming_the_parameter():
    run_threaded(_forward_on_meta, WORLD)


def random_init(model: nn.Module, seed: int) -> None:
    """torchtitan-style ``init_weights`` drawing from one generator, in parameter order."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("wte.weight") or name.endswith("wpe.weight"):
                nn.init.normal_(p, std=0.02, generator=g)
            elif name.endswith("qkv.weight"):
                nn.init.kaiming_uniform_(p, a=5**0.5, generator=g)
            elif p.dim() == 2:
                nn.init.xavier_uniform_(p, generator=g)
            elif "ln" in name:
                nn.init.ones_(p) if name.endswith("weight") else nn.init.zeros_(p)
            else:
                nn.init.uniform_(p, -0.01, 0.01, generator=g)


def _random_meta_init(rank: int, ws: int):
    mesh = DeviceMesh("cpu", list(range(ws)))
    m = _meta_sharded("ours", mesh)
    m.to_empty(device="cpu")
    random_init(m, seed=7)
    full = {n: p.full_tensor() for n, p in m.named_parameters()}
    return full, _train(m, rank, ws)


def test_random_init_of_sharded_parameters_is_the_single_device_init_for_any_world_size():
    """The RNG contract (``ragged_placement.rng``): the full tensors ``nn.init`` gives the
    sharded parameters are the ones it gives one unsharded model from the same generator state,
    for any world size and units. (FSDP2 on CPU gives every rank the same local draw instead.)"""
    ref_model = GPT(CFG)
    random_init(ref_model, seed=7)
    ref_losses = _train(ref_model, 0, 1)
    ref_model = GPT(CFG)
    random_init(ref_model, seed=7)
    for ws in (2, 3):
        for full, losses in run_threaded(_random_meta_init, ws):
            for n, p in ref_model.named_parameters():
                assert torch.equal(full[n], p.detach()), n
            if ws == 2:
                assert losses == pytest.approx(ref_losses, abs=1e-5)


def _tp_build(meta: bool):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta" if meta else "cpu"):
        m = Llama(LLAMA)
    if not meta:
        m.load_state_dict(LLAMA_INIT)
    parallelize_llama(m, mesh["tp"])
    for block in m.layers.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(m, mesh=mesh["dp"])
    if meta:
        m.to_empty(device="cpu")
        with torch.no_grad(), implicit_replication():
            for n, p in m.named_parameters():
                p.copy_(LLAMA_INIT[n])
    return m


def _tp_meta(rank: int, ws: int):
    x = torch.arange(16).reshape(2, 8) % LLAMA.vocab_size
    outs = []
    for meta in (False, True):
        m = _tp_build(meta)
        out = m(x)
        out.float().pow(2).mean().backward()
        grads = {n: p.grad.full_tensor() for n, p in m.named_parameters()}
        outs.append((out.full_tensor() if isinstance(out, DTensor) else out.detach(), grads))
    (a, ga), (b, gb) = outs
    return torch.equal(a, b) and all(torch.equal(ga[n], gb[n]) for n in ga)


def test_meta_init_with_tensor_parallel_equals_the_materialized_build():
    assert all(run_threaded(_tp_meta, 4))
