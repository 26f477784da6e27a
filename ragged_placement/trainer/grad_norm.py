"""Gradient clipping when gradients are DTensors on several meshes.

``torch.nn.utils.clip_grad_norm_`` stacks the per-tensor norms, which DTensor refuses across
meshes: expert parallelism puts the experts on a ``(dp_mod_ep, ep)`` mesh beside the dense
parameters on the flattened data-parallel mesh (torchtitan clips such models in two groups, its
``_clip_grad_norm_with_ep``). :func:`clip_grad_norm_` computes each mesh's norm, reduces it to a
plain tensor, combines them, then scales each mesh's gradients by the one factor.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication

__all__ = ["clip_grad_norm_"]


def _by_mesh(params: Iterable[torch.Tensor]) -> dict[object, list[torch.Tensor]]:
    """Parameters with a gradient, grouped by their gradient's mesh (``None``: plain tensors)."""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(mesh, []).append(p)
    return groups


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale the gradients of ``params`` so their global 2-norm is at most ``max_norm``; return
    the norm before clipping (a plain tensor when the gradients span several meshes).

    On one mesh (or none) this is ``torch.nn.utils.clip_grad_norm_``. On several, each mesh's
    norm is computed and reduced over its mesh (``full_tensor``: a collective on every rank of
    it), the norms are combined as ``sqrt(sum(n_i ** 2))`` and each mesh's gradients are scaled by
    ``torch.nn.utils.clip_grads_with_norm_``'s factor (all ranks compute the same one)."""
    params = list(params)
    groups = _by_mesh(params)
    if len(groups) <= 1:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], 2.0)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    with implicit_replication():  # the plain total scales each mesh's DTensor gradients
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total
