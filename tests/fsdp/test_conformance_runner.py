"""scripts/torch_fsdp2_conformance.py's table: which differences it records and which it flags.

The runner itself needs torch's test files (a pytorch checkout, docs/conformance.md); these
tests check its comparison and its reading of a rank's failure on made-up outcomes.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "torch_fsdp2_conformance.py"
_spec = importlib.util.spec_from_file_location("torch_fsdp2_conformance", _PATH)
conformance = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conformance)

KNOWN = "TestFullyShardSharedParams.test_shared_params_separate_fsdp_groups_error"


def _outcomes(**tests: str) -> dict[str, dict[str, str]]:
    return {t: {"outcome": o, "reason": f"{o} reason"} for t, o in tests.items()}


def test_compare_counts_and_flags_only_unrecorded_differences():
    torch_run = _outcomes(**{KNOWN: "passed", "A.test_new": "passed", "A.test_ok": "passed",
                             "A.test_both_fail": "failed"})
    ours = _outcomes(**{KNOWN: "failed", "A.test_new": "failed", "A.test_ok": "passed",
                        "A.test_both_fail": "failed", "A.test_ours_only": "passed"})
    row = conformance.compare("training", torch_run, ours)
    assert (row["tests"], row["torch_passed"], row["ours_passed"]) == (4, 3, 1)
    by_test = {d["test"]: d for d in row["differences"]}
    assert set(by_test) == {KNOWN, "A.test_new"}  # a test failing with both is no difference
    assert by_test[KNOWN]["known"] and "second fully_shard call" in by_test[KNOWN]["reason"]
    assert not by_test["A.test_new"]["known"]
    assert by_test["A.test_new"]["reason"] == "NEW: failed reason"
    assert row["ours_only"] == ["A.test_ours_only"]


def test_reason_is_the_ranks_exception_not_the_runner_summary():
    message = (
        "Process 1 exited with error code 10 and exception:\nTraceback (most recent call last):\n"
        '  File "x.py", line 3, in f\n[rank1]:E1128 x.py:1] AssertionError: 0 not greater than 0\n'
    )
    try:
        raise RuntimeError(message)
    except RuntimeError:
        assert conformance._reason(sys.exc_info()) == "AssertionError: 0 not greater than 0"
