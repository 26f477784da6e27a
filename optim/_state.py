"""Optimizer state that lives next to the parameter shards, exported as DTensors.

The optimizers keep per-parameter state as plain local tensors (the math is local). Their
``state_dict()`` presents every state tensor that has the parameter's local shape as a DTensor
with the parameter's mesh and placements (so DCP can save and reshard it like the parameter),
and ``load_state_dict()`` accepts those DTensors (or plain local tensors) back.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["ShardedStateOptimizer", "check_non_negative", "check_unit_interval"]


def check_non_negative(name: str, value: float) -> None:
    if not value >= 0.0:
        raise ValueError(f"{name} must be non-negative, got {value!r}")


def check_unit_interval(name: str, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")


class ShardedStateOptimizer(torch.optim.Optimizer):
    """``torch.optim.Optimizer`` whose param-shaped state round-trips as sharded DTensors."""

    def _indexed_params(self) -> dict[int, torch.Tensor]:
        out: dict[int, torch.Tensor] = {}
        seen: set[int] = set()
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    out[index] = p
                index += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        """The torch state dict, with param-shaped state of DTensor parameters as DTensors."""
        sd = super().state_dict()
        params = self._indexed_params()
        state = {}
        for index, pstate in sd["state"].items():
            p = params[index]
            if isinstance(p, DTensor):
                local_shape = p._local_tensor.shape
                pstate = {
                    k: DTensor.from_local(
                        v,
                        p.device_mesh,
                        p.placements,
                        shape=p.shape,
                        stride=p.stride(),
                        run_check=False,
                    )
                    if isinstance(v, torch.Tensor)
                    and not isinstance(v, DTensor)
                    and v.shape == local_shape
                    and v.ndim > 0
                    else v
                    for k, v in pstate.items()
                }
            state[index] = pstate
        sd["state"] = state
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` (or DCP's ``get_optimizer_state_dict``).

        State keys are matched to parameters the way torch does it: through the ids listed in
        the saved ``param_groups``, in order. DTensor state must have its parameter's placements.
        """
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        by_id = dict(zip(saved_ids, params))
        state = {}
        for key, pstate in state_dict["state"].items():
            p = by_id.get(key)
            unpacked = {}
            for k, v in pstate.items():
                if isinstance(v, DTensor):
                    if not isinstance(p, DTensor) or v.placements != p.placements:
                        raise ValueError(
                            f"state_dict state {key!r}[{k!r}] has placements {v.placements}, "
                            f"but the parameter has {getattr(p, 'placements', None)}"
                        )
                    v = v._local_tensor
                unpacked[k] = v
            state[key] = unpacked
        super().load_state_dict({**state_dict, "state": state})
