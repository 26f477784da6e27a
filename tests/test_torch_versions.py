"""The supported torch releases are one list, and everything a user or CI runs agrees with it.

``ragged_placement._compat.SUPPORTED_TORCH`` is the list; the Makefile's default install, the
lower bound in pyproject.toml, the README's version table and ``.ci/run``'s two versions are
checked against it, and no module outside ``_compat`` (and ``_install``'s warning) reads the
torch version.
"""

from __future__ import annotations

import re
from pathlib import Path

from ragged_placement import _compat

REPO = Path(__file__).resolve().parent.parent


def _minor(version: str) -> tuple[int, int]:
    return tuple(int(x) for x in version.split(".")[:2])  # type: ignore[return-value]


def test_supported_releases_are_2_11_through_2_14():
    assert _compat.SUPPORTED_TORCH == ((2, 11), (2, 12), (2, 13), (2, 14))


def test_the_default_install_is_the_newest_supported_torch_pinned_exactly():
    makefile = (REPO / "Makefile").read_text()
    default = re.search(r"^DEFAULT_TORCH := (\S+)$", makefile, re.M)
    assert default and default[1] == "2.14.1"
    assert _minor(default[1]) == _compat.SUPPORTED_TORCH[-1]
    assert "pip install -q torch==$(TORCH)" in makefile
    lower = re.search(r'"torch>=([0-9.]+)"', (REPO / "pyproject.toml").read_text())
    assert lower and _minor(lower[1]) == _compat.SUPPORTED_TORCH[0]


def test_the_readme_has_one_version_table_naming_every_supported_release():
    readme = (REPO / "README.md").read_text()
    rows = re.findall(r"^\| (2\.\d+)\.\d+ \|", readme, re.M)
    assert sorted(map(_minor, rows)) == list(_compat.SUPPORTED_TORCH), rows
    assert "make test TORCH=2.13.0" in readme and "5.5 GB" in readme


def test_ci_runs_the_default_and_a_second_supported_version():
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert "make test" in ci
    second = [re.fullmatch(r"make test TORCH=(\S+)( .*)?", line) for line in ci]
    versions = [m[1] for m in second if m]
    assert len(versions) == 1 and _minor(versions[0]) in _compat.SUPPORTED_TORCH
    assert _minor(versions[0]) != _compat.SUPPORTED_TORCH[-1]


def test_only_compat_reads_the_torch_version():
    readers = []
    for root in ("ragged_placement", "planner", "optim"):
        for path in (REPO / root).rglob("*.py"):
            if path.name in ("_compat.py", "_install.py"):
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#")[0]
                if re.search(r"TORCH_VERSION|version\.parse|__version__\s*(==|!=|<=|>=|<|>)|(==|!=|<=|>=|<|>)\s*torch\.__version__", code):
                    readers.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not readers, readers


def test_torchtitan_runs_on_torch_2_14_and_later_and_says_why_not_before():
    """torchtitan 0.3.0's trainer calls two torch 2.14 APIs; the harness has no stand-in for them,
    so before 2.14 its tests skip with the reason, read from torch itself (not the version)."""
    reason = _compat.torchtitan_unsupported()
    if _compat.TORCH_VERSION >= (2, 14):
        assert reason is None, reason
    else:
        assert reason is not None and reason.startswith("torchtitan 0.3.0 is written for torch 2.14")
        assert "torch.distributed.set_timeout" in reason and "arg_mbs/kwarg_mbs" in reason


def test_patch_targets_reads_every_replaced_target_and_finds_none_changed_against_itself():
    """``scripts/patch_targets.py`` (docs/upstream.md's table of what another torch changes)
    reads the source of every row's target; compared with itself it lists every row, no
    difference, and a changed body is reported as changed."""
    import importlib.util

    from ragged_placement import _install

    spec = importlib.util.spec_from_file_location("patch_targets", REPO / "scripts" / "patch_targets.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    ours = script.dump()
    rows = [p for p in (*_install.PATCHES, *_install.FSDP2_PATCHES, *_install.OPTIM_PATCHES,
                        *getattr(_install, "PIPELINING_PATCHES", ())) if p.expected is not None]
    out = script.report(ours, ours)
    for p in rows:
        assert f"  same     {p.owner}.{p.name}\n" in out, (p, out)
    assert f"0 of {len(rows)} replaced targets differ" in out
    row = f"{rows[0].owner}.{rows[0].name}"
    edited = dict(ours, **{row: ours[row] + "    pass\n"})
    assert f"  changed  {row}: +1 -0 lines\n" in script.report(ours, edited)


_FAKE_MODES_ON_SHORT_LIVED_THREADS = """
import threading, torch
from torch._subclasses.fake_tensor import FakeTensorMode
import ragged_placement
from ragged_placement import RaggedShard
def owners():
    return [t for t in threading.enumerate() if t.name == "ragged_placement:fake-cuda-guard"]
assert not owners(), "importing the package started a thread"
RaggedShard((0,), (1, 2))  # first use: RaggedShard support installs
def fake_op():
    with FakeTensorMode():
        torch.empty(2, 3).sum(0)
for _ in range(20):  # each thread enters a fake mode (as DTensor's sharding propagation does) and exits
    t = threading.Thread(target=fake_op)
    t.start()
    t.join()
print("owners", len(owners()))
"""


def test_fake_modes_on_threads_that_exit_do_not_crash_after_ragged_shard_support_installs():
    """On torch 2.11 without a visible CUDA device, FakeTensorMode's CUDA guard belongs to the first
    thread that enters a fake mode, and the next fake mode after that thread exits segfaulted
    (DTensor's sharding propagation on threaded ranks, or any short-lived thread).
    ``_compat.keep_fake_cuda_guard_alive`` runs when RaggedShard support installs: in a fresh
    process, 20 short-lived threads each enter a fake mode and the process exits cleanly. The
    guard's owner thread exists only where torch needs it; importing the package starts none."""
    import subprocess
    import sys

    import torch

    proc = subprocess.run([sys.executable, "-c", _FAKE_MODES_ON_SHORT_LIVED_THREADS],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    needs_owner = _compat.TORCH_VERSION < (2, 12) and not torch.cuda.is_available()
    assert proc.stdout.split()[-1] == ("1" if needs_owner else "0"), proc.stdout
