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
     "rltrainer.pipelines", "rltrainer.interrupt", "rltrainer.deprecated", "rltrainer.export", "rltrainer.trainer",
     "rltrainer.own_loop"),
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


if __name__ == "__main__":
    print(report())
