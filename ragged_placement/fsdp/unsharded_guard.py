"""Refuse an optimizer step on a unit's unsharded parameters.

``model.parameters()`` gives the sharded parameters outside the units' own forward and backward
(:class:`~ragged_placement.fsdp.common.Registration`), with one exception kept from FSDP2:
:meth:`FSDPModule.unshard` registers the unsharded ones (``model.parameters(recurse=False)``
then gives them, in ``param_dtype``, until :meth:`~FSDPModule.reshard` or the unit's next
forward or backward). An optimizer built from them there would step tensors that the next
all-gather overwrites, whose gradients are moved to the sharded parameters at every backward:
the model would silently not train. Here the first ``step()`` of such an optimizer raises
``ValueError`` instead, before it changes anything: :func:`mark` records the unsharded
parameters when ``unshard()`` registers them, and a global optimizer step pre-hook (installed
once) looks for them.

An optimizer step on a unit's sharded parameters while its unsharded ones are registered leaves
those stale: a post-hook registers the sharded ones again (FSDP2 keeps the stale ones
registered).
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
    """Record that ``state`` (an ``FSDPState``) registered its unit's unsharded parameters
    (``FSDPModule.unshard()``): an optimizer step on any of them raises, and a step on its
    sharded ones registers those again (``state.release_kept()``). Installs the step hooks on
    first use."""
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
                    f"built from model.parameters() after FSDPModule.unshard(), which registers "
                    f"the unsharded parameters (as FSDP2's); stepping them would change nothing "
                    f"the model trains (FSDP2 trains silently wrong there). Build the optimizer "
                    f"before unshard() or after reshard()"
                )


def _release_stepped(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    del args, kwargs
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for state in list(_KEPT):
        if any(id(p) in stepped for p in state.unit.sharded_params):
            state.release_kept()
