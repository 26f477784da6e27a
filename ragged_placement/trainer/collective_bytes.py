"""The bytes of every collective a rank issues: the trainer's ``comm`` (log line and ``--metrics``).

:class:`CollectiveBytes` wraps, inside ``with``, the entry points through which collectives
reach c10d: ``torch.distributed``'s and their aliases in :mod:`ragged_placement._compat` (FSDP's all-gathers and reduce-scatters, the optimizers'
all-to-alls, the loss's all-reduce) and the functional collectives that DTensor's
redistributions use (a gradient norm's all-reduce). Each collective counts once, at its size,
the same convention as :class:`ragged_placement.testing.profiling.CollectiveMeter`: an all-gather's
gathered output, a reduce-scatter's or all-to-all's input, an all-reduce's or broadcast's tensor.
A call made inside another wrapped one (a functional collective built on another) is not
counted again.
"""

from __future__ import annotations

import collections
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from typing_extensions import Self  # a dependency of torch

import ragged_placement._compat as compat

__all__ = ["CollectiveBytes"]


def _nbytes(x: Any) -> int:
    """Bytes of a tensor or of a (nested) sequence of tensors."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, Sequence):
        return sum(_nbytes(t) for t in x)
    return 0


# (module, function, which argument has the collective's size: its index, or "result")
_ENTRY_POINTS: list[tuple[Any, str, int | str]] = [
    (dist, "all_reduce", 0),
    (dist, "broadcast", 0),
    (dist, "all_gather", 0),  # the output list
    (dist, "all_gather_into_tensor", 0),  # the output
    (dist, "all_gather_single", 0),  # torch 2.13's name of all_gather_into_tensor
    (compat, "_all_gather", 0),  # either of them, bound at import
    (dist, "reduce_scatter", 1),  # the input list
    (dist, "reduce_scatter_tensor", 1),
    (dist, "reduce_scatter_single", 1),
    (compat, "_reduce_scatter", 1),
    (compat, "all_gather_coalesced", 0),  # one unit's equal segments: the output list
    (compat, "reduce_scatter_coalesced", 1),  # the input list
    (dist, "all_to_all", 1),
    (dist, "all_to_all_single", 1),
    (funcol, "all_reduce", 0),
    (funcol, "all_reduce_coalesced", 0),
    (funcol, "broadcast", 0),
    (funcol, "reduce_scatter_tensor", 0),
    (funcol, "reduce_scatter_tensor_autograd", 0),
    (funcol, "reduce_scatter_tensor_coalesced", 0),
    (funcol, "all_to_all_single", 0),
    (funcol, "all_to_all_single_autograd", 0),
    (funcol, "all_gather_tensor", "result"),
    (funcol, "all_gather_tensor_autograd", "result"),
    (funcol, "all_gather_into_tensor_coalesced", "result"),
]


class CollectiveBytes:
    """Inside ``with``: ``total`` bytes and ``calls`` of every collective this rank issued,
    ``by_name[function]`` the bytes per entry point."""

    total: int
    calls: int
    by_name: collections.Counter[str]

    def __init__(self) -> None:
        self.total, self.calls, self.by_name = 0, 0, collections.Counter()
        self._depth, self._saved = 0, []

    def __enter__(self) -> Self:
        for module, name, size in _ENTRY_POINTS:
            fn = getattr(module, name, None)
            if fn is not None:
                self._saved.append((module, name, fn))
                setattr(module, name, self._wrap(f"{module.__name__.rsplit('.', 1)[-1]}.{name}", fn, size))
        return self

    def __exit__(self, *exc) -> None:
        for module, name, fn in reversed(self._saved):
            setattr(module, name, fn)
        self._saved.clear()

    def _wrap(self, name: str, fn: Callable, size: int | str) -> Callable:
        signature = inspect.signature(fn)
        sized = None if size == "result" else list(signature.parameters)[size]

        @functools.wraps(fn)
        def counted(*args, **kwargs):
            self._depth += 1
            try:
                result = fn(*args, **kwargs)
            finally:
                self._depth -= 1
            if self._depth == 0:
                arguments = signature.bind(*args, **kwargs).arguments
                nbytes = _nbytes(result if sized is None else arguments[sized])
                self.total += nbytes
                self.calls += 1
                self.by_name[name] += nbytes
            return result

        return counted
