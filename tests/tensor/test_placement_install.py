"""The install: one table of patched torch attributes, checked before patching, fully reversible.

* Importing the package (every module of it) patches nothing; the first RaggedShard installs
  :data:`~ragged_placement._install.PATCHES`, the first ``fully_shard`` the FSDP2 rows too.
* After :func:`ragged_placement._install.uninstall` every patched attribute is torch's original
  object again (same identity, a class's staticmethod included), the names we added are gone,
  stock DTensor works and RaggedShard is unknown to torch; the next RaggedShard installs again.
* :func:`install` refuses (``RuntimeError`` naming the row and what changed, nothing patched)
  when an attribute is not torch's; an untested torch gets one warning at import naming its
  version and the rows that changed.
* torch's debug helpers for the sharding-propagation cache, what its ``op_strategy_context``
  test helper does, and its ``test_custom_recursive_decomp`` work with the package installed
  (the propagator keeps a ``LocalLRUCache``).
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


ALL_PATCHES = (*_install.PATCHES, *_install.FSDP2_PATCHES, *_install.OPTIM_PATCHES)


def _torch_names() -> dict[tuple[str, str], str | None]:
    """What each patched attribute is, described independently of the package's own check."""
    out = {}
    for patch in ALL_PATCHES:
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


_IMPORT_EVERYTHING = """
import importlib, pkgutil
import torch
import torch.distributed.fsdp  # so that the FSDP2 rows' owners resolve before the import too
try:  # what the torchtitan integration imports: torchtitan's own import rebinds torch.optim.adam's
    import torchtitan.train  # noqa: F401  _fused_adam (a torch function one of our rows wraps)
except ImportError:
    pass
from torch.distributed import distributed_c10d as c10d

TARGETS = {targets!r}
ABSENT = object()

def raw_targets():
    out = {{}}
    for owner, name in TARGETS:
        module, _, attrs = owner.partition(":")
        obj = importlib.import_module(module)
        for attr in filter(None, attrs.split(".")):
            obj = getattr(obj, attr)
        out[owner, name] = obj.__code__ if name == "__code__" else vars(obj).get(name, ABSENT)
    return out

before, gloo = raw_targets(), c10d.ProcessGroupGloo
import ragged_placement
for info in pkgutil.walk_packages(ragged_placement.__path__, "ragged_placement."):
    importlib.import_module(info.name)
import ragged_placement.train
from ragged_placement import _install
after = raw_targets()
changed = [t for t in TARGETS if after[t] is not before[t]]
assert not changed, changed
assert c10d.ProcessGroupGloo is gloo and not _install.installed() and not _install._applied_fsdp2
from ragged_placement import RaggedShard
RaggedShard((0,), (1, 1))
assert _install.installed() and not _install._applied_fsdp2
from ragged_placement.fsdp import fully_shard
try:
    fully_shard(torch.nn.Linear(2, 2), mesh="not a mesh")
except (TypeError, ValueError):
    pass
assert len(_install._applied_fsdp2) == len(_install.FSDP2_PATCHES) + len(_install.OPTIM_PATCHES)
print("ok", len(TARGETS))
"""


def test_importing_every_module_patches_nothing_and_first_use_installs():
    """In a fresh interpreter: every patched target and gloo's class are the same objects after
    importing every module of the package; a RaggedShard installs the DTensor rows, fully_shard
    the FSDP2 rows."""
    import subprocess
    import sys

    targets = [(p.owner, p.name) for p in ALL_PATCHES]
    out = subprocess.run([sys.executable, "-c", _IMPORT_EVERYTHING.format(targets=targets)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["ok", str(len(ALL_PATCHES))]


def _installed_everything() -> None:
    from ragged_placement.fsdp.api import _FSDP2_HOOKS

    RaggedShard((0,), (1,))
    _install.install_fsdp2(_FSDP2_HOOKS)


def test_uninstall_restores_torch_exactly_and_install_again_works(one_torch_thread):
    _installed_everything()
    assert _install.installed()
    originals = [*_install._applied, *_install._applied_fsdp2]
    assert [p for p, _, _ in originals] == list(ALL_PATCHES)
    try:
        _install.uninstall()
        assert not _install.installed()
        for patch, owner, original in originals:
            now = owner.__code__ if patch.name == "__code__" else vars(owner).get(patch.name, _install._ABSENT)
            assert now is original, f"{patch.owner}.{patch.name} was not restored"
        assert _torch_names() == {(p.owner, p.name): p.expected for p in ALL_PATCHES}
        assert _install.changed_rows() == []
        propagator = DTensor._op_dispatcher.sharding_propagator
        assert "propagate_op_sharding_non_cached" not in vars(propagator)
        results = run_threaded(_stock_only, 2)
        assert all(results)
    finally:
        _installed_everything()
    assert _install.installed()
    assert [p for p, _, _ in _install._applied_fsdp2] == [*_install.FSDP2_PATCHES, *_install.OPTIM_PATCHES]
    results = run_threaded(_stock_and_ragged, 2)
    assert all(r["stock"] is True and r["ragged"] is True for r in results)


def _stock_only(rank: int, world: int) -> bool:
    mesh = init_device_mesh("cpu", (world,))
    t = torch.arange(24.0).reshape(6, 4)
    d = distribute_tensor(t, mesh, [Shard(0)])
    return torch.equal((d * 2).redistribute(mesh, [Replicate()]).to_local(), 2 * t)


def test_install_refuses_a_changed_torch_and_patches_nothing(monkeypatch):
    from torch.distributed.tensor import _utils

    _install.uninstall()
    try:
        before = {(p.owner, p.name): getattr(p.resolve_owner(), p.name, None) for p in _install.PATCHES}
        monkeypatch.setattr(_utils, "_compute_local_shape_and_global_offset", lambda *a: None)
        with pytest.raises(RuntimeError, match="_compute_local_shape_and_global_offset.* expected torch's"):
            _install.install()
        assert not _install.installed()
        with pytest.raises(RuntimeError, match="not patching anything"):
            RaggedShard((0,), (1,))  # the first use raises the same, every time
        for patch in _install.PATCHES:
            if "_compute_local_shape_and_global_offset" not in f"{patch.owner}.{patch.name}":
                assert getattr(patch.resolve_owner(), patch.name, None) == before[(patch.owner, patch.name)]
    finally:
        monkeypatch.undo()
        _installed_everything()
    assert _install.installed()


def test_a_changed_signature_is_named_before_anything_is_patched(monkeypatch):
    """A target with torch's name but other parameters (what a release that adds or reorders
    them looks like) is refused naming both lists."""
    from torch.distributed import _state_dict_utils

    original = _state_dict_utils._distribute_tensors

    def _distribute_tensors(state_dict, keys, device, pg=None):  # a renamed first parameter
        return original(state_dict, keys, device, pg)

    _distribute_tensors.__module__, _distribute_tensors.__qualname__ = original.__module__, original.__qualname__
    _install.uninstall()
    try:
        monkeypatch.setattr(_state_dict_utils, "_distribute_tensors", _distribute_tensors)
        rows = dict(_install.changed_rows())
        assert list(rows) == ["torch.distributed._state_dict_utils._distribute_tensors"]
        assert "('state_dict', 'keys', 'device', 'pg')" in rows[list(rows)[0]]
        with pytest.raises(RuntimeError, match="_distribute_tensors: its parameters are"):
            _install.install()
        assert not _install.installed()
    finally:
        monkeypatch.undo()
        _installed_everything()


def test_an_untested_torch_warns_once_at_import_naming_the_version_and_changed_rows(monkeypatch):
    from torch.distributed.tensor import _utils

    from ragged_placement import _compat

    monkeypatch.setattr(_compat, "TORCH_VERSION", (2, 99))
    monkeypatch.setattr(_install, "_warned_untested", False)
    _install.uninstall()
    try:
        monkeypatch.setattr(_utils, "_compute_local_shape_and_global_offset", lambda *a: None)
        with pytest.warns(UserWarning) as caught:
            _install.warn_if_untested()
            _install.warn_if_untested()  # once
        assert len(caught) == 1
        message = str(caught[0].message)
        assert f"this is torch {torch.__version__}" in message and "2.14" in message
        assert "1 of its patch rows no longer match" in message
        assert "torch.distributed.tensor._utils:_compute_local_shape_and_global_offset.__code__: it is " in message
        assert not _install.installed()
    finally:
        monkeypatch.undo()
        _installed_everything()


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


def _recursive_decomp_cache(rank: int, world: int) -> tuple:
    """torch's test_decomp_sharding.py::test_custom_recursive_decomp, which failed only with the
    package imported: decompositions hit the Python sharding cache."""
    import torch.distributed.tensor as dtensor
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor.debug import _get_python_sharding_prop_cache_info

    mesh = init_device_mesh("cpu", (2, 2))
    x = dtensor.empty(16, 16, device_mesh=mesh, placements=[Shard(0), Shard(1)])
    y = dtensor.empty(16, 16, device_mesh=mesh, placements=[Replicate(), Shard(0)])
    ops = torch.ops.ragged_install_test
    first = ops.op1(x, y)
    size = _get_python_sharding_prop_cache_info().currsize
    ops.op1(x, y)
    again = _get_python_sharding_prop_cache_info().currsize
    second = ops.op2(x, y)
    return first.placements, second.placements, (Shard(0), Partial("sum")), size, again, \
        _get_python_sharding_prop_cache_info().currsize


def test_custom_recursive_decomposition_hits_the_sharding_cache_installed():
    from torch._decomp import register_decomposition

    with torch.library._scoped_library("ragged_install_test", "FRAGMENT") as lib:
        lib.define("op1(Tensor x, Tensor y) -> Tensor")
        lib.define("op2(Tensor x, Tensor y) -> Tensor")
        torch.library.impl(lib, "op1", "CPU")(lambda x, y: x @ y * 1.0)
        torch.library.impl(lib, "op2", "CPU")(lambda x, y: x @ y)
        op1, op2 = torch.ops.ragged_install_test.op1.default, torch.ops.ragged_install_test.op2.default
        register_decomposition(op1)(lambda x, y: torch.ops.ragged_install_test.op2(x, y) * 1.0)
        register_decomposition(op2)(lambda x, y: x @ y)
        torch.library.register_fake("ragged_install_test::op1")(lambda x, y: torch.empty_like(x) @ torch.empty_like(y))
        torch.library.register_fake("ragged_install_test::op2")(lambda x, y: torch.empty_like(x) @ torch.empty_like(y))
        try:
            for first, second, want, size, again, after in run_threaded(_recursive_decomp_cache, 4):
                assert first == want and second == want
                assert size == again == after
        finally:
            from torch._decomp import global_decomposition_table

            for table in global_decomposition_table.values():
                table.pop(op1, None)
                table.pop(op2, None)
