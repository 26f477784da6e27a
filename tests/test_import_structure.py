"""The package's import graph: no cycles, ``TYPE_CHECKING`` imports included (the FSDP runtime
imports one way, as torch FSDP2's ``_fully_shard/`` does), read from the source with ``ast``
(nothing is imported)."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "ragged_placement"


def _package_dirs() -> dict[str, pathlib.Path]:
    """Each import root's folder: ``ragged_placement``, and the packages ``pyproject.toml``
    maps from elsewhere (``planner/`` and ``optim/`` at the top of the repository import as
    ``ragged_placement.planner`` and ``ragged_placement.optim``), longest name first."""
    text = (ROOT.parent / "pyproject.toml").read_text()
    section = text.split("[tool.setuptools.package-dir]", 1)[1].split("\n[", 1)[0]
    dirs = {name: ROOT.parent / path
            for name, path in re.findall(r'^"([\w.]+)"\s*=\s*"([^"]+)"', section, re.M)}
    dirs["ragged_placement"] = ROOT
    return dict(sorted(dirs.items(), key=lambda item: -len(item[0])))


PACKAGE_DIRS = _package_dirs()


def _sources() -> dict[str, pathlib.Path]:
    """Every module of the package, ``planner`` and ``optim`` included, by its import name."""
    return {_module_name(p): p for root in PACKAGE_DIRS.values() for p in root.rglob("*.py")}


def _module_path(name: str) -> pathlib.Path | None:
    """The source of package module ``name`` (``None`` if it is not one)."""
    for package, root in PACKAGE_DIRS.items():
        if name == package or name.startswith(package + "."):
            base = root.joinpath(*name[len(package):].split(".")[1:])
            for path in (base.with_suffix(".py"), base / "__init__.py"):
                if path.is_file():
                    return path
            return None
    return None


def _module_name(path: pathlib.Path) -> str:
    package, root = next((n, r) for n, r in PACKAGE_DIRS.items() if path.is_relative_to(r))
    parts = [*package.split("."), *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.Module, *, type_checking: bool = True) -> list[str]:
    """Every module an import statement names, at any depth (function-local imports too, and
    those under ``if TYPE_CHECKING:`` unless ``type_checking`` is false: an annotation names
    the module it imports as much as a call does, even if it never runs)."""
    names: list[str] = []

    def visit(node: ast.AST) -> None:
        if (not type_checking and isinstance(node, ast.If)
                and "TYPE_CHECKING" in ast.unparse(node.test)):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from pkg import sub`` reads the submodule; ``from pkg import name`` the package
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                names.append(sub if _module_path(sub) is not None else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


def _graph_of(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Module -> the modules of ``trees`` it imports (a package's own ``__init__`` excluded for
    its submodules, which Python runs first anyway)."""

    def resolve(name: str) -> str | None:
        while name and name not in trees:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, tree in trees.items():
        targets = {resolve(n) for n in _imports(tree)}
        graph[module] = {
            t for t in targets
            if t is not None and t != module and not module.startswith(t + ".")
        }
    return graph


def _import_graph() -> dict[str, set[str]]:
    """The package's import graph (:func:`_graph_of` its sources)."""
    return _graph_of({m: ast.parse(p.read_text()) for m, p in _sources().items()})


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_fsdp_runtime_has_no_import_cycle():
    graph = _import_graph()
    fsdp = {m: {t for t in ts if t.startswith("ragged_placement.fsdp")}
            for m, ts in graph.items() if m.startswith("ragged_placement.fsdp")}
    assert _cycles(fsdp) == []


def test_no_import_cycle_at_import_time():
    """Module-level imports only: importing any module never re-enters a half-imported one."""
    sources = _sources()
    graph = {}
    for module, path in sources.items():
        top = [n for n in ast.parse(path.read_text()).body
               if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = _imports(ast.Module(body=top, type_ignores=[]), type_checking=False)
        graph[module] = {n for n in names if n in sources and n != module
                         and not module.startswith(n + ".")}
    assert _cycles(graph) == []


def test_the_checker_sees_function_local_and_type_checking_imports():
    """An import inside a function body is an edge (it runs when the function does), and so is
    one under ``if TYPE_CHECKING:`` (only the import-time graph leaves it out)."""
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ragged_placement import regions\n"
        "def f():\n    from ragged_placement import transforms\n"
    )
    assert {"ragged_placement.transforms", "ragged_placement.regions"} <= set(_imports(tree))
    assert "ragged_placement.regions" not in _imports(tree, type_checking=False)


def test_the_cycle_test_fails_on_a_type_checking_cycle():
    """Two modules that import each other, one only for its annotations, are a cycle of the
    graph :func:`test_no_import_cycle` checks."""
    trees = {
        "pkg.buffer": ast.parse("from pkg.grads import Grads\n"),
        "pkg.grads": ast.parse(
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from pkg.buffer import FlatBuffer\n"
        ),
    }
    assert _cycles(_graph_of(trees)) == [["pkg.buffer", "pkg.grads"]]


def test_no_import_cycle():
    """No cycle in the package, function-local and ``TYPE_CHECKING`` imports included: the
    DTensor core imports one way, as torch's does (redistribute -> transforms -> regions ->
    placement), and the FSDP runtime's collaborators never name the buffer that holds them."""
    assert _cycles(_import_graph()) == []


def test_the_graph_covers_planner_and_optim():
    """``planner/`` and ``optim/`` are read as ``ragged_placement.planner`` / ``.optim``: their
    imports are edges of the graph the cycle tests check."""
    graph = _import_graph()
    assert "ragged_placement.planner.segments" in graph
    assert "ragged_placement.optim" in graph
    assert "ragged_placement.planner.uneven" in graph["ragged_placement.planner.segments"]


def test_planner_imports_nothing_from_the_runtime():
    """The planner owns its value types (``StateSharding``, ``GranularityPolicy``,
    ``Segment``); the FSDP runtime imports it one way."""
    graph = _import_graph()
    back = {m: sorted(t for t in ts if t.startswith("ragged_placement.fsdp"))
            for m, ts in graph.items() if m.startswith("ragged_placement.planner")}
    assert {m: ts for m, ts in back.items() if ts} == {}


def test_placement_imports_none_of_the_dtensor_core():
    graph = _import_graph()
    core = {"ragged_placement.regions", "ragged_placement.transforms", "ragged_placement.redistribute"}
    assert graph["ragged_placement.placement"] & core == set()
    assert "ragged_placement.placement" in graph["ragged_placement.regions"]
    assert "ragged_placement.regions" in graph["ragged_placement.transforms"]
    assert "ragged_placement.transforms" in graph["ragged_placement.redistribute"]


def test_every_package_is_in_the_wheel():
    """``pyproject.toml`` lists every package (setuptools' ``packages``): a package missing
    there imports in the editable install the tests use but not from a built wheel."""
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = {name: ROOT.parent / path for name, path in config["package-dir"].items()}
    on_disk = {_module_name(p.parent / "__init__.py") for p in ROOT.rglob("__init__.py")}
    on_disk |= {f"{name}.{p.parent.relative_to(path).as_posix().replace('/', '.')}".rstrip(".")
                for name, path in mapped.items() for p in path.rglob("__init__.py")}
    assert sorted(config["packages"]) == sorted(on_disk)


# The modules that define a unit's meshes (fully_shard builds one UnitMesh per unit): only they
# may ask which kind of mesh they hold.
_MESH_MODULES = {"ragged_placement.fsdp.mesh", "ragged_placement.fsdp.nested"}
_MESH_TYPES = {"UnitMesh", "DataParallelMesh", "StateShardedMesh"}


def _mesh_type_tests(tree: ast.Module) -> list[str]:
    """The ``isinstance`` / ``type(...) is`` tests against a unit-mesh type in ``tree``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
            named = {getattr(n, "id", getattr(n, "attr", None)) for n in ast.walk(node.args[1])}
            if named & _MESH_TYPES:
                found.append(ast.unparse(node))
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Call) and getattr(
            node.left.func, "id", None
        ) == "type":
            named = {getattr(n, "id", None) for c in node.comparators for n in ast.walk(c)}
            if named & _MESH_TYPES:
                found.append(ast.unparse(node))
    return found


def test_the_mesh_type_checker_finds_a_type_test():
    tree = ast.parse("isinstance(dp, StateShardedMesh)\ntype(m) is DataParallelMesh\n")
    assert _mesh_type_tests(tree) == [
        "isinstance(dp, StateShardedMesh)", "type(m) is DataParallelMesh",
    ]


def test_the_runtime_never_asks_which_kind_of_mesh_a_unit_holds():
    """The unit, its buffers, gradients and hooks call the unit's ``UnitMesh`` (and each
    buffer's ``BufferComm``); no module outside the meshes' own tests its type."""
    tests = {m: _mesh_type_tests(ast.parse(p.read_text())) for m, p in _sources().items()}
    assert {m: t for m, t in tests.items() if t and m not in _MESH_MODULES} == {}


# -- Feature branches: each feature plugs in where it is chosen, not throughout the runtime --------

_FEATURES = {
    # feature: (its configuration's names, the modules that are the feature's own)
    "fp8": (re.compile(r"fp8|quant|FP8", re.I), {"fp8"}),
    "offload": (re.compile(r"offload|pin_memory", re.I), {"offload"}),
    "state sharding": (re.compile(r"state_sharding|nested|StateSharded", re.I),
                       {"nested", "nested_refresh"}),
}
# At most this many branches on each feature outside its own modules (torch FSDP2's
# ``_fully_shard/`` has six feature branches in all). Per-state sharding: the unit runs its
# refresh before it unshards (a ``ParamRefresh`` hook only ``ChunkRefresh`` overrides), the buffer
# asks whether the parameters stay unsharded; the hooks' recomputed-forward checks read "nested".
_MAX_FEATURE_BRANCHES = {"fp8": 1, "offload": 3, "state sharding": 4}


def _is_default(fn: ast.AST) -> bool:
    """A function whose body (past its docstring) only returns a constant, passes or deletes
    its arguments: an interface's default, which a feature overrides."""
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    return all(isinstance(s, (ast.Pass, ast.Delete)) or (
        isinstance(s, ast.Return) and (s.value is None or isinstance(s.value, ast.Constant)))
        for s in body)


def _definitions(tree: ast.Module) -> dict[str, bool]:
    """Every name ``tree`` defines (functions, methods, properties, classes, declared and
    assigned ``self`` attributes), each with whether all its definitions are defaults (a hook's
    ``return False``, a ``self.x = None``)."""
    out: dict[str, bool] = {}

    def define(name: str, default: bool) -> None:
        out[name] = out.get(name, True) and default

    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            define(n.name, _is_default(n))
        elif isinstance(n, ast.ClassDef):
            define(n.name, False)
            for s in n.body:
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name):
                    define(s.target.id, False)  # a declared attribute: the class's state
        if isinstance(n, (ast.Assign, ast.AnnAssign)):
            for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                for e in ast.walk(t):
                    if isinstance(e, ast.Attribute) and getattr(e.value, "id", None) == "self":
                        define(e.attr, isinstance(n.value, ast.Constant))
    return out


def _reads(node: ast.AST, attrs: set[str], names: set[str]) -> set[str]:
    """The feature state ``node`` reads: attributes in ``attrs``, names in ``names``."""
    return ({e.attr for e in ast.walk(node) if isinstance(e, ast.Attribute)} & attrs) | (
        {e.id for e in ast.walk(node) if isinstance(e, ast.Name)} & names)


def _feature_state(feature: str) -> tuple[set[str], set[str]]:
    """What the code makes a feature's state, read from ``fsdp/``: the attributes, methods
    and properties its own modules define that no other module defines but as a default (the
    hooks only it overrides, e.g. a mesh's ``refreshes``), and those other modules set from its
    functions or classes (``self.kind = FP8Gathers(...)``); and its top-level
    functions and classes (``FP8UnitGather``)."""
    own = _FEATURES[feature][1]
    trees = {p.stem: ast.parse(p.read_text()) for p in (ROOT / "fsdp").glob("*.py")}
    elsewhere = {k for stem, t in trees.items() if stem not in own
                 for k, default in _definitions(t).items() if not default}
    attrs = {k for stem in own for k in _definitions(trees[stem]) if k not in elsewhere}
    names = {n.name for stem in own for n in trees[stem].body
             if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    for stem, t in trees.items():
        for n in ast.walk(t) if stem not in own else ():
            if isinstance(n, ast.Assign) and _reads(n.value, set(), names):
                attrs |= {e.attr for tg in n.targets for e in ast.walk(tg)
                          if isinstance(e, ast.Attribute) and getattr(e.value, "id", None) == "self"}
    return attrs - {"__init__"}, names


def _feature_branches(tree: ast.Module, feature: str,
                      state: tuple[set[str], set[str]] | None = None) -> list[str]:
    """Conditions (``if``, ``while``, conditional expressions and comprehension filters) that
    read the feature's state (:func:`_feature_state`, an ``isinstance`` test against its
    classes included) or its configuration, except argument checks (an ``if`` whose body only
    raises)."""
    pattern = _FEATURES[feature][0]
    attrs, names = _feature_state(feature) if state is None else state
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and all(isinstance(s, ast.Raise) for s in node.body):
            continue
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            tests = [node.test]
        elif isinstance(node, ast.comprehension):
            tests = node.ifs
        else:
            continue
        found += [ast.unparse(t) for t in tests
                  if _reads(t, attrs, names) or pattern.search(ast.unparse(t))]
    return found


def test_the_branch_counter_skips_argument_checks_and_sees_feature_state():
    tree = ast.parse(
        "if quant is not None:\n    raise ValueError(quant)\n"
        "if self.fp8 is not None:\n    x = 1\n"
        "y = a if offloaded else b\n"
        "if unit.dp.refreshes:\n    z = 2\n"
        "w = [g for g in gathers if isinstance(g, BlockGather)]\n"
    )
    none = (set(), set())
    assert _feature_branches(tree, "fp8", none) == ["self.fp8 is not None"]
    assert _feature_branches(tree, "offload", none) == ["offloaded"]
    assert _feature_branches(tree, "state sharding", ({"refreshes"}, set())) == [
        "unit.dp.refreshes"]
    assert _feature_branches(tree, "fp8", (set(), {"BlockGather"})) == [
        "self.fp8 is not None", "isinstance(g, BlockGather)"]


def test_the_feature_state_is_read_from_the_code():
    """A hook only per-state sharding overrides (``UnitMesh.keeps_params_unsharded`` and
    ``ParamRefresh.before_unshard`` return False) is its state; the FP8 gather's classes and
    the hook only they override (``PlainGathers.sends_chunk`` returns True) are FP8's; a
    generic attribute (the buffer's ``gather``) is no feature's."""
    attrs, _ = _feature_state("state sharding")
    assert {"refreshes", "keeps_params_unsharded", "before_unshard"} <= attrs
    attrs, names = _feature_state("fp8")
    assert {"FP8UnitGather", "FP8Gathers"} <= names and "sends_chunk" in attrs
    assert all("gather" not in _feature_state(f)[0] for f in _FEATURES)


@pytest.mark.parametrize("feature", sorted(_FEATURES))
def test_each_feature_branches_at_most_a_few_times_outside_its_module(feature):
    """FP8, CPU offload and per-state sharding are chosen once (the unit's gather, staging and
    ``UnitMesh``); the rest of ``fsdp/`` branches on each at most
    :data:`_MAX_FEATURE_BRANCHES` times, counting every condition that reads the feature's
    state or configuration."""
    own = _FEATURES[feature][1]
    state = _feature_state(feature)
    branches = {
        p.stem: b for p in sorted((ROOT / "fsdp").glob("*.py"))
        if p.stem not in own | {"_validation"}
        for b in [_feature_branches(ast.parse(p.read_text()), feature, state)] if b
    }
    assert sum(map(len, branches.values())) <= _MAX_FEATURE_BRANCHES[feature], branches


def test_one_registry_of_what_the_runtime_owns():
    """Which unit owns a parameter or a module is recorded in one place
    (``fsdp._validation.OWNERS``, which torch's ``fully_shard`` also asks through
    ``FSDP2Hooks.sharded_by``): no other module builds a weak-keyed registry."""
    weak = {"WeakKeyDictionary", "WeakIdKeyDictionary"}
    builders = {
        m: sorted({ast.unparse(n.func) for n in ast.walk(ast.parse(p.read_text()))
                   if isinstance(n, ast.Call)
                   and getattr(n.func, "attr", getattr(n.func, "id", None)) in weak})
        for m, p in _sources().items()
    }
    assert {m: b for m, b in builders.items() if b} == {
        "ragged_placement.fsdp._validation": ["WeakIdKeyDictionary", "weakref.WeakKeyDictionary"],
    }


# What parallelizes a module: torch's and our entry points, and the styles they apply.
_PARALLELIZING = {"parallelize_module", "fully_shard", "distribute_module", "shard_fn"}


def _parallelization(tree: ast.Module) -> list[str]:
    """What in ``tree`` parallelizes: calls of :data:`_PARALLELIZING`, ``ParallelStyle``
    subclasses and ``parallelize_*`` functions."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "id", getattr(node.func, "attr", None))
            if name in _PARALLELIZING:
                found.append(ast.unparse(node.func))
        elif isinstance(node, ast.ClassDef) and any(
                getattr(b, "id", getattr(b, "attr", None)) == "ParallelStyle" for b in node.bases):
            found.append(f"class {node.name}")
        elif isinstance(node, ast.FunctionDef) and node.name.startswith("parallelize"):
            found.append(f"def {node.name}")
    return found


def test_the_parallelization_finder_finds_calls_styles_and_recipes():
    tree = ast.parse("class S(ParallelStyle): pass\n"
                     "def parallelize_x(m):\n    tp.parallelize_module(m)\n    shard_fn(m)\n")
    assert _parallelization(tree) == ["class S", "def parallelize_x", "tp.parallelize_module",
                                      "shard_fn"]


def test_models_hold_models_and_parallelization_lives_with_the_runtime():
    """``ragged_placement.models`` defines models and data; how they are parallelized (expert
    and tensor parallelism, FSDP) is ``ragged_placement.parallelize``'s and
    ``expert_parallel``'s, which import nothing from ``models`` (``models`` re-exports the
    recipes beside their models)."""
    graph = _import_graph()
    found = {m: _parallelization(ast.parse(p.read_text())) for m, p in _sources().items()
             if m.startswith("ragged_placement.models")}
    assert {m: f for m, f in found.items() if f} == {}
    for home in ("ragged_placement.parallelize", "ragged_placement.expert_parallel"):
        assert not {t for t in graph[home] if t.startswith("ragged_placement.models")}, home


def test_the_trainer_injects_no_fault_and_uses_only_the_meters_of_testing():
    """The fault injection is the tests' (``tests/train/fault_injection.py``, through
    ``main(on_step=...)``): no module of the package reads its variable, and the trainer takes
    from ``ragged_placement.testing`` only the meters its log line reports."""
    graph = _import_graph()
    assert {t for t in graph["ragged_placement.train"] if t.startswith("ragged_placement.testing")
            } == {"ragged_placement.testing.profiling"}
    readers = [m for m, p in _sources().items() if "RAGGED_PLACEMENT_TRAIN_FAULT" in p.read_text()]
    assert readers == []


def test_no_test_file_imports_another():
    """Tests share models, data, references and helpers through ``tests/common/``,
    ``tests/common_fsdp.py`` and ``tests/dist_utils.py``, never by importing a test file."""
    tests = ROOT.parent / "tests"
    found = {}
    for path in tests.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            hits = [m for m in modules if m.split(".")[-1].startswith("test_")]
            if hits:
                found.setdefault(str(path.relative_to(tests)), []).extend(hits)
    assert found == {}


# -- Where fully_shard's feature arguments go ---------------------------------------------------

# argument: (the feature's modules, where it may end; modules that may also read it: the entry,
# the table of refused combinations, and the configuration's own class)
_FEATURE_ARGUMENTS = {
    "state_sharding": ({"ragged_placement.fsdp.nested"},
                       {"ragged_placement.fsdp.api", "ragged_placement.combinations",
                        "ragged_placement.planner.sharding"}),
    "quant": ({"ragged_placement.fsdp.fp8", "ragged_placement.quant"},
              {"ragged_placement.fsdp.api", "ragged_placement.combinations",
               "ragged_placement.quant.config"}),
}
_MAX_HOPS = 3

Paths = frozenset  # of tuples of attribute names: () is the value itself, ("quant",) x.quant


class _Flow:
    """Where one argument's value goes, read from the source: the calls it is passed to (by
    name, positionally or by keyword, or stored in an object of the package's classes and
    read back as that attribute), each a hop into the callee's module; the modules that read
    it (an attribute of it, a comparison, a truth test) besides passing it on. A call into one
    of ``ends`` (the feature's modules) ends a path: what comes back from it is the feature's
    own (a checked value passed through comes back as the value)."""

    def __init__(self, trees: dict[str, ast.Module], ends: set[str]) -> None:
        self.trees, self.ends = trees, ends
        self.defs: dict[tuple[str, str], ast.AST] = {}  # (module, name or Class.name) -> node
        self.names: dict[str, dict[str, tuple[str, str]]] = {}  # module: {name: (module, name)}
        for module, tree in trees.items():
            scope = self.names.setdefault(module, {})
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                    self.defs[module, node.name] = node
                    scope[node.name] = (module, node.name)
                    for sub in node.body if isinstance(node, ast.ClassDef) else ():
                        if isinstance(sub, ast.FunctionDef):
                            self.defs[module, f"{node.name}.{sub.name}"] = sub
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    for a in node.names:
                        scope.setdefault(a.asname or a.name, self._home(node.module, a.name))
        self.paths: set[tuple[str, ...]] = set()  # module sequences, one per path
        self.readers: set[str] = set()
        self._seen: dict[tuple, Paths] = {}
        self._returned: dict[int, Paths] = {}  # id(call) -> what it gives back of the value

    def _home(self, module: str, name: str) -> tuple[str, str]:
        """Where ``from module import name`` finds ``name`` (through re-exports)."""
        for _ in range(8):
            if (module, name) in self.defs or module not in self.names:
                return module, name
            nxt = self.names[module].get(name)
            if nxt is None or nxt == (module, name):
                return module, name
            module, name = nxt
        return module, name

    def ends_in_feature(self, module: str) -> bool:
        """Whether ``module`` is one of the feature's (or inside one of its packages)."""
        return any(module == e or module.startswith(e + ".") for e in self.ends)

    def run(self, module: str, function: str, argument: str) -> None:
        self._call(module, function, {argument: Paths({()})}, (module,))

    # -- one function ----------------------------------------------------------------------
    def _call(self, module: str, qual: str, given: dict[str, Paths], path: tuple[str, ...]
              ) -> Paths:
        """Trace ``qual`` of ``module`` with its parameters ``given``; what it returns of the
        value (for a class: what the new object holds)."""
        key = (module, qual, tuple(sorted(given.items())))
        if key in self._seen:
            return self._seen[key]
        self._seen[key] = Paths()
        node = self.defs[module, qual]
        if isinstance(node, ast.ClassDef):
            out = self._construct(module, node, given, path)
        else:
            out = self._function(module, qual, node, given, path)
        self._seen[key] = out
        return out

    def _construct(self, module: str, cls: ast.ClassDef, given: dict[str, Paths],
                   path: tuple[str, ...]) -> Paths:
        if (module, f"{cls.name}.__init__") in self.defs:
            env = self._trace(module, cls.name, self.defs[module, f"{cls.name}.__init__"],
                              given, path)
            return env.get("self", Paths())
        return Paths((name, *p) for name, ps in given.items() for p in ps)  # a dataclass

    def _function(self, module: str, qual: str, fn: ast.FunctionDef, given: dict[str, Paths],
                  path: tuple[str, ...]) -> Paths:
        cls = qual.split(".")[0] if "." in qual else None
        return self._trace(module, cls, fn, given, path)["<return>"]

    def _trace(self, module: str, cls: str | None, fn: ast.FunctionDef,
               given: dict[str, Paths], path: tuple[str, ...]) -> dict:
        env: dict[str, Paths] = dict(given)
        for _ in range(6):  # to a fixpoint over the assignments and what calls give back
            before = (dict(env), dict(self._returned))
            for node in ast.walk(fn):
                if isinstance(node, ast.Call):
                    self._hop(node, env, module, cls, path)
                self._assign(node, env)
            if (env, self._returned) == before:
                break
        env["<return>"] = Paths().union(*(self._value(n.value, env) for n in ast.walk(fn)
                                          if isinstance(n, ast.Return) and n.value is not None))
        for node in ast.walk(fn):
            self._read(node, env, module)
        return env

    def _assign(self, node: ast.AST, env: dict[str, Paths]) -> None:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            value = self._value(node.value, env)
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                self._bind(target, value, env)
        elif isinstance(node, (ast.For, ast.comprehension)):
            self._bind(node.target, self._value(node.iter, env), env)

    def _bind(self, target: ast.AST, value: Paths, env: dict[str, Paths]) -> None:
        if not value:
            return
        if isinstance(target, ast.Name):
            env[target.id] = env.get(target.id, Paths()) | value
        elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
            held = Paths((target.attr, *p) for p in value)
            env[target.value.id] = env.get(target.value.id, Paths()) | held
        elif isinstance(target, (ast.Tuple, ast.List)):
            for e in target.elts:
                self._bind(e, value, env)

    def _value(self, node: ast.AST, env: dict[str, Paths]) -> Paths:
        """What of the value ``node`` evaluates to (a call: what the callee gives back)."""
        if isinstance(node, ast.Name):
            return env.get(node.id, Paths())
        if isinstance(node, ast.Attribute):
            return Paths(p[1:] for p in self._value(node.value, env) if p and p[0] == node.attr)
        if isinstance(node, (ast.Subscript, ast.Starred)):
            return self._value(node.value, env)
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return Paths().union(*(self._value(e, env) for e in node.elts))
        if isinstance(node, ast.IfExp):
            return self._value(node.body, env) | self._value(node.orelse, env)
        if isinstance(node, ast.BoolOp):
            return Paths().union(*(self._value(v, env) for v in node.values))
        if isinstance(node, ast.Call):
            return self._returned.get(id(node), Paths())
        return Paths()

    def _read(self, node: ast.AST, env: dict[str, Paths], module: str) -> None:
        """Whether ``node`` looks at the value itself (not only passes it on)."""
        looked = []
        if isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Store):
            looked = [node.value]
        elif isinstance(node, ast.Compare):
            looked = [node.left, *node.comparators]
        elif isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
            looked = [node.test]
        elif isinstance(node, ast.BoolOp):
            looked = node.values
        elif isinstance(node, ast.UnaryOp):
            looked = [node.operand]
        elif isinstance(node, ast.JoinedStr):
            looked = [v.value for v in node.values if isinstance(v, ast.FormattedValue)]
        if any(() in self._value(n, env) for n in looked):
            self.readers.add(module)

    def _callee(self, func: ast.AST, module: str, cls: str | None) -> tuple[str, str] | None:
        scope = self.names[module]
        if isinstance(func, ast.Name) and func.id in scope:
            return scope[func.id]
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            owner = func.value.id
            if owner in ("self", "cls") and cls is not None:
                return module, f"{cls}.{func.attr}"
            if owner in scope:
                home, name = scope[owner]
                return home, f"{name}.{func.attr}"
        return None

    def _hop(self, call: ast.Call, env: dict[str, Paths], module: str, cls: str | None,
             path: tuple[str, ...]) -> None:
        func, args = call.func, list(call.args)
        if isinstance(func, ast.Name) and func.id == "partial" and args:
            func, args = args[0], args[1:]
        passed = [(i, self._value(a, env)) for i, a in enumerate(args)]
        passed += [(k.arg, self._value(k.value, env)) for k in call.keywords if k.arg]
        if isinstance(func, ast.Attribute):  # the receiver of a method call passes too
            passed.append(("self", self._value(func.value, env)))
        passed = [(where, ps) for where, ps in passed if ps]
        if not passed:
            return
        target = self._callee(func, module, cls)
        if target is None or target not in self.defs:
            return  # not the package's code (torch's, a builtin, a method of the value)
        home, qual = target
        hop = (*path, home)
        if self.ends_in_feature(home):
            self.paths.add(hop)
            self._returned[id(call)] = Paths(
                p for where, ps in passed for p in ps if self._passes_through(home, qual, where))
            return
        self.paths.add(hop)
        given = self._parameters(self.defs[target], passed, qual)
        self._returned[id(call)] = self._call(home, qual, given, hop)

    def _passes_through(self, module: str, qual: str, where) -> bool:
        """Whether the feature's function ``qual`` returns its argument ``where`` itself (a
        checked value)."""
        fn = self.defs[module, qual]
        if not isinstance(fn, ast.FunctionDef):
            return False
        params = [a.arg for a in fn.args.args]
        name = params[where] if isinstance(where, int) and where < len(params) else where
        return any(isinstance(n, ast.Return) and isinstance(n.value, ast.Name)
                   and n.value.id == name for n in ast.walk(fn))

    def _parameters(self, node: ast.AST, passed, qual: str) -> dict[str, Paths]:
        if isinstance(node, ast.ClassDef):
            init = next((s for s in node.body
                         if isinstance(s, ast.FunctionDef) and s.name == "__init__"), None)
            if init is not None:
                names = [a.arg for a in init.args.args][1:]
            else:  # a dataclass: its fields in order
                names = [s.target.id for s in node.body
                         if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
        else:
            names = [a.arg for a in node.args.args]
            if names and names[0] in ("self", "cls") and "." in qual:
                names = names[1:]
            names += [a.arg for a in node.args.kwonlyargs]
        out: dict[str, Paths] = {}
        for where, ps in passed:
            name = names[where] if isinstance(where, int) and where < len(names) else where
            if isinstance(name, str):
                out[name] = out.get(name, Paths()) | ps
        return out


def _flow(argument: str) -> _Flow:
    """Where ``fully_shard``'s ``argument`` goes (see :class:`_Flow`)."""
    trees = {m: ast.parse(p.read_text()) for m, p in _sources().items()}
    flow = _Flow(trees, _FEATURE_ARGUMENTS[argument][0])
    flow.run("ragged_placement.fsdp.api", "fully_shard", argument)
    return flow


def _hops(path: tuple[str, ...]) -> int:
    """The hops between modules on ``path`` (calls inside one module are not hops)."""
    return sum(a != b for a, b in zip(path, path[1:]))


def _comes_back(path: tuple[str, ...]) -> bool:
    """Whether ``path`` leaves a module and enters it again."""
    runs = [m for i, m in enumerate(path) if i == 0 or path[i - 1] != m]
    return len(runs) != len(set(runs))


def test_the_flow_tracer_follows_calls_fields_and_checked_values():
    """A value checked by the feature's module and passed on, stored in a dataclass and read
    back in another module, is traced there; a read outside the feature's modules is seen."""
    trees = {
        "pkg.api": ast.parse(
            "from pkg.feature import check\nfrom pkg.opts import Options\n"
            "from pkg.unit import Unit\n"
            "def entry(x):\n    y = check(x)\n    o = Options(1, y)\n    Unit(o)\n"),
        "pkg.feature": ast.parse("def check(v):\n    return v\ndef build(v):\n    return 1\n"),
        "pkg.opts": ast.parse("class Options:\n    a: int\n    x: object\n"),
        "pkg.unit": ast.parse(
            "from pkg.feature import build\n"
            "class Unit:\n    def __init__(self, o):\n        if o.x is not None:\n"
            "            build(o.x)\n"),
    }
    flow = _Flow(trees, {"pkg.feature"})
    flow.run("pkg.api", "entry", "x")
    assert sorted(flow.paths) == [
        ("pkg.api", "pkg.feature"), ("pkg.api", "pkg.opts"), ("pkg.api", "pkg.unit"),
        ("pkg.api", "pkg.unit", "pkg.feature")]
    assert flow.readers == {"pkg.unit"}
    assert _hops(("a", "a", "b", "c")) == 2 and _comes_back(("a", "b", "a"))


@pytest.mark.parametrize("argument", sorted(_FEATURE_ARGUMENTS))
def test_fully_shard_hands_each_feature_argument_to_its_module_in_a_few_hops(argument):
    """``fully_shard``'s ``state_sharding`` and ``quant`` reach their feature's module
    (``fsdp/nested.py``; ``fsdp/fp8.py`` and ``quant/``) in at most :data:`_MAX_HOPS` hops
    between modules, on every path the value takes, without coming back to a module it left;
    no module but those, the entry and the table of refused combinations looks at it (the rest
    of the runtime gets what the feature's module builds from it)."""
    ends, readers = _FEATURE_ARGUMENTS[argument]
    flow = _flow(argument)
    paths = sorted(flow.paths)
    assert any(flow.ends_in_feature(p[-1]) for p in paths), paths
    assert [p for p in paths if _hops(p) > _MAX_HOPS or _comes_back(p)] == []
    assert sorted(m for m in flow.readers if not flow.ends_in_feature(m) and m not in readers
                  ) == [], paths
