"""``benchmarks/fsdp_vs_fsdp2.py --device cpu``: both runtimes in one process, at world size 8
through torch's fake process group and on one real rank, small Llama-shaped blocks (the GPU
command, ``scripts/gpu_check.sh``, runs the same script with ``--device cuda`` at full size)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--device", "cpu", "--layers", "2", "--width", "64", "--ffn", "128", "--heads", "4",
         "--kv-heads", "2", "--seq", "16", "--warmup", "1", "--steps", "1", "--runs", "1",
         "--profile-steps", "1"]


def _table(world: int) -> tuple[dict[str, tuple[str, str]], str]:
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "fsdp_vs_fsdp2.py"), *SMALL,
         "--world", str(world)],
        capture_output=True, text=True, timeout=1200, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {}
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 4:
            rows[cells[0]] = (cells[1], cells[2])
    return rows, out.stdout


@pytest.mark.multiprocess
def test_one_process_benchmark_runs_both_runtimes_at_world_8_and_1_on_cpu():
    """At world 8 (fake process group) both runtimes issue collectives and would move the same
    bytes per rank (same parameters, equal chunks); FSDP2's copy ops include its copy-in
    (``all_gather_copy_in``), ours do not. On one real rank ours issues no collective."""
    rows, text = _table(8)
    assert "fake process group, world 8" in text
    fsdp2, ours = rows["collectives per step"]
    assert int(fsdp2) > 0 and int(ours) > 0
    theirs, mine = rows["bytes moved per rank per step (MiB)"]
    assert float(theirs) > 0 and theirs == mine
    copies = {line.split(":", 1)[0]: line for line in text.splitlines()
              if line.startswith(("fsdp2:", "ours:"))}
    assert "all_gather_copy_in" in copies["fsdp2"], copies
    assert "all_gather_copy_in" not in copies["ours"] and "chunk_cat" not in copies["ours"]
    for name in ("step time (ms, median)", "peak memory (MiB, heap)"):
        assert all(float(v) > 0 for v in rows[name]), (name, rows[name])

    rows, text = _table(1)
    assert "one rank" in text
    assert rows["collectives per step"][1] == "0"
    assert rows["bytes moved per rank per step (MiB)"][1] == "0.0"
