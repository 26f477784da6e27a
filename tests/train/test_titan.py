"""torchtitan's own trainer (``torchtitan.train``, llama3 ``debugmodel``) with our ``fully_shard``
switched in for FSDP2's: the same losses and gradient norms as torchtitan with FSDP2, step by step.

The in-suite cases are FSDP on 2 ranks and 4 steps of the ZBV zero-bubble pipeline schedule
(PP 2 x FSDP 2) against it; ``make titan`` runs the whole matrix (HSDP, FSDP + TP, activation
checkpointing, resume, full DTensor, the DeepSeek-V3 MoE model with expert parallelism, every
pipeline schedule) with ``tests/train/titan/compare.py``. Both runtimes start from one
seed checkpoint made by torchtitan itself, in fp32, on CPU/gloo with the stand-ins of
``tests/train/titan/stand_ins.py`` (none for a torch API: on a torch without the 2.14 APIs
torchtitan 0.3.0 calls, the module skips with ``_compat.torchtitan_unsupported``'s reason).
"""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("torchtitan", reason="make test installs the titan extra")
from ragged_placement._compat import torchtitan_unsupported  # noqa: E402

if (_reason := torchtitan_unsupported()) is not None:
    pytest.skip(_reason, allow_module_level=True)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "titan"))

import compare  # noqa: E402


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The assets and torchtitan's seed checkpoint, made once for the module's cases."""
    return compare.make_workdir(str(tmp_path_factory.mktemp("titan")))


@pytest.fixture(scope="module")
def fsdp_runs(work):
    return compare.run_case("fsdp", compare.CASES["fsdp"], work)


@pytest.mark.multiprocess
def test_torchtitan_fsdp_matches_its_fsdp2_per_step(fsdp_runs):
    """12 steps on 2 ranks: |loss| and |grad norm| differences per step within 1e-5. Switching the
    import alone used to give exactly half FSDP2's gradient norm (torchtitan's
    ``isinstance(m, FSDPModule)`` branches skipped) and crash at weight init before that."""
    runs = fsdp_runs
    assert [r["step"] for r in runs["torch"]] == list(range(1, compare.STEPS + 1))
    assert runs["torch"][-1]["loss"] < runs["torch"][0]["loss"] - 1.0  # it trains
    loss, grad_norm, steps = compare.compared("fsdp", runs)
    assert steps == compare.STEPS
    assert loss <= compare.TOLERANCE, f"max |loss diff| {loss:.2e}"
    assert grad_norm <= compare.TOLERANCE, f"max |grad-norm diff| {grad_norm:.2e}"


@pytest.mark.multiprocess
def test_torchtitan_zero_bubble_pipeline_trains_as_its_fsdp2_without_pipelining(work, fsdp_runs):
    """4 steps of torchtitan's ZBVZeroBubble schedule with ours (PP 2 x dp_shard 2, 4 ranks, 4
    stages, the fsdp case's data: 2 micro-batches per data-parallel rank) give the fsdp case's
    FSDP2 losses and gradient norms within 1e-5: the zero-bubble weight pass finds our
    parameters, and each gradient lands once. Before, ours raised ``KeyError: <AccumulateGrad>``
    in torch's ``stage_backward_weight``. FSDP2 itself is not the reference here: under this
    schedule torchtitan's final norm gets no gradient with it (docs/torchtitan.md)."""
    case = compare.CASES["pp_zbv_short"]
    ours = compare.run_case("pp_zbv_short", case, work, ("ours",))["ours"]
    assert [r["step"] for r in ours] == list(range(1, case.steps + 1))
    loss, grad_norm, _ = compare.max_differences(fsdp_runs["torch"], ours)
    assert loss <= compare.TOLERANCE, f"max |loss diff| {loss:.2e}"
    assert grad_norm <= compare.TOLERANCE, f"max |grad-norm diff| {grad_norm:.2e}"


_SNAPSHOT_OURS_AROUND_STAND_INS = r"""
import sys

sys.path.insert(0, sys.argv[1])
import ragged_placement.fsdp  # noqa: F401  (what launch.py imports for ours)


def snapshot():
    out = {}
    for name, module in list(sys.modules.items()):
        if name == "ragged_placement" or name.startswith("ragged_placement."):
            out[name] = {k: id(v) for k, v in vars(module).items()}
            for k, v in vars(module).items():
                if isinstance(v, type) and v.__module__ == name:
                    out[f"{name}.{k}"] = {a: id(b) for a, b in vars(v).items()}
    return out


before = snapshot()
import stand_ins

stand_ins.install(None)
stand_ins.reduce_scatter_in_rank_order()
stand_ins.dump_gradients("unused", set())
stand_ins.record_exact_grad_norm("unused")
after = snapshot()
print("CHANGED", sorted(k for k in before if before[k] != after.get(k)), len(before))

import torchtitan.distributed.utils as titan_dist
from torch.distributed.pipelining.schedules import _PipelineSchedule

print("TORCH_CALLS", titan_dist.set_pg_timeouts.__module__, _PipelineSchedule.step.__module__)
"""


def test_stand_ins_change_nothing_in_ours():
    """The Done-when check "nothing else patched in ours": installing every CPU stand-in of the
    harness (both runtimes' jobs, with the optional ones of ``compare.py``'s ``*_rank_order``
    cases and ``--dump-grads``) leaves every attribute of every loaded ``ragged_placement``
    module and class as it was; ``launch.py``'s one switch is torchtitan's ``fully_shard``. Nor
    does it replace the torch 2.14 calls torchtitan makes."""
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", _SNAPSHOT_OURS_AROUND_STAND_INS, compare.HERE],
        capture_output=True, text=True, timeout=600, check=True,
    ).stdout
    changed, count = out.split("CHANGED ")[1].split("\n")[0].rsplit(" ", 1)
    assert changed == "[]", changed
    assert int(count) > 50  # the snapshot saw ragged_placement's modules and classes
    # No stand-in for the torch 2.14 APIs torchtitan calls: its set_pg_timeouts (which calls
    # torch.distributed.set_timeout) and torch's PipelineSchedule.step are their own.
    assert out.split("TORCH_CALLS ")[1].split() == [
        "torchtitan.distributed.utils", "torch.distributed.pipelining.schedules"]
