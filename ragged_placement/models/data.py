"""A byte-level text corpus that exists on every machine: the Python standard library's sources.

The corpus is the concatenation of the ``.py`` files under ``sysconfig``'s ``stdlib`` path, in
sorted relative-path order, truncated to ``max_bytes``; it is identical on every machine with the
same Python version. Batches are drawn by a generator seeded with ``(seed, step)``, so every rank
(and a single-process reference) can draw the same global batch and take its own slice.
"""

from __future__ import annotations

import os
import sysconfig

import torch

__all__ = ["StdlibCorpus"]


def _stdlib_files(root: str) -> list[str]:
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        paths.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(paths, key=lambda p: os.path.relpath(p, root))


class StdlibCorpus:
    """Bytes of the standard library's ``.py`` sources, split into train and validation.

    Args:
        max_bytes: read files (sorted) until this many bytes are collected.
        val_fraction: the tail fraction of the bytes kept for validation.
    """

    def __init__(self, max_bytes: int = 2 << 20, val_fraction: float = 0.1) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        root = sysconfig.get_paths()["stdlib"]
        chunks, total = [], 0
        for path in _stdlib_files(root):
            with open(path, "rb") as f:
                data = f.read(max_bytes - total)
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                break
        data = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()
        n_val = max(1, int(len(data) * val_fraction))
        self.train = data[:-n_val]
        self.val = data[-n_val:]

    def batch(
        self, step: int, batch_size: int, seq_len: int, *, split: str = "train", seed: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch of ``step``: inputs and next-byte targets, each ``[batch_size, seq_len]``."""
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        data = self.train if split == "train" else self.val
        if len(data) <= seq_len + 1:
            raise ValueError(f"seq_len={seq_len} is too long for a split of {len(data)} bytes")
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(len(data) - seq_len - 1, (batch_size,), generator=gen)
        idx = starts[:, None] + torch.arange(seq_len + 1)
        window = data[idx]
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()
