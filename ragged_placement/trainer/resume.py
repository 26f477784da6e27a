"""Which checkpoint a starting run resumes from, checked before any process-group work.

:func:`find_resume` picks the newest complete checkpoint of ``--checkpoint-dir``, verifies it
(checksums, options) and returns what this rank restores, or raises a ``ValueError`` naming the
flag that cannot carry over. A checkpoint resumes on another world size, mesh, runtime,
``--state-sharding`` or ``--ep`` than it was saved with: DCP reshards the model and optimizer state, and
the trainer state (LR scheduler, step, data position, RNG) is the same on every rank, so each
new rank takes it; the global batch (``--batch`` x ranks) must stay the checkpoint's, so that
the data of every step is the same sequences. What cannot carry over is refused: another global
batch (``--batch``), Shampoo's rank-local preconditioners (``--optimizer shampoo``), RNG states
that differ between the saved ranks. ``--steps`` may grow: the LR schedule then runs to the new
``--steps``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ragged_placement.trainer.checkpoint import (
    latest_checkpoint,
    read_manifest,
    trainer_state_files,
)
from ragged_placement.trainer.config import TrainConfig

__all__ = ["Resume", "find_resume", "layout", "restore_rng", "rng_state"]

# Options a resumed run may change, each with its own rule below (the others must match).
_FREE = ("batch", "steps")


@dataclass
class Resume:
    """A verified checkpoint and what this rank restores from it.

    ``state``: this rank's trainer state (``scheduler``, ``step``, ``data``, ``rng``);
    ``changes``: what differs from the run that saved it, one line each (rank 0 logs them);
    ``schedule_changed``: ``--steps`` differs, so the LR of the first step is recomputed."""

    path: Path
    step: int
    state: dict[str, Any]
    changes: list[str] = field(default_factory=list)
    schedule_changed: bool = False


def layout(cfg: TrainConfig, world_size: int) -> dict[str, Any]:
    """How a run is distributed: saved in each manifest, compared on resume."""
    out = {"world_size": world_size, "runtime": cfg.runtime, "state_sharding": cfg.state_sharding,
           "mesh": "x".join(map(str, cfg.mesh or (world_size,)))}
    if cfg.model == "moe" or cfg.ep > 1:
        out["ep"] = cfg.ep
    return out


def _check_options(cfg: TrainConfig, saved: dict[str, Any], path: Path) -> None:
    for key, value in json.loads(json.dumps(cfg.fingerprint())).items():
        if key not in _FREE and saved.get(key) != value:
            raise ValueError(
                f"--{key.replace('_', '-')} {value!r} differs from {saved.get(key)!r} in the "
                f"checkpoint {path}: resume with the same value or use another --checkpoint-dir"
            )


def _check_batch(cfg: TrainConfig, world_size: int, batch: int, world: int, path: Path) -> None:
    if cfg.batch * world_size == batch * world:
        return
    hint = (f"pass --batch {batch * world // world_size}" if batch * world % world_size == 0
            else f"resume on a number of ranks that divides {batch * world}")
    raise ValueError(
        f"--batch {cfg.batch} on {world_size} ranks is a global batch of {cfg.batch * world_size} "
        f"sequences; the checkpoint {path} was trained with --batch {batch} on {world} ranks "
        f"({batch * world}): {hint} to keep the data of every step"
    )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _shared_state(files: dict[int, Path], path: Path, world_size: int) -> dict[str, Any]:
    """The trainer state every saved rank holds alike, for a run on another world size."""
    states = {r: torch.load(f, weights_only=False) for r, f in sorted(files.items())}
    first = states[0]
    for r, state in states.items():
        for part in ("step", "scheduler", "data", "rng"):
            if not _same(state.get(part), first.get(part)):
                raise ValueError(
                    f"--checkpoint-dir: the {part} of rank {r} differs from rank 0's in {path}: "
                    f"it cannot be shared by {world_size} ranks; resume on {len(states)} ranks"
                )
    return first


def find_resume(cfg: TrainConfig, rank: int, world_size: int) -> Resume | None:
    """The newest complete checkpoint of ``--checkpoint-dir``, verified (checksums, options,
    what carries over to ``world_size`` ranks), or ``None``. Runs before any process-group
    work; raises ``ValueError`` naming the flag that cannot carry over."""
    if not cfg.checkpoint_dir:
        return None
    path = latest_checkpoint(cfg.checkpoint_dir)
    if path is None:
        return None
    manifest = read_manifest(path)
    saved, step = manifest["fingerprint"], manifest["step"]
    _check_options(cfg, saved, path)
    if cfg.steps < step:
        raise ValueError(f"--steps {cfg.steps} is below the step {step} of the checkpoint {path}: "
                         f"pass --steps {step} or more, or use another --checkpoint-dir")
    files = trainer_state_files(path)
    before, now = {"world_size": len(files), **manifest.get("layout", {})}, layout(cfg, world_size)
    _check_batch(cfg, world_size, saved["batch"], before["world_size"], path)
    moved = [f"{key.replace('_', ' ')} {before[key]} -> {value}"
             for key, value in now.items() if before.get(key, value) != value]
    changes = [f"{', '.join(moved)}: DCP reshards the model and optimizer state"] if moved else []
    if changes and cfg.optimizer == "shampoo":
        raise ValueError(
            f"--optimizer shampoo keeps its preconditioners on their owner ranks (rank-local "
            f"state): resume the checkpoint {path} on its layout ({', '.join(moved)})")
    if before["world_size"] == world_size:
        state = torch.load(files[rank], weights_only=False)
    else:
        state = _shared_state(files, path, world_size)
        changes.append(f"--batch {saved['batch']} -> {cfg.batch}: the same global batch of "
                       f"{cfg.batch * world_size} sequences, the data position (step {step}) and "
                       "RNG state carried over")
    if cfg.steps != saved["steps"]:
        changes.append(f"--steps {saved['steps']} -> {cfg.steps}: the LR schedule now runs to step "
                       f"{cfg.steps} (its warmup and cosine recomputed for {cfg.steps} steps)")
    return Resume(path, step, state, changes, schedule_changed=cfg.steps != saved["steps"])


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's RNG states (torch, Python's ``random``, CUDA), as a checkpoint keeps them."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    """Set this process's RNG states (torch, Python's ``random``, CUDA) from a checkpoint's."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
