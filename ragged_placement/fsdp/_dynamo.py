"""How the FSDP runtime composes with ``torch.compile``: its hooks run eagerly, outside graphs.

A unit's hooks issue collectives with ``async_op=True``, resize the unsharded buffer's storage
(``UntypedStorage.resize_``) and swap module parameters: none of it is traceable, and traced it
would split every compiled block into several graphs. As torch FSDP2 does, every hook (forward
pre/post, pre-backward, post-backward, the root's final callback, the per-parameter gradient
hooks) is wrapped in ``torch._dynamo.disable(..., recursive=True)``:

* ``block.compile()`` (torchtitan's order: ``fully_shard`` first) compiles ``_call_impl``. When
  Dynamo reaches a disabled forward hook it skips the ``_call_impl`` frame (the hooks run
  eagerly) and compiles the module's ``forward`` as its own frame: one graph per block and no
  graph break, the same as FSDP2.
* ``torch.compile(model)`` inlines each block's ``_call_impl``: every disabled hook is a graph
  break, again exactly where FSDP2's are.

``torch._dynamo`` is imported at the first hook call, not at import time (its import costs
seconds), as FSDP2 does. torch <= 2.11 lets Traceable FSDP2 trace its own hooks when
``torch._dynamo.config.skip_fsdp_hooks`` is off; ours are never traceable, so that flag is not
consulted and the hooks are disabled on every supported release.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

__all__ = ["dynamo_disable"]

_REASON = "ragged_placement FSDP hooks run eagerly (collectives, storage resizes)"


class dynamo_disable:  # noqa: N801 - used as a method decorator
    """Method decorator: the method runs with Dynamo disabled for it and everything it calls.

    Where a traced region calls it, Dynamo breaks the graph there and never traces it; where it
    is a hook that a skipped frame (``nn.Module._call_impl``) calls, no frame of ours is
    compiled: the bound method's function is ``torch._dynamo.disable``'s own wrapper, which
    Dynamo skips (a plain Python wrapper of ours would itself be compiled as a new frame).
    The disabled function is built at the first attribute access (``fully_shard`` registering
    the hooks, by which time ``torch._dynamo`` is imported), so importing this package does not
    import Dynamo.
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._disabled: Callable[..., Any] | None = None

    def _get_disabled(self) -> Callable[..., Any]:
        if self._disabled is None:  # a race builds two equivalent wrappers: harmless
            import torch._dynamo

            self._disabled = torch._dynamo.disable(self._fn, recursive=True, reason=_REASON)
        return self._disabled

    def __get__(self, obj: object, objtype: type | None = None) -> Callable[..., Any]:
        fn = self._get_disabled()
        return fn if obj is None else types.MethodType(fn, obj)
