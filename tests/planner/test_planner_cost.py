"""The partitioner's own cost on a 1T-parameter MoE (``benchmarks/state_sharding.py --timing``
times it): each parameter's granularity is resolved once, whatever the expert split needs,
and the plan chosen is the one the partitioner chose before (numbers recorded from it)."""

from __future__ import annotations

import math

import pytest

from ragged_placement.planner import Granularity, plan_state_sharding
from ragged_placement.planner.models import fsdp_units

KIMI_K2 = {"hidden": 7168, "layers": 61, "dense_layers": 1, "intermediate": 18432,
           "moe_intermediate": 2048, "experts": 384, "shared_experts": 1, "heads": 64,
           "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
           "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab": 163840}
BANDWIDTH = {"inter": 50e9, "intra": 450e9}
MESH = {"inter": 2048, "intra": 8}
BLOCK, ELEMENT = Granularity.block(128, 128), Granularity.element()


def _separate_experts(per_unit: int = 32):
    """Kimi K2 with its experts as separate matrices, ``per_unit`` experts a unit (783 units,
    69,975 tensors), as ``benchmarks/state_sharding.py --timing`` plans it."""
    import re

    expert = re.compile(r"\.experts\.(\d+)\.")
    out = []
    for name, params in fsdp_units("kimi-k2", KIMI_K2, stacked_experts=False):
        groups: dict[int, list] = {}
        rest = []
        for n, s in params:
            m = expert.search(n)
            (groups.setdefault(int(m.group(1)) // per_unit, []) if m else rest).append((n, s))
        out.append((name, rest))
        out += [(f"{name}.experts.group{g}", ps) for g, ps in sorted(groups.items())]
    return out


@pytest.mark.parametrize("layout", ["separate", "stacked"])
def test_each_granularity_is_resolved_once_and_the_choice_is_unchanged(layout):
    units = _separate_experts() if layout == "separate" else fsdp_units("kimi-k2", KIMI_K2)
    calls = []

    def policy(name, shape):
        calls.append(name)
        return BLOCK if len(shape) >= 2 else ELEMENT

    plan = plan_state_sharding(units, MESH, math.inf, bandwidth=BANDWIDTH, granularity=policy)
    tensors = sum(len(ps) for _, ps in units)
    assert len(calls) == tensors == (69_975 if layout == "separate" else 1_035)
    c = plan.choice
    # recorded before the change (benchmarks/state_sharding.py's --timing cases)
    memory = 4_109_547_971_584 if layout == "separate" else 4_149_306_784_704
    seconds = 18.244462721 if layout == "separate" else 18.246778219
    assert (str(c.sharding), c.reshard_after_forward, c.ep) == ("P(intra) G(intra) OS(intra)",
                                                                False, 1)
    assert c.memory_total == memory
    assert c.comm_seconds_total == pytest.approx(seconds, rel=1e-9)
