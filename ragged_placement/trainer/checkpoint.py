"""Checkpoints of a training run: DCP shards plus per-rank trainer state, published atomically.

A checkpoint of step ``S`` is the directory ``<dir>/step_<S>`` holding

* the model and optimizer state as a torch distributed checkpoint (DCP), taken with
  ``get_model_state_dict`` / ``get_optimizer_state_dict`` (sharded, any runtime);
* ``trainer_rank<r>.pt`` per rank: LR scheduler, step, data position, RNG states;
* ``manifest.json``, written last: the SHA-256 of every other file and the run's fingerprint
  (the options a resumed run must agree with).

Everything is written to ``<dir>/.tmp-step_<S>`` and the directory is renamed into place once the
manifest is complete, so a crash in the middle of a save never leaves a checkpoint that looks
complete; an existing checkpoint is never written over (``FileExistsError``). The newest two are
kept (an older one is renamed to ``.pruned-step_<S>`` before it is removed, so no interrupted
removal leaves a ``step_<S>`` without its manifest). Loading verifies every file against the
manifest first and raises :class:`CheckpointCorruptError` naming the first file that is missing,
extra or altered. :func:`check_checkpoint_dir` and :func:`move_incomplete_aside` run at start,
before any process-group work.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

__all__ = ["CheckpointCorruptError", "Checkpointer", "check_checkpoint_dir", "latest_checkpoint",
           "move_incomplete_aside", "read_manifest", "trainer_state_files"]

MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_TRAINER_STATE = re.compile(r"^trainer_rank(\d+)\.pt$")


class CheckpointCorruptError(ValueError):
    """A checkpoint file is missing, unexpected, or does not match its recorded checksum."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(directory: Path) -> list[str]:
    return sorted(
        str(p.relative_to(directory)) for p in directory.rglob("*")
        if p.is_file() and p.name != MANIFEST
    )


def check_checkpoint_dir(directory: str | os.PathLike) -> None:
    """Create ``directory`` if needed and check that this process can write files in it (a
    probe file, written and removed); a ``ValueError`` naming ``--checkpoint-dir`` otherwise."""
    root = Path(directory)
    if root.exists() and not root.is_dir():
        raise ValueError(f"--checkpoint-dir {root} is a file, not a directory: pass a directory")
    probe = root / f".write-probe-{socket.gethostname()}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"--checkpoint-dir {root} is not writable ({e.strerror or e}): pass a "
                         "directory this user can write, on a file system every rank shares") from None


def move_incomplete_aside(directory: str | os.PathLike) -> list[tuple[Path, Path]]:
    """Rename every ``step_<S>`` without a manifest (never published by :class:`Checkpointer`:
    copied or deleted by hand, or from an older version's interrupted removal) to
    ``.incomplete-step_<S>[.N]``, which is never resumed nor written over; the ``(from, to)``
    pairs. Call it on one rank."""
    root, moved = Path(directory), []
    for path in sorted(root.iterdir()) if root.is_dir() else ():
        if _STEP_DIR.match(path.name) and not (path / MANIFEST).is_file():
            target, n = root / f".incomplete-{path.name}", 0
            while target.exists():
                n += 1
                target = root / f".incomplete-{path.name}.{n}"
            os.rename(path, target)
            moved.append((path, target))
    return moved


def trainer_state_files(path: Path) -> dict[int, Path]:
    """The ``trainer_rank<r>.pt`` files of checkpoint ``path`` by rank ``r``."""
    return {int(m.group(1)): p for p in path.iterdir() if (m := _TRAINER_STATE.match(p.name))}


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest published checkpoint under ``directory`` (a ``step_<S>`` directory with a
    manifest), or ``None``."""
    root = Path(directory)
    if not root.is_dir():
        return None
    steps = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / MANIFEST).is_file()]
    return max(steps, key=lambda p: p.name, default=None)


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint ``path`` after checking every file against it."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        recorded = manifest["files"]
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointCorruptError(f"{path / MANIFEST}: unreadable manifest ({e})") from None
    present = _files(path)
    for name in sorted(set(recorded) | set(present)):
        file = path / name
        if name not in present:
            raise CheckpointCorruptError(f"checkpoint file {file} is missing")
        if name not in recorded:
            raise CheckpointCorruptError(f"checkpoint file {file} is not in {MANIFEST}")
        digest = _sha256(file)
        if digest != recorded[name]:
            raise CheckpointCorruptError(
                f"checkpoint file {file} is corrupt: sha256 {digest}, {MANIFEST} says {recorded[name]}"
            )
    return manifest


def _publish(tmp: Path, final: Path, fingerprint: dict[str, Any], layout: dict[str, Any],
             step: int) -> None:
    manifest = {"step": step, "fingerprint": fingerprint, "layout": layout,
                "files": {name: _sha256(tmp / name) for name in _files(tmp)}}
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, final)  # atomic: the checkpoint appears complete or not at all


class Checkpointer:
    """Saves and loads the checkpoints of one run under ``directory`` (every rank calls every
    method; they are collective).

    Args:
        directory: where ``step_<S>`` directories live (shared by all ranks).
        fingerprint: options saved with every checkpoint (see :func:`read_manifest`).
        keep: how many of the newest checkpoints to keep.
        layout: how the run was distributed (world size, runtime, state sharding, mesh), saved
            in the manifest so that a resume on another one can say what changed.
    """

    directory: Path
    fingerprint: dict[str, Any]
    keep: int
    layout: dict[str, Any]

    def __init__(self, directory: str | os.PathLike, fingerprint: dict[str, Any], keep: int = 2,
                 layout: dict[str, Any] | None = None) -> None:
        self.directory, self.fingerprint, self.keep = Path(directory), fingerprint, keep
        self.layout = layout or {}

    def path(self, step: int) -> Path:
        return self.directory / f"step_{step:08d}"

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             trainer_state: dict[str, Any]) -> Path:
        """Write checkpoint ``step``; raise ``FileExistsError`` (on every rank, before writing)
        if it exists."""
        final, tmp = self.path(step), self.directory / f".tmp-step_{step:08d}"
        if final.exists():
            raise FileExistsError(f"checkpoint {final} exists; it is never written over")
        rank = dist.get_rank()
        if rank == 0:  # earlier attempts' unpublished saves and interrupted removals
            for stale in [*self.directory.glob(".tmp-step_*"), *self.directory.glob(".pruned-step_*")]:
                shutil.rmtree(stale)
        dist.barrier()
        state = {"model": get_model_state_dict(model),
                 "optim": get_optimizer_state_dict(model, optimizer)}
        dcp.save(state, checkpoint_id=str(tmp))
        torch.save(trainer_state, tmp / f"trainer_rank{rank}.pt")
        dist.barrier()
        if rank == 0:
            _publish(tmp, final, self.fingerprint, self.layout, step)
            self._prune()
        dist.barrier()
        return final

    def _prune(self) -> None:
        steps = sorted(p for p in self.directory.iterdir() if _STEP_DIR.match(p.name))
        for old in steps[: -self.keep]:
            pruned = self.directory / f".pruned-{old.name}"
            os.rename(old, pruned)  # atomic: the checkpoint is published or gone, never half
            shutil.rmtree(pruned)

    def load(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Load checkpoint ``path`` (already verified by :func:`read_manifest`) into ``model``
        and ``optimizer``, resharded by DCP to their current sharding (any world size, mesh or
        state sharding)."""
        state = {"model": get_model_state_dict(model),
                 "optim": get_optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"])
