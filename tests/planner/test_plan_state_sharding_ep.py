"""The partitioner's expert parallelism (issue 37, item 6): ``plan_state_sharding(..., ep=)``.

Memory and communication with experts sharded by EP against a hand computation, the EP degree's
checks, and the DeepSeek-V3 / Kimi K2 table (``benchmarks/state_sharding.py --planner --moe``).
"""

import os
import subprocess
import sys

import pytest
import torch
from ragged_placement.fsdp import StateSharding
from ragged_placement.planner import plan_state_sharding

MESH = {"inter": 2, "intra": 2}
BW = {"inter": 50e9, "intra": 450e9}
# one MoE unit, fp32: a dense 16x8 matrix and 4 stacked experts of 8x8 ([E, out, in])
MOE = [[("layer.attn.w", (16, 8)), ("layer.mlp.experts.w1", (4, 8, 8))]]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _plan(units=MOE, **kw):
    kw.setdefault("ep", (1, 2, 4))
    kw.setdefault("tokens_per_rank", 10)
    kw.setdefault("top_k", 2)
    return plan_state_sharding(units, MESH, 1e12, bandwidth=BW, param_dtype=None, **kw)


def test_memory_and_comm_with_ep_match_the_hand_formula():
    c = _plan().find(StateSharding.zero3(MESH), True, ep=2)
    # EP 2 fills `intra`: a rank holds 2 experts (128 elements), sharded by zero3 over the
    # remaining `inter` (2 ranks: 64 each); the dense 128 elements over all 4 ranks (32 each)
    chunk = (32 + 64) * 4
    # buffers: the gathered unit (128 + 128 elements), its gradient buffer and the
    # reduce-scatter output (the chunk)
    assert c.memory_per_rank == {"params": chunk, "grads": chunk, "optim": 2 * chunk,
                                 "buffers": 256 * 4 + 256 * 4 + chunk}
    # dense: all-gather x2 and reduce-scatter of (4-1) x 32 fp32 over both dims (charged to
    # inter, the slower); experts: (2-1) x 64 over inter; 4 all-to-alls over intra of
    # 10 tokens x top-2 x hidden 8 x 4 B x (2-1)/2
    dense, experts = 3 * 32 * 4, 64 * 4
    assert c.comm_bytes == {"inter": 3 * dense + 3 * experts, "intra": 4 * 10 * 2 * 8 * 4 // 2}
    a2a = [x for x in c.collectives if x.op == "all_to_all"]
    assert [(x.dims, x.ranks, x.calls) for x in a2a] == [(("intra",), 2, 4)]
    # EP 1 is the plan without expert parallelism, whatever `ep` searches
    off = plan_state_sharding(MOE, MESH, 1e12, bandwidth=BW, param_dtype=None)
    assert {c.ep for c in off.candidates} == {1}
    z3 = StateSharding.zero3(MESH)
    assert _plan().find(z3, True, 1).memory_per_rank == off.find(z3).memory_per_rank
    assert _plan().find(z3, True, 1).comm_bytes == off.find(z3).comm_bytes


def test_ep_across_dims_reduces_both():
    # EP 4 spans both dims: every rank holds one expert whole, nothing left to shard experts over
    c = _plan().find(StateSharding.zero3(MESH), True, ep=4)
    assert c.memory_per_rank["params"] == (32 + 64) * 4
    a2a = [x for x in c.collectives if x.op == "all_to_all"]
    assert [(x.dims, x.charged) for x in a2a] == [(("inter", "intra"), "inter")]
    assert a2a[0].bytes == 4 * 10 * 2 * 8 * 4 * 3 / 4


def test_auto_searches_divisors_of_experts_and_world():
    assert {c.ep for c in _plan(ep="auto").candidates} == {1, 2, 4}
    # a model without stacked experts searches EP 1 only
    dense = [[("w", (16, 8))]]
    assert {c.ep for c in _plan(dense, ep="auto", tokens_per_rank=None).candidates} == {1}
    # separate experts (experts.<i>.) are not stacked tensors
    separate = [[("l.experts.0.w1", (8, 8)), ("l.experts.1.w1", (8, 8))]]
    assert {c.ep for c in _plan(separate, ep="auto").candidates} == {1}


@pytest.mark.parametrize("kw, match", [
    ({"ep": 3}, r"ep=3 does not divide the expert count 4"),
    ({"ep": (1, 8)}, r"ep=8 does not divide the expert count 4"),
    ({"ep": "many"}, r"ep must be None, 'auto'"),
    ({"ep": 0}, r"ep must be None, 'auto', a positive int"),
    ({"ep": 2, "tokens_per_rank": None}, r"tokens_per_rank must be a positive int"),
    ({"ep": 2, "top_k": 0}, r"top_k must be a positive int"),
    ({"ep": 2, "top_k": 5}, r"top_k=5 exceeds the expert count 4"),
])
def test_bad_ep_raises_naming_it(kw, match):
    with pytest.raises(ValueError, match=match):
        _plan(**kw)


def test_ep_must_divide_the_data_parallel_size_and_lay_on_the_mesh():
    eight = [[("l.experts.w1", (8, 8, 8))]]
    with pytest.raises(ValueError, match=r"ep=8 does not divide the data-parallel size 4"):
        _plan(eight, ep=8)
    with pytest.raises(ValueError, match=r"ep=2 cannot be laid on mesh"):
        plan_state_sharding(eight, {"a": 2, "b": 3}, 1e12, bandwidth=1e9, ep=2,
                            tokens_per_rank=1, top_k=1)
    with pytest.raises(ValueError, match=r"ep=2: the model has no stacked expert tensors"):
        _plan([[("w", (16, 8))]], ep=2)


def test_moe_table_kimi_k2_fits_80_gb():
    """The default mode of the table is analytic and fast; Kimi K2 fits 80 GB with EP (FSDP2
    with EP 1 does not)."""
    out = subprocess.run([sys.executable, "benchmarks/state_sharding.py", "--planner", "--moe"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("kimi", "deep"))]
    assert len(rows) == 12
    choices = [r for r in rows if r[2] == "choice"]
    assert len(choices) == 4 and all(r[3] != "1" and "yes" in r for r in choices)
    ep1 = [r for r in rows if r[2:5] == ["FSDP2", "+", "EP"] and r[5] == "1"]
    assert len(ep1) == 4 and all("no" in r for r in ep1)


def test_a_size_one_mesh_dim_is_charged_as_without_ep():
    # without EP a collective over (inter, intra) is charged to inter even where inter has 1
    # rank (as before EP existed); EP only drops the dims its group takes whole
    mesh = {"inter": 1, "intra": 4}
    plan = plan_state_sharding(MOE, mesh, 1e12, bandwidth=BW, param_dtype=None, ep=(1, 2),
                               tokens_per_rank=10, top_k=2)
    z3 = StateSharding.zero3(mesh)
    assert {x.charged for x in plan.find(z3, True, 1).collectives} == {"inter"}
    assert {(x.op, x.charged) for x in plan.find(z3, True, 2).collectives} == {
        ("all_gather", "inter"), ("reduce_scatter", "inter"), ("all_to_all", "intra")}


def test_all_to_all_width_is_the_input_projections_input_dim():
    # w2 ([E, dim, ffn]) listed first: the rows the all-to-all moves are dim = 8 wide, not ffn
    unit = [[("l.moe.experts.w2", (4, 8, 24)), ("l.moe.experts.w1", (4, 24, 8))]]
    c = _plan(unit).find(StateSharding.zero3(MESH), True, ep=2)
    a2a = [x for x in c.collectives if x.op == "all_to_all"]
    assert a2a[0].bytes == 4 * 10 * 2 * 8 * 4 / 2


def test_no_candidate_leaves_the_experts_replicated():
    # EP 2 takes `intra` whole: P(intra) G(intra) OS(intra) would leave the experts' states
    # replicated over `inter` (DDP), which parallelize_moe refuses; without EP it is a candidate
    only_intra = StateSharding(params=("intra",), grads=("intra",), optim=("intra",))
    plan = _plan(ep=(1, 2))
    assert plan.find(only_intra, True, ep=1)
    with pytest.raises(ValueError, match="no candidate"):
        plan.find(only_intra, True, ep=2)
    for c in plan.candidates:
        assert c.ep == 1 or "inter" in c.sharding.optim, c.sharding
    # a size-1 dim of the mesh itself is kept (the runtime's dp_mod_ep of size 1 at EP = world)
    one = plan_state_sharding(MOE, {"dp_mod_ep": 1, "ep": 4}, 1e12, bandwidth=1e9,
                              param_dtype=None, ep=4, tokens_per_rank=10, top_k=2)
    assert {c.sharding.optim for c in one.candidates} == {("dp_mod_ep",), ("dp_mod_ep", "ep")}
