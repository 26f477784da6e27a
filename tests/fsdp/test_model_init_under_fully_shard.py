"""Model initialization under ``fully_shard``: the ops init code calls, and whole models' inits.

``x.new_empty(other_shape)`` and the other ``new_*`` factories give a ``Replicate`` tensor as
torch's rule does; ``any`` / ``all`` are global, so ``nn.init.trunc_normal_``'s rejection loop
runs the same draws on every rank and equals the single-device draw bit for bit, as
``normal_`` does (``ragged_placement.rng``). torchtitan's llama3, qwen3 (dense and MoE) and
deepseek_v3 ``init_weights`` and Hugging Face's ``_init_weights`` (Llama, Qwen3, Mixtral,
Qwen3-MoE; tiny configs, no download) then give, on 4 gloo ranks, the parameters one process
gives from the same seed, bit for bit (one spawn for everything). torchtitan 0.3.0 has no llama4
model (it left the package); its cases are skipped where torchtitan is not installed.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from dist_utils import run_gloo
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

from ragged_placement.distribute import distribute_tensor
from ragged_placement.fsdp import fully_shard

pytestmark = pytest.mark.multiprocess

WORLD = 4
# (a, b, std): the normal draws with rejection (p > 0.3: the default, torchtitan's
# std=0.02 and its output layer's +-3 std) and the uniform proposals (p <= 0.3)
TRUNC = [(-2.0, 2.0, 0.02), (-3.0, 3.0, 0.5), (2.0, 3.0, 1.0)]
TITAN = [("llama3", "debugmodel"), ("qwen3", "debugmodel"), ("qwen3", "debugmodel_moe"),
         ("deepseek_v3", "debugmodel")]
HF = ["llama", "qwen3", "mixtral", "qwen3_moe"]


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _state(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: _full(v) for k, v in m.state_dict().items()}


# -- the ops ------------------------------------------------------------------------------------


def _trunc_normal(weight: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(3)
    for a, b, std in TRUNC:
        nn.init.trunc_normal_(weight, mean=0.1, std=std, a=a, b=b)
    return _full(weight)


def _ops(mesh) -> dict:
    # 7 rows on 4 ranks: uneven shards, one rank's may be empty for the small ones
    m = fully_shard(nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 2)), mesh=mesh)
    w = m[0].weight
    out = {"trunc": _trunc_normal(w)}
    for name, fn in [("new_empty", lambda: w.new_empty((3, 2))),
                     ("new_zeros", lambda: w.new_zeros((9,))),
                     ("new_ones", lambda: w.new_ones((2, 5, 2))),
                     ("new_full", lambda: w.new_full((4, 3), 2.5))]:
        t = fn()
        out[name] = (tuple(t.placements), tuple(t.shape), tuple(t.to_local().shape),
                     None if name == "new_empty" else _full(t))
    with torch.no_grad():
        full = torch.arange(35.0).reshape(7, 5) - 30  # positive on the last rows only
        w.copy_(distribute_tensor(full, w.device_mesh, w.placements))
    b = m[1].bias  # 2 elements: empty shards on some ranks
    out["any_all"] = [(tuple(x.placements), bool(x)) for x in
                      [(w > 0).any(), (w > 10).any(), (w > -31).all(), (w > 0).all(),
                       (b == b).all(), (b != b).any()]]
    return out


def _worker(rank: int, ws: int) -> dict:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (ws,))
    out = {"ops": _ops(mesh)}
    if _has("torchtitan.models.llama3"):
        out["titan"] = {case: _titan_init(_titan_model(*case), mesh) for case in TITAN}
    if _has("transformers"):
        out["hf"] = {name: _hf_init(_hf_model(name), mesh) for name in HF}
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_gloo(_worker, WORLD)


def test_trunc_normal_is_the_single_device_draw(ranks):
    ref = _trunc_normal(nn.Linear(5, 7).weight)
    for r in ranks:
        assert torch.equal(r["ops"]["trunc"], ref)


@pytest.mark.parametrize("name", ["new_empty", "new_zeros", "new_ones", "new_full"])
def test_new_factories_with_another_shape_are_replicated(ranks, name):
    """As torch's rule for its placements: the full shape on every rank, Replicate."""
    fill = {"new_zeros": (torch.zeros, (9,)), "new_ones": (torch.ones, (2, 5, 2)),
            "new_full": (lambda s: torch.full(s, 2.5), (4, 3))}
    for r in ranks:
        placements, shape, local, value = r["ops"][name]
        assert placements == (Replicate(),) and shape == local
        if name in fill:
            make, size = fill[name]
            assert shape == size and torch.equal(value, make(size))


def test_any_all_are_global_on_every_rank(ranks):
    expected = [True, False, True, False, True, False]
    for r in ranks:
        assert r["ops"]["any_all"] == [((Replicate(),), e) for e in expected]


# -- torchtitan's models ------------------------------------------------------------------------


def _has(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def _titan_model(name: str, flavor: str) -> nn.Module:
    """torchtitan's model on the meta device, as its trainer builds it (FlexAttention: the
    language models' only CPU attention backend; initialization does not run it)."""
    config = importlib.import_module(f"torchtitan.models.{name}").model_registry(
        flavor, attn_backend="flex"
    ).model
    config.layers = config.layers[:2]  # the first two of the debug model's layers: seconds
    with torch.device("meta"):
        return config.build()


def _titan_init(m: nn.Module, mesh=None) -> dict[str, torch.Tensor]:
    """torchtitan's trainer: each layer sharded, then the root; ``to_empty``, then
    ``init_weights`` under ``no_grad``."""
    if mesh is not None:
        for layer in m.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
    m.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        m.init_weights(buffer_device=torch.device("cpu"))
    return _state(m)


@pytest.mark.parametrize("case", TITAN, ids=["/".join(c) for c in TITAN])
def test_torchtitan_init_weights_is_the_single_process_init(ranks, case):
    if "titan" not in ranks[0]:
        pytest.skip("torchtitan is not installed")
    ref = _titan_init(_titan_model(*case))
    for r in ranks:
        got = r["titan"][case]
        assert got.keys() == ref.keys()
        for k, v in ref.items():
            assert torch.equal(got[k], v), k


# -- Hugging Face's _init_weights ---------------------------------------------------------------


def _hf_model(name: str) -> nn.Module:
    import transformers

    small = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=4)
    config = {
        "llama": lambda: transformers.LlamaConfig(**small),
        "qwen3": lambda: transformers.Qwen3Config(**small),
        "mixtral": lambda: transformers.MixtralConfig(
            **small, num_local_experts=4, num_experts_per_tok=2),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
            **small, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8),
    }[name]()
    torch.manual_seed(1)
    return transformers.AutoModelForCausalLM.from_config(config)


def _hf_init(m: nn.Module, mesh=None) -> dict[str, torch.Tensor]:
    """Each decoder layer sharded, then the root; then ``_init_weights`` on every module."""
    if mesh is not None:
        for layer in m.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
    torch.manual_seed(0)
    with torch.no_grad():
        for module in m.modules():
            m._init_weights(module)
    return _state(m)


@pytest.mark.parametrize("name", HF)
def test_hugging_face_init_weights_is_the_single_process_init(ranks, name):
    ref_model = _hf_model(name)
    before = _state(ref_model)
    ref = _hf_init(ref_model)
    assert sum(not torch.equal(before[k], v) for k, v in ref.items()) >= math.ceil(len(ref) / 2)
    for r in ranks:
        got = r["hf"][name]
        assert got.keys() == ref.keys()
        for k, v in ref.items():
            assert torch.equal(got[k], v), k
