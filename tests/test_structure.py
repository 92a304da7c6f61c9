"""The package's structure, measured from its import statements, held where issue 33 left it.

Run ``python tests/test_structure.py`` for the figures and the offending imports; the tests fail
when a change makes one of them worse:

- **import cycles**: strongly connected groups of modules in the graph of every import of one of
  our modules (``TYPE_CHECKING`` ones included: they still couple the files). At most one, and it
  must be type-only (the Trainer <-> what it hands itself to, as Lightning's Trainer <-> callbacks).
- **upward imports**: a module importing one from a higher layer of :data:`LAYERS` (a strategy
  importing the Trainer, a weight transport importing a strategy). Type-only imports do not count.
- **function-level imports** of our own modules (an ``import`` inside a function body): each hides
  a dependency from the reader of the file's header.
- **size**: ``trainer.py`` under 400 lines; no ``__init__`` over 20 parameters.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rltrainer"

#: From the bottom up: a module may import from its own layer and the ones below. The first
#: matching prefix names a module's layer.
LAYERS: list[tuple[str, ...]] = [
    # 0: plumbing that knows nothing of RL
    ("rltrainer.files", "rltrainer.registry", "rltrainer.values", "rltrainer.weights", "rltrainer.controller",
     "rltrainer.allocator", "rltrainer.optim", "rltrainer.schedulers", "rltrainer.process_groups"),
    # 1: the batch, the data, the checkpoint format
    ("rltrainer.data", "rltrainer.packing", "rltrainer.contracts", "rltrainer.lora", "rltrainer.checkpoints",
     "rltrainer.training_checkpoint", "rltrainer.hf_export"),
    # 2: models and the maths of algorithms
    ("rltrainer.models", "rltrainer.lm_head", "rltrainer.algorithms", "rltrainer.rewards"),
    # 3: the hooks users write against, and the compute behind them (an engine's host process included)
    ("rltrainer.module", "rltrainer.call", "rltrainer.modules", "rltrainer.strategies", "rltrainer.rollout",
     "rltrainer.envs", "rltrainer.plan"),
    # 4: the loop and what drives it
    ("rltrainer.callbacks", "rltrainer.generations", "rltrainer.loggers", "rltrainer.csv_logger",
     "rltrainer.tensorboard_logger", "rltrainer.loop",
     "rltrainer.pipelines", "rltrainer.interrupt", "rltrainer.export", "rltrainer.trainer", "rltrainer.own_loop"),
    # 5: entry points and helpers for tests
    ("rltrainer.cli", "rltrainer.plot", "rltrainer.testing", "rltrainer.toy", "rltrainer.__main__", "rltrainer"),
]

#: Where issue 33 left the package (the issue's limits: 1 cycle, 2 upward imports, 10 function-level imports).
MAX_CYCLES, MAX_UPWARD, MAX_FUNCTION_LEVEL = 1, 2, 10
MAX_TRAINER_LINES, MAX_INIT_PARAMETERS = 400, 20


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module of ours
    line: int
    type_only: bool  # under ``if TYPE_CHECKING:``
    function_level: bool  # inside a function body


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The module of ours ``name`` is (or is in): ``rltrainer.a.b.Class`` -> ``rltrainer.a.b``."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(name: str, path: Path, known: dict[str, Path]) -> Iterator[Import]:
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def visit(node: ast.AST, type_only: bool, in_function: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.body:
                    yield from visit_one(sub, True, in_function)
                for sub in child.orelse:
                    yield from visit_one(sub, type_only, in_function)
                continue
            yield from visit_one(child, type_only, in_function)

    def visit_one(node: ast.AST, type_only: bool, in_function: bool) -> Iterator[Import]:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("rltrainer"):
                    target = _resolve(alias.name, known)
                    if target:
                        yield Import(name, target, node.lineno, type_only, in_function)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.startswith("rltrainer"):
                for alias in node.names:  # ``from rltrainer.x import submodule`` imports the submodule
                    target = _resolve(f"{base}.{alias.name}", known) if f"{base}.{alias.name}" in known \
                        else _resolve(base, known)
                    if target:
                        yield Import(name, target, node.lineno, type_only, in_function)
        else:
            function = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from visit(node, type_only, function)

    yield from visit(tree, False, False)


def all_imports() -> list[Import]:
    """Every import of one of our modules by another, once per statement and target."""
    known = modules()
    found = [imp for name, path in known.items() for imp in imports_of(name, path, known) if imp.target != name]
    return list(dict.fromkeys(found))


def layer(name: str) -> int:
    best, best_len = len(LAYERS), -1
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    return best


def cycles(imports: list[Import]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm)."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        graph.setdefault(imp.source, set()).add(imp.target)
        graph.setdefault(imp.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def cycle_is_type_only(group: list[str], imports: list[Import]) -> bool:
    """Whether the group falls apart (no cycle left) once type-only imports are dropped."""
    members = set(group)
    runtime = [imp for imp in imports if imp.source in members and imp.target in members and not imp.type_only]
    return not cycles(runtime)


def upward(imports: list[Import]) -> list[Import]:
    return [imp for imp in imports if not imp.type_only and layer(imp.target) > layer(imp.source)]


def function_level(imports: list[Import]) -> list[Import]:
    return [imp for imp in imports if imp.function_level]


def large_inits() -> list[tuple[str, int, int]]:
    """``(module.Class, line, parameters)`` for every ``__init__`` over the limit."""
    out = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                        a = item.args
                        count = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) - 1  # not self
                        if count > MAX_INIT_PARAMETERS:
                            out.append((f"{name}.{node.name}", item.lineno, count))
    return out


def report() -> str:
    imports = all_imports()
    groups = cycles(imports)
    lines = [f"import cycles: {len(groups)}"]
    for g in groups:
        lines.append(f"  {'type-only' if cycle_is_type_only(g, imports) else 'RUNTIME'}: {', '.join(g)}")
    up = upward(imports)
    lines.append(f"upward imports: {len(up)}")
    lines += [f"  {i.source}:{i.line} -> {i.target} (layer {layer(i.source)} -> {layer(i.target)})" for i in up]
    fl = function_level(imports)
    lines.append(f"function-level imports of our modules: {len(fl)}")
    lines += [f"  {i.source}:{i.line} -> {i.target}" for i in fl]
    lines.append(f"trainer.py lines: {len((PACKAGE / 'trainer.py').read_text().splitlines())}")
    inits = large_inits()
    lines.append(f"__init__ over {MAX_INIT_PARAMETERS} parameters: {len(inits)}")
    lines += [f"  {n}:{ln} ({c})" for n, ln, c in inits]
    return "\n".join(lines)


# --- issue 45 point 5: tests shaped like the package ---
TESTS = Path(__file__).resolve().parent
#: Test folders that are not a package of rltrainer: the recipes' and notebooks' tests (folders of the
#: repository beside the package) and the benchmark scripts.
TEST_FOLDERS_BESIDE_THE_PACKAGE = {"benchmarks", "notebooks", "recipes"}


def packages() -> list[str]:
    """The subpackages of rltrainer: its folders with an ``__init__.py``."""
    return sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))


def folders_of_tests() -> list[str]:
    """The folders under tests/ holding Python files (a folder left with only ``__pycache__`` is none)."""
    return sorted(d.name for d in TESTS.iterdir()
                  if d.is_dir() and any("__pycache__" not in f.parts for f in d.rglob("*.py")))


def test_every_package_has_its_test_folder() -> None:
    missing = [f"tests/{name}" for name in packages() if name not in folders_of_tests()]
    assert not missing, f"rltrainer/<pkg> is tested in tests/<pkg>; missing: {missing}"
    assert all(list((TESTS / name).glob("test_*.py")) for name in packages()), \
        [f"tests/{name}" for name in packages() if not list((TESTS / name).glob("test_*.py"))]


def test_every_test_folder_is_a_package_and_there_is_no_grab_bag() -> None:
    """A test of a top-level module (``rltrainer/trainer.py``) is ``tests/test_trainer*.py``; every folder
    under tests/ is a package's (or one of the few beside it), so there is no ``tests/core``."""
    assert "core" not in folders_of_tests()
    strays = [f"tests/{name}" for name in folders_of_tests()
              if name not in packages() and name not in TEST_FOLDERS_BESIDE_THE_PACKAGE]
    assert not strays, f"test folders that name no rltrainer package: {strays} (packages: {packages()})"


# -- the tests ----------------------------------------------------------------------------------------
def test_every_module_has_a_layer() -> None:
    unplaced = [name for name in modules() if layer(name) == len(LAYERS)]
    assert not unplaced, f"Add these modules to a layer of LAYERS: {unplaced}"


def test_at_most_one_import_cycle_and_it_is_type_only() -> None:
    imports = all_imports()
    groups = cycles(imports)
    assert len(groups) <= MAX_CYCLES, f"{len(groups)} import cycles (at most {MAX_CYCLES}):\n{report()}"
    assert all(cycle_is_type_only(g, imports) for g in groups), report()


def test_imports_run_downward() -> None:
    up = upward(all_imports())
    assert len(up) <= MAX_UPWARD, f"{len(up)} upward imports (at most {MAX_UPWARD}):\n{report()}"


def test_few_function_level_imports_of_our_modules() -> None:
    fl = function_level(all_imports())
    assert len(fl) <= MAX_FUNCTION_LEVEL, \
        f"{len(fl)} function-level imports of our modules (at most {MAX_FUNCTION_LEVEL}):\n{report()}"


def test_the_trainer_stays_small() -> None:
    lines = len((PACKAGE / "trainer.py").read_text().splitlines())
    assert lines < MAX_TRAINER_LINES, f"trainer.py has {lines} lines (under {MAX_TRAINER_LINES})"
    assert not large_inits(), report()


def test_the_scan_sees_the_kinds_of_import(tmp_path: Path) -> None:
    """The scanner itself: relative, submodule, type-only and function-level imports are found."""
    known = modules()
    source = PACKAGE / "loop.py"
    found = list(imports_of("rltrainer.loop", source, known))
    assert any(i.target == "rltrainer.data.batch" and not i.function_level for i in found)
    fake = tmp_path / "m.py"
    fake.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rltrainer.trainer import Trainer\n"
                    "def f():\n    from rltrainer import loop\n    import rltrainer.data.batch\n")
    got = list(imports_of("rltrainer.fake", fake, known))
    assert [(i.target, i.type_only, i.function_level) for i in got] == [
        ("rltrainer.trainer", True, False), ("rltrainer.loop", False, True), ("rltrainer.data.batch", False, True)]
    assert cycles([Import("a", "b", 1, False, False), Import("b", "a", 1, True, False)]) == [["a", "b"]]


# --- issue 45 points 3-4: the step alone, no past ---
def test_no_deprecation_shims() -> None:
    """A 0.1.0 carries no past: no shim module, no old import path, no DeprecationWarning issued."""
    assert not (PACKAGE / "deprecated.py").exists() and not (PACKAGE / "strategies" / "distributed.py").exists()
    warning = [f"{path.relative_to(PACKAGE)}:{i}" for path in sorted(PACKAGE.rglob("*.py"))
               for i, line in enumerate(path.read_text().splitlines(), 1) if "DeprecationWarning" in line]
    assert not warning, warning


#: Goal of issue 45: step values travel as typed batch fields, not string keys in ``meta``.
MAX_META_KEY_SITES = 5


def meta_key_sites(package: Path = PACKAGE) -> list[str]:
    """Where the package reads or writes ``meta`` by a string key: ``x.meta["k"]`` (or a local
    ``meta["k"]``), ``x.meta.get/pop/setdefault("k", ...)``, ``x.meta.update(k=...)``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            meta = None
            if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and \
                    isinstance(node.slice.value, str):
                meta = node.value
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                keyed = node.func.attr in ("get", "pop", "setdefault") and node.args and \
                    isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
                if keyed or (node.func.attr == "update" and node.keywords):
                    meta = node.func.value
            if (isinstance(meta, ast.Attribute) and meta.attr == "meta") or (isinstance(meta, ast.Name) and
                                                                           meta.id == "meta"):
                found.append(f"{path.relative_to(package)}:{node.lineno}")
    return found


def trainer_uses_outside_the_property() -> list[int]:
    """Lines of ``module.py`` that reach the Trainer (``_trainer``, ``_attached.trainer``) outside
    the read-only ``RLModule.trainer`` property."""
    source = (PACKAGE / "module.py").read_text()
    tree = ast.parse(source)
    prop = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "trainer")
    inside = set(range(prop.lineno, prop.end_lineno + 1))
    return [i for i, line in enumerate(source.splitlines(), 1)
            if ("_trainer" in line or "_attached.trainer" in line) and i not in inside]


def test_the_step_reads_typed_fields_and_the_module_no_trainer() -> None:
    sites = meta_key_sites()
    assert len(sites) <= MAX_META_KEY_SITES, f"{len(sites)} meta string-key sites (at most {MAX_META_KEY_SITES}): " \
        f"{sites}"
    assert not trainer_uses_outside_the_property(), trainer_uses_outside_the_property()


def test_the_meta_scan_sees_each_spelling(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("b.meta['a'] = 1\nb.meta.get('a')\nmeta = b.meta\nmeta['c']\n"
                                   "b.meta.update(d=1)\nb.meta.update(o.meta)\nb.logged['e']\n")
    assert meta_key_sites(tmp_path) == ["m.py:1", "m.py:2", "m.py:4", "m.py:5"]


def test_a_deprecation_warning_from_rltrainer_fails_the_test() -> None:
    """setup.cfg's filterwarnings: one issued from an rltrainer module raises (and fails its test);
    a third-party one stays ignored."""
    import warnings

    import pytest

    with pytest.raises(DeprecationWarning, match="an old spelling"):
        warnings.warn_explicit("an old spelling", DeprecationWarning, str(PACKAGE / "trainer.py"), 1,
                               module="rltrainer.trainer")
    with pytest.raises(DeprecationWarning, match="from a function"):
        exec(compile("import warnings\nwarnings.warn('from a function', DeprecationWarning)",
                     str(PACKAGE / "loop.py"), "exec"), {"__name__": "rltrainer.loop"})
    warnings.warn_explicit("a library's own", DeprecationWarning, "torch/x.py", 1, module="torch.x")  # no raise


# --- issue 45 point 2: algorithms as parts ---
def presets() -> list[type]:
    """PolicyGradient and every preset of it in rltrainer.modules (GRPO, DAPO, PPO, DrGRPO...)."""
    from rltrainer.modules import PolicyGradient

    found, todo = [PolicyGradient], [PolicyGradient]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("rltrainer.modules.") and sub not in found:
                found.append(sub)
                todo.append(sub)
    return found


def test_presets_are_parts_plus_defaults_and_override_no_hook() -> None:
    """A preset declares its parts and defaults (``PARTS``, ``preset``): no hook, no ``__init__``."""
    from rltrainer.module import RLModule

    hooks = {name for name, value in vars(RLModule).items() if callable(value) and not name.startswith("_")}
    assert {"rollout_step", "reward_step", "advantage_step", "policy_step", "compute_step"} <= hooks
    found = presets()
    assert {cls.__name__ for cls in found} >= {"PolicyGradient", "GRPO", "DAPO", "PPO", "DrGRPO", "GSPO", "CISPO"}
    for cls in found[1:]:
        overridden = sorted(hooks & set(vars(cls)))
        assert not overridden, f"{cls.__name__} overrides the hooks {overridden}: make them parts"
        assert "__init__" not in vars(cls), f"{cls.__name__} has its own __init__: declare PARTS and preset instead"


def test_every_presets_signature_is_within_the_parameter_limit() -> None:
    """What ``inspect.signature`` gives is what ``help()`` shows and what is counted (``**settings``
    included): at most MAX_INIT_PARAMETERS."""
    import inspect

    for cls in presets():
        count = len(inspect.signature(cls).parameters)
        assert count <= MAX_INIT_PARAMETERS, f"{cls.__name__} has {count} parameters (at most {MAX_INIT_PARAMETERS})"


def _functions_named(name: str) -> list[str]:
    return [f"{module}:{node.lineno}" for module, path in modules().items()
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef) and node.name == name]


def test_no_signature_is_synthesised_and_settings_of_is_one() -> None:
    assigned = [f"{module}:{node.lineno}" for module, path in modules().items()
                for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Attribute)
                and node.attr == "__signature__" and isinstance(node.ctx, ast.Store)]
    assert not assigned, f"signatures set by hand (write the __init__ out instead): {assigned}"
    synthesised = [where for where in _functions_named("__init_subclass__") if ".modules" in where]
    assert not synthesised, f"__init_subclass__ in the algorithms: {synthesised}"
    assert len(_functions_named("settings_of")) == 1, _functions_named("settings_of")
# --- issue 45 point 1: Strategy and Rollout ---
#: The Strategy computes (model, optimizer, forward/backward, checkpoint I/O); the Rollout places engines.
MAX_STRATEGY_MEMBERS, MAX_CONNECT_LINES = 15, 25
#: The one verb per move of weights: a Rollout connects, its WeightSync pushes and waits.
SYNC_VERBS = {"connect", "push", "wait"}
RETIRED_SYNC_VERBS = {"connect_engine", "sync_weights", "start_weight_sync", "transport_for", "_sync_of", "sync"}


def strategy_members() -> list[str]:
    """What ``Strategy`` defines itself: methods, properties, class attributes (dunders and ``abc``'s
    bookkeeping aside)."""
    from rltrainer.strategies.strategy import Strategy

    return [n for n in vars(Strategy) if not (n.startswith("__") and n.endswith("__")) and n != "_abc_impl"]


def functions() -> Iterator[tuple[str, ast.FunctionDef]]:
    """``(module, def)`` for every function and method of the package."""
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield name, node


def test_the_strategy_computes_and_places_no_engine() -> None:
    members = strategy_members()
    assert len(members) <= MAX_STRATEGY_MEMBERS, f"Strategy has {len(members)} members: {members}"
    assert not {"connect", "policy_version", "weight_versions", "weight_sync"} & set(members), members


def test_connecting_an_engine_fits_on_a_screen() -> None:
    """``Rollout.connect`` and the steps it takes (``_connect_*``) are at most 25 lines each, and
    no strategy connects an engine any more."""
    too_long = [f"{m}.{f.name}: {f.end_lineno - f.lineno + 1} lines" for m, f in functions()
                if "connect" in f.name and m == "rltrainer.rollout.rollout"
                and f.end_lineno - f.lineno + 1 > MAX_CONNECT_LINES]
    assert not too_long, too_long
    assert any(m == "rltrainer.rollout.rollout" and f.name == "connect" for m, f in functions())


def test_no_strategy_argument_reaches_the_user_through_kwargs() -> None:
    """Each strategy's constructor shows every argument it takes (documented on its class)."""
    import inspect

    from rltrainer.strategies import STRATEGIES, FSDP2Strategy, MegatronStrategy, SingleDeviceStrategy
    from rltrainer.strategies.strategy import Strategy

    registered = {STRATEGIES._lookup(name)[0] for name in STRATEGIES}  # presets build these classes
    classes = {FSDP2Strategy, MegatronStrategy, SingleDeviceStrategy, *(c for c in registered if isinstance(c, type))}
    for cls in classes:
        for klass in (k for k in cls.__mro__ if isinstance(k, type) and issubclass(k, Strategy)):
            kinds = [p.kind for p in inspect.signature(klass.__init__).parameters.values()]
            assert inspect.Parameter.VAR_KEYWORD not in kinds, f"{klass.__name__}.__init__ takes **kwargs"
    for name in ("rollout_placement", "rollout_replicas", "weight_transport", "weight_sync_timeout_s",
                 "weight_sync_delta", "bucket_bytes"):
        assert name not in inspect.signature(FSDP2Strategy).parameters, f"{name} is a Rollout argument"


def test_weights_move_by_three_verbs() -> None:
    """A Rollout connects; its WeightSync pushes and waits (``close`` ends it). The retired verbs
    are defined nowhere in the package."""
    import inspect

    from rltrainer.rollout.rollout import Rollout
    from rltrainer.weights.sync import WeightSync

    public = {n for n in vars(WeightSync) if not n.startswith("_") and callable(getattr(WeightSync, n))}
    assert public == {"push", "wait", "close"}, public
    assert "connect" in vars(Rollout) and SYNC_VERBS <= {"connect", *public}
    from rltrainer.pipelines.modes import SYNC_PUSH_MODES, SyncPipeline
    from rltrainer.weights.sync import PUSH_MODES

    assert list(inspect.signature(SyncPipeline).parameters) == ["push_mode"]  # one spelling of a push's mode
    assert set(SYNC_PUSH_MODES) <= set(PUSH_MODES)
    retired = [f"{m}.{f.name}" for m, f in functions() if f.name in RETIRED_SYNC_VERBS]
    assert not retired, retired


def test_one_docstring_claims_to_write_the_engines_version() -> None:
    claims = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = " ".join((ast.get_docstring(node) or "").split())
                if "one writer" in doc and "weight_version" in doc:
                    claims.append(f"{name}:{getattr(node, 'name', '')}")
    assert len(claims) == 1, claims


if __name__ == "__main__":
    print(report())
