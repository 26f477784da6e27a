"""Which of the package's patch rows a torch release changes: the source of every torch function
the rows of ``ragged_placement._install`` replace, read under this interpreter's torch and under
another one's, compared row by row.

    python scripts/patch_targets.py --against /path/to/other/venv/bin/python

prints one line per row (``same`` / ``changed: +A -B lines`` / ``absent``) and, with ``--diff``,
the unified diff of each changed one. ``--dump`` prints this interpreter's sources as JSON (what
``--against`` runs in the other interpreter). Nothing is patched: the rows' targets are read, as
``_install.changed_rows`` reads them. The other interpreter must be able to import this
repository (``PYTHONPATH`` is set to it).
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _rows() -> list:
    from ragged_placement import _install

    extra = getattr(_install, "PIPELINING_PATCHES", ())
    return [*_install.PATCHES, *_install.FSDP2_PATCHES, *_install.OPTIM_PATCHES, *extra]


def _target_source(patch) -> str | None:
    """The source of what the row replaces (``None``: the row adds a name torch does not have,
    or the target has no Python source)."""
    from ragged_placement import _install

    if patch.expected is None:
        return None
    owner = patch.resolve_owner()
    value = owner if patch.name == "__code__" else getattr(owner, patch.name, None)
    if value is None:
        return "<absent>"
    if inspect.ismethod(value):
        value = value.__func__
    if not (inspect.isfunction(value) or inspect.isclass(value)):
        value = type(value)
    try:
        return inspect.getsource(value)
    except (OSError, TypeError):
        return f"<no source: {_install._describe(value)}>"


def dump() -> dict[str, str | None]:
    import torch

    out: dict[str, str | None] = {"torch": torch.__version__}
    for p in _rows():
        out[f"{p.owner}.{p.name}"] = _target_source(p)
    return out


def compare(other_python: str, show_diff: bool) -> int:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([other_python, __file__, "--dump"], capture_output=True, text=True, env=env,
                          check=False)
    if proc.returncode != 0:
        sys.exit(f"{other_python} --dump failed:\n{proc.stderr}")
    print(report(dump(), json.loads(proc.stdout), show_diff))
    return 0


def report(ours: dict[str, str | None], theirs: dict[str, str | None], show_diff: bool = False) -> str:
    """The comparison of two :func:`dump` results, one line per replaced target."""
    ours, theirs = dict(ours), dict(theirs)
    lines = [f"patch targets: torch {ours.pop('torch')} (this interpreter) vs {theirs.pop('torch')}"]
    print = lines.append  # noqa: A001 - the report is built line by line
    changed = 0
    for row, src in ours.items():
        if src is None:
            continue
        other = theirs.get(row, "<absent>")
        if other == src:
            print(f"  same     {row}")
            continue
        changed += 1
        if other == "<absent>":
            print(f"  absent   {row}")
            continue
        diff = list(difflib.unified_diff(src.splitlines(), other.splitlines(), row, row, lineterm="", n=1))
        plus = sum(1 for d in diff if d.startswith("+") and not d.startswith("+++"))
        minus = sum(1 for d in diff if d.startswith("-") and not d.startswith("---"))
        print(f"  changed  {row}: +{plus} -{minus} lines")
        if show_diff:
            print("\n".join("      " + d for d in diff))
    print(f"{changed} of {sum(s is not None for s in ours.values())} replaced targets differ")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", help="python of another torch release")
    parser.add_argument("--diff", action="store_true", help="print each changed target's diff")
    parser.add_argument("--dump", action="store_true", help="print this interpreter's sources as JSON")
    args = parser.parse_args()
    if args.dump:
        print(json.dumps(dump()))
        return 0
    return compare(args.against or sys.executable, args.diff)


if __name__ == "__main__":
    sys.exit(main())
