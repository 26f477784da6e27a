"""The install: one table of patched torch attributes, checked before patching, fully reversible.

* After :func:`ragged_placement._install.uninstall` every patched attribute is torch's original
  object again (same identity, a class's staticmethod included), the names we added are gone,
  stock DTensor works and RaggedShard is unknown to torch; :func:`install` brings it back.
* :func:`install` refuses (``ImportError``, nothing patched) when an attribute is not torch's.
* torch's debug helpers for the sharding-propagation cache, and what its ``op_strategy_context``
  test helper does, work with the package installed (the propagator keeps a ``LocalLRUCache``).
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from dist_utils import run_threaded
from ragged_placement import RaggedShard
from ragged_placement import _install

warnings.filterwarnings("ignore", category=FutureWarning)


def _torch_names() -> dict[tuple[str, str], str | None]:
    """What each patched attribute is, described independently of the package's own check."""
    out = {}
    for patch in _install.PATCHES:
        value = getattr(patch.resolve_owner(), patch.name, None)
        if value is None:
            out[(patch.owner, patch.name)] = None
        elif inspect.iscode(value):
            out[(patch.owner, patch.name)] = f"{value.co_filename.rsplit('/', 1)[-1]}:{value.co_qualname}"
        else:
            fn = getattr(value, "__func__", value)
            name = getattr(fn, "__qualname__", None) if callable(fn) and not hasattr(fn, "cache_info") else None
            out[(patch.owner, patch.name)] = (f"{fn.__module__}.{name}" if name
                                              else f"{type(value).__module__}.{type(value).__qualname__}")
    return out


def _stock_and_ragged(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    t = torch.arange(24.0).reshape(6, 4)
    d = distribute_tensor(t, mesh, [Shard(0)])
    stock = torch.equal((d * 2).redistribute(mesh, [Replicate()]).to_local(), 2 * t)
    try:
        r = distribute_tensor(t, mesh, [RaggedShard((0,), (1, 2))])
        ragged = torch.equal(r.full_tensor(), t)
    except Exception as exc:  # noqa: BLE001 - torch rejects the unknown placement somewhere
        ragged = type(exc).__name__
    return {"stock": stock, "ragged": ragged}


def test_uninstall_restores_torch_exactly_and_install_again_works(one_torch_thread):
    assert _install.installed()
    originals = [(patch, owner, original) for patch, owner, original in _install._applied]
    assert [p for p, _, _ in originals] == list(_install.PATCHES)
    try:
        _install.uninstall()
        assert not _install.installed()
        for patch, owner, original in originals:
            now = owner.__code__ if patch.name == "__code__" else vars(owner).get(patch.name, _install._ABSENT)
            assert now is original, f"{patch.owner}.{patch.name} was not restored"
        assert _torch_names() == {(p.owner, p.name): p.expected for p in _install.PATCHES}
        propagator = DTensor._op_dispatcher.sharding_propagator
        assert "propagate_op_sharding_non_cached" not in vars(propagator)
        results = run_threaded(_stock_and_ragged, 2)
        assert all(r["stock"] for r in results)
        assert all(r["ragged"] is not True for r in results), "torch must not know RaggedShard after uninstall"
    finally:
        _install.install()
    assert _install.installed()
    results = run_threaded(_stock_and_ragged, 2)
    assert all(r["stock"] is True and r["ragged"] is True for r in results)


def test_install_refuses_a_changed_torch_and_patches_nothing(monkeypatch):
    from torch.distributed.tensor import _utils

    _install.uninstall()
    try:
        before = {(p.owner, p.name): getattr(p.resolve_owner(), p.name, None) for p in _install.PATCHES}
        monkeypatch.setattr(_utils, "_compute_local_shape_and_global_offset", lambda *a: None)
        with pytest.raises(ImportError, match="_compute_local_shape_and_global_offset"):
            _install.install()
        assert not _install.installed()
        for patch in _install.PATCHES:
            if patch.name != "_compute_local_shape_and_global_offset" or "_utils" not in patch.owner:
                assert getattr(patch.resolve_owner(), patch.name, None) == before[(patch.owner, patch.name)]
    finally:
        monkeypatch.undo()
        _install.install()
    assert _install.installed()


def test_torch_debug_cache_helpers_and_strategy_registration_work_installed():
    from torch.distributed.tensor import debug
    from torch.distributed.tensor._op_schema import OpStrategy
    from torch.distributed.tensor._ops.utils import register_op_strategy

    info = debug._get_python_sharding_prop_cache_info()
    assert hasattr(info, "hits") and hasattr(info, "currsize")
    debug._clear_sharding_prop_cache()
    assert debug._get_python_sharding_prop_cache_info().currsize == 0

    # what torch's op_strategy_context test helper does (its module needs expecttest)
    propagator = DTensor._op_dispatcher.sharding_propagator
    op = torch.ops.aten.sinc.default
    saved = propagator.op_strategy_funcs.pop(op, None), propagator.op_to_schema_info.pop(op, None)
    try:
        register_op_strategy(op)(lambda op_schema: OpStrategy([]))
    finally:
        propagator.op_strategy_funcs.pop(op, None)
        propagator.op_to_schema_info.pop(op, None)
        if saved[0] is not None:
            propagator.op_strategy_funcs[op] = saved[0]
        if saved[1] is not None:
            propagator.op_to_schema_info[op] = saved[1]
        debug._clear_sharding_prop_cache()
