"""Every script in ``benchmarks/`` runs in its default mode at a small size (issue 35).

``benchmarks/fp8.py`` crashed in its default mode (its runtime rows, in the collective meter)
while the README's command skipped those rows, and ``benchmarks/state_sharding.py --runtime``
crashed reading FSDP2's state before its lazy init: a benchmark nobody runs in its default mode
rots. Each script runs here as its own process (a crash, a segfault included, fails its test
and names the script), with size flags only, never a flag that skips part of its default
mode. ``SMALL`` must list every script (checked).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
TIMEOUT = 600  # hang guard per script, never what decides a pass

# script -> the size flags of its small run (its default mode otherwise)
SMALL: dict[str, list[str]] = {
    "collectives.py": ["--world", "2", "--sizes", "1", "--reps", "1"],
    "compose.py": ["--layers", "1", "--width", "32", "--heads", "2", "--hidden", "64",
                   "--vocab", "64", "--seq", "8", "--batch", "2", "--warmup", "0", "--steps", "1",
                   "--runs", "1"],
    # the runtime rows on the fake 64-rank group (an uneven FP8 gather: the crash of issue 35)
    # and the CPU timing, for one model
    "fp8.py": ["--models", "gpt2-124m", "--worlds", "64"],
    "fp8_training.py": ["--steps", "2", "--world", "2"],
    "fsdp_vs_fsdp2.py": ["--world", "2", "--layers", "1", "--width", "32", "--heads", "2",
                         "--seq", "8", "--batch", "2", "--warmup", "0", "--steps", "1",
                         "--runs", "1"],
    "gloo_reduce_scatter.py": ["--mib", "1", "--reps", "1"],
    "host_overhead.py": ["--depths", "2", "--runs", "1", "--steps", "1", "--warmup", "0"],
    "meta_init.py": ["--world", "2", "--layers", "1", "--width", "32"],
    "moe.py": ["--width", "32", "--layers", "2", "--heads", "2", "--seq", "8", "--batch", "1",
               "--warmup", "0", "--steps", "1", "--runs", "1"],
    "optim.py": ["--world", "2", "--steps", "1", "--runs", "1"],
    "optim_hsdp.py": ["--layers", "1", "--steps", "1"],
    "planner.py": ["--models", "gpt2-124m", "--worlds", "8"],
    "redistribute.py": ["--rows", "256", "--cols", "64", "--runs", "1", "--import-runs", "1"],
    "shampoo.py": ["--world", "2", "--layers", "1", "--block", "64", "--steps", "1",
                   "--runs", "1"],
    # 9 torchtitan jobs of 2-4 ranks (a seed, then FSDP2 and ours per row): its own slow test
    # below; 2 steps, the fewest with a timed one (the first is not timed)
    "titan.py": ["--runs", "1", "--steps", "2", "--seq", "32"],
    # no default mode: it asks for one of --runtime, --planner, --timing, --profile; the 2x2
    # mesh only (the 2x4 one is 8 more gloo processes through the same code)
    "state_sharding.py": ["--runtime", "--meshes", "2x2", "--seq", "8", "--batch", "1",
                          "--warmup", "0", "--steps", "1"],
    # 5 torchrun jobs in network namespaces (needs root): its own test below; 3 steps, the
    # fewest with a timed one (the first and the last are not timed)
    "two_nodes.py": ["--runs", "1", "--steps", "3", "--layers", "1", "--width", "64",
                     "--heads", "2", "--seq", "8", "--batch", "1"],
}


def test_every_benchmark_has_a_small_run():
    scripts = {p.name for p in BENCHMARKS.glob("[!_]*.py")}
    assert set(SMALL) == scripts


def _run(script: str, *extra: str) -> subprocess.CompletedProcess:
    """``script``'s small run, with ``extra`` flags after its size flags."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *SMALL[script], *extra], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT,
    )


def _check_runs(script: str) -> None:
    proc = _run(script)
    assert proc.returncode == 0, f"{script} exited with {proc.returncode}:\n{proc.stdout[-4000:]}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("script", sorted(set(SMALL) - {"two_nodes.py", "titan.py"}))
def test_benchmark_runs_in_its_default_mode_at_a_small_size(script):
    _check_runs(script)


@pytest.mark.multiprocess
@pytest.mark.two_nodes
@pytest.mark.parametrize("rows", [
    ["auto", "fsdp2-full"],  # the partitioner's choice against FSDP2, the targets' first line
    pytest.param([], marks=pytest.mark.slow, id="all"),  # the default: 5 torchrun jobs
], ids=lambda rows: "-".join(rows))
def test_two_nodes_benchmark_runs_at_a_small_size(rows):
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("needs root and iproute2 (ip, tc): network namespaces")
    proc = _run("two_nodes.py", *(["--only", *rows] if rows else []))
    assert proc.returncode == 0, f"two_nodes.py exited with {proc.returncode}:\n{proc.stdout[-4000:]}"
    assert "The partitioner chose" in proc.stdout
    assert "- vs FSDP2 full shard: tokens/s" in proc.stdout
    assert ("- vs FSDP2 HSDP: tokens/s" in proc.stdout) == (not rows)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_titan_benchmark_runs_at_a_small_size():
    """Its default mode is 9 torchtitan jobs (minutes on 2 cores): opt-in with ``make test-slow``."""
    pytest.importorskip("torchtitan", reason="make test installs the titan extra")
    _check_runs("titan.py")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.two_nodes
def test_titan_benchmark_on_two_nodes_runs_at_a_small_size():
    pytest.importorskip("torchtitan", reason="make test installs the titan extra")
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("needs root and iproute2 (ip, tc): network namespaces")
    proc = _run("titan.py", "--two-nodes")
    assert proc.returncode == 0, f"titan.py --two-nodes exited with {proc.returncode}:\n" \
                                 f"{proc.stdout[-4000:]}"
    assert "the partitioner chose" in proc.stdout


@pytest.mark.multiprocess
def test_host_instructions_counted_process_runs():
    """``scripts/host_instructions.py``'s counted process (what it runs under callgrind) runs
    ours at a small size (the other runtimes' models and steps are host_overhead.py's, which
    its own small run covers)."""
    script = str(ROOT / "scripts" / "host_instructions.py")
    proc = subprocess.run([sys.executable, script, "--inner", "ours", "--depth", "2",
                           "--steps", "1"], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-4000:]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_host_instructions_table_under_callgrind():
    """The driver's table, two runtimes under callgrind (minutes: torch's import runs on
    valgrind's CPU): opt-in with ``make test-slow``, where valgrind is installed."""
    if shutil.which("valgrind") is None:
        pytest.skip("needs valgrind")
    script = str(ROOT / "scripts" / "host_instructions.py")
    proc = subprocess.run([sys.executable, script, "--depth", "1", "--steps", "1",
                           "--runtimes", "plain", "ours"], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "| ours |" in proc.stdout and "x |" in proc.stdout
