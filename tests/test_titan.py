"""torchtitan's own trainer (``torchtitan.train``, llama3 ``debugmodel``) with our ``fully_shard``
switched in for FSDP2's: the same losses and gradient norms as torchtitan with FSDP2, step by step.

The in-suite case is FSDP on 2 ranks; ``make titan`` runs the whole matrix (HSDP, FSDP + TP,
activation checkpointing, resume, full DTensor, the DeepSeek-V3 MoE model with expert
parallelism) with ``tests/titan/compare.py``. Both runtimes start from one
seed checkpoint made by torchtitan itself, in fp32, on CPU/gloo with the stand-ins of
``tests/titan/stand_ins.py``.
"""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("torchtitan", reason="make test installs the titan extra")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "titan"))

import compare  # noqa: E402


@pytest.mark.multiprocess
def test_torchtitan_fsdp_matches_its_fsdp2_per_step(tmp_path):
    """12 steps on 2 ranks: |loss| and |grad norm| differences per step within 1e-5. Switching the
    import alone used to give exactly half FSDP2's gradient norm (torchtitan's
    ``isinstance(m, FSDPModule)`` branches skipped) and crash at weight init before that."""
    work = compare.make_workdir(str(tmp_path))
    runs = compare.run_case("fsdp", compare.CASES["fsdp"], work)
    assert [r["step"] for r in runs["torch"]] == list(range(1, compare.STEPS + 1))
    assert runs["torch"][-1]["loss"] < runs["torch"][0]["loss"] - 1.0  # it trains
    loss, grad_norm, steps = compare.compared("fsdp", runs)
    assert steps == compare.STEPS
    assert loss <= compare.TOLERANCE, f"max |loss diff| {loss:.2e}"
    assert grad_norm <= compare.TOLERANCE, f"max |grad-norm diff| {grad_norm:.2e}"
