"""Refuse an optimizer step on a unit's unsharded parameters.

As FSDP2's, a unit that keeps its all-gather from forward to backward (``reshard_after_forward=
False``, or the root at the default ``None``) leaves its unsharded parameters registered on its
modules in between: ``model.parameters()`` then gives them. An optimizer built from them at that
point would step tensors that the next all-gather overwrites, and their gradients are moved to
the sharded parameters at every backward, so the model would silently not train (FSDP2 does
exactly that). Here the first ``step()`` of such an optimizer raises ``ValueError`` instead,
before it changes anything: :func:`mark` records the unsharded parameters when they are left
registered, and a global optimizer step pre-hook (installed once) looks for them.

An optimizer step on a unit's sharded parameters while its unsharded ones are registered (a
forward with no backward, then ``step()``) leaves those stale: a post-hook registers the sharded
ones again (FSDP2 keeps the stale ones registered, and even reuses them at the next forward).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

__all__ = ["mark"]

# id -> (weak reference, fqn) of every unsharded parameter left registered after a forward
_UNSHARDED: dict[int, tuple[weakref.ref, str]] = {}
# the FSDP states whose unsharded parameters are registered now (see FSDPState.release_kept)
_KEPT: weakref.WeakSet = weakref.WeakSet()
_installed = False


def mark(state) -> None:
    """Record that ``state`` (an ``FSDPState``) left its unit's unsharded parameters registered
    after a forward: an optimizer step on any of them raises, and a step on its sharded ones
    registers those again (``state.release_kept()``). Installs the step hooks on first use."""
    global _installed
    if not _installed:
        register_optimizer_step_pre_hook(_check_step)
        register_optimizer_step_post_hook(_release_stepped)
        _installed = True
    _KEPT.add(state)
    unit = state.unit
    for p, fqn in zip(unit.unsharded_params, [s.fqn for s in unit.slots]):
        key = id(p)
        if key not in _UNSHARDED:
            _UNSHARDED[key] = (weakref.ref(p, lambda _, key=key: _UNSHARDED.pop(key, None)), fqn)


def _check_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    del args, kwargs
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = _UNSHARDED.get(id(p))
            if entry is not None and entry[0]() is p:
                raise ValueError(
                    f"{type(optimizer).__name__}.step(): the optimizer holds the unsharded "
                    f"parameter {entry[1]!r} of a fully_shard unit, not its sharded one. It was "
                    f"built from model.parameters() between a forward and its backward, when (as "
                    f"in FSDP2) a unit with reshard_after_forward=False, or the root at the "
                    f"default None, registers its unsharded parameters; stepping them would "
                    f"change nothing the model trains (FSDP2 trains silently wrong there). Build "
                    f"the optimizer before the first forward, or after backward or reshard()"
                )


def _release_stepped(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    del args, kwargs
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for state in list(_KEPT):
        if any(id(p) in stepped for p in state.unit.sharded_params):
            state.release_kept()
