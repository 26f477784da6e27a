"""Per-parameter comparison of two gradient dumps of ``compare.py --dump-grads``.

    .venv/bin/python tests/train/titan/grad_diff.py A/grads/step1.pt B/grads/step1.pt

For each parameter (matched by name) prints the largest |difference|, that over the largest
|gradient| of A, the share of elements bit for bit equal, and the ratio of the two gradients'
norms (a gradient divided by a wrong factor shows there as that factor); then the totals.
"""

from __future__ import annotations

import sys

import torch


def _key(name: str) -> str:
    """A parameter's name without wrapper modules' segments (activation checkpointing etc.)."""
    return ".".join(p for p in name.split(".") if not p.startswith("_"))


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[tuple]:
    """Rows ``(name, max|a-b|, max|a-b| / max|a|, share equal, |b| / |a|)`` over shared names."""
    a = {_key(k): v for k, v in a.items()}
    b = {_key(k): v for k, v in b.items()}
    missing = sorted(set(a) ^ set(b))
    if missing:
        raise ValueError(f"parameters in one dump only: {missing}")
    rows = []
    for name in a:
        x, y = a[name].double(), b[name].double()
        if x.shape != y.shape:
            raise ValueError(f"{name}: shapes {tuple(x.shape)} and {tuple(y.shape)}")
        diff = (x - y).abs().max().item()
        scale = x.abs().max().item() or 1.0
        equal = (a[name] == b[name]).double().mean().item()
        ratio = (y.norm() / x.norm()).item() if x.norm() > 0 else float("nan")
        rows.append((name, diff, diff / scale, equal, ratio))
    return rows


def main() -> None:
    a, b = (torch.load(p, map_location="cpu") for p in sys.argv[1:3])
    rows = compare(a, b)
    print(f"{'parameter':60s} {'max|diff|':>10s} {'rel max':>10s} {'equal':>7s} {'|B|/|A|':>12s}")
    for name, diff, rel, equal, ratio in rows:
        print(f"{name:60s} {diff:10.2e} {rel:10.2e} {equal:7.1%} {ratio:12.9f}")
    worst = max(rows, key=lambda r: r[2])
    ratio_off = max(rows, key=lambda r: abs(r[4] - 1.0))
    print(f"\n{len(rows)} parameters; bit for bit equal: {sum(r[3] == 1.0 for r in rows)}; "
          f"largest relative difference {worst[2]:.2e} ({worst[0]}); norm ratio furthest from 1: "
          f"{ratio_off[4]:.9f} ({ratio_off[0]})")


if __name__ == "__main__":
    main()
