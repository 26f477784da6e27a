"""How the FSDP runtime composes with ``torch.compile``: its hooks run eagerly, outside graphs.

A unit's hooks issue collectives with ``async_op=True``, resize the unsharded buffer's storage
(``UntypedStorage.resize_``) and swap module parameters: none of it is traceable, and traced it
would split every compiled block into several graphs. As torch FSDP2 does, every hook (forward
pre/post, pre-backward, post-backward, the root's final callback, the per-parameter gradient
hooks) is wrapped in ``torch._dynamo.disable(..., recursive=True)``:

* ``block.compile()`` (torchtitan's order: ``fully_shard`` first) compiles ``_call_impl``, a
  frame Dynamo skips (``torch.nn`` is on its skip list); it compiles the frames that one calls
  instead: the module's ``forward`` and, were they not disabled, our hooks (which gave 5 graphs
  and 9 breaks per block). Disabled, the hooks run eagerly around one graph of the block's own
  compute, with no graph break, as FSDP2's.
* ``torch.compile(model)`` (whole model) traces the root's ``forward`` and inlines the blocks'
  ``_call_impl``: the first disabled hook is a graph break inside the loop over the blocks, which
  Dynamo cannot resume from, so it runs the root's ``forward`` eagerly (a skipped frame, not
  counted as a graph break) and compiles each block's ``forward`` on its own: the same graphs as
  per-block compile. FSDP2 behaves identically (``tests/fsdp/test_fsdp_compile.py`` compares the
  counts in the same test).

The per-parameter gradient hooks run once per parameter per backward, where the wrapper's
microseconds add up (674 parameters: about 0.45 ms a backward). They are
:class:`dynamo_skip_frame` functions instead: Dynamo never compiles their own frame
(``torch._dynamo.eval_frame.skip_code``), and they reach Python only through
methods under ``dynamo_disable``, so nothing they run is traced either.

``torch._dynamo`` is imported when ``fully_shard`` first registers the hooks (it is imported by
then anyway), not when this package is imported. torch 2.11's FSDP2 disables its hooks only
while ``torch._dynamo.config.skip_fsdp_hooks`` is set (the default; Traceable FSDP2 clears it),
2.13's always; ours are never traceable, so they are disabled on every supported release and
the flag is not consulted.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

__all__ = ["dynamo_disable", "dynamo_skip_frame"]

_REASON = "ragged_placement FSDP hooks run eagerly (collectives, storage resizes)"


class _LazyMethodDecorator:
    """A method decorator whose function is built from the decorated one at the first attribute
    access (``fully_shard`` registering the hooks), so that importing this package does not
    import Dynamo; :meth:`_build` builds it."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._built: Callable[..., Any] | None = None

    def _build(self) -> Callable[..., Any]:
        raise NotImplementedError

    def _get(self) -> Callable[..., Any]:
        if self._built is None:  # a race builds two equivalent functions: harmless
            self._built = self._build()
        return self._built

    def __get__(self, obj: object, objtype: type | None = None) -> Callable[..., Any]:
        fn = self._get()
        return fn if obj is None else types.MethodType(fn, obj)


class dynamo_disable(_LazyMethodDecorator):
    """Method decorator: the method runs with Dynamo disabled for it and everything it calls.

    Where a traced region calls it, Dynamo breaks the graph there and never traces it; where it
    is a hook that a skipped frame (``nn.Module._call_impl``) calls, no frame of ours is
    compiled: the bound method's function is ``torch._dynamo.disable``'s own wrapper, which
    Dynamo skips (a plain Python wrapper of ours would itself be compiled as a new frame).
    A disabled call costs a few microseconds (Dynamo's frame callback is swapped out and back).
    """

    def _build(self) -> Callable[..., Any]:
        import torch._dynamo

        return torch._dynamo.disable(self._fn, recursive=True, reason=_REASON)


class dynamo_skip_frame(_LazyMethodDecorator):
    """Method decorator for a hot hook that Dynamo must never compile, at no cost per call.

    The function's own frame is marked skipped (``skip_code``: Dynamo runs it as it is, even
    while a compiled region's frame callback is active), and no wrapper frame is added. Unlike
    :class:`dynamo_disable`, the frames it calls are not skipped: the function may call C
    functions, and Python only through methods under ``dynamo_disable``. On a torch without
    ``skip_code`` it is :class:`dynamo_disable`'s wrapper."""

    def _build(self) -> Callable[..., Any]:
        from torch._dynamo import eval_frame

        skip_code = getattr(eval_frame, "skip_code", None)
        if skip_code is None:
            return dynamo_disable(self._fn)._get()
        skip_code(self._fn.__code__)
        return self._fn
