"""Every snippet in the README and in the documentation site's pages (``.ci/docs/pages``) runs as
written (issue 18, item 2; the pages since issue 31, item 8, took over most of the README's text).

- Every ``python`` block compiles. A block with an ``import`` is a complete program: every name
  it uses is defined in it (the README's first example once used a ``tokenizer`` it never made)
  and its imports resolve. A block without one is a fragment of the prose around it: the classes
  it names must exist in the package.
- Blocks marked ``<!-- runs in tests/test_readme.py -->`` (the CPU-sized ones) are executed from
  the repository root.
- In ``bash`` blocks, each ``python recipes/X.py ...`` command's flags are parsed by the recipe's own
  ``parse_args``, each ``python tests/...`` script exists, and each ``pip install -e ".[extra]"``
  names an extra of ``setup.cfg``. (The recipes themselves run, shortened, in ``tests/recipes/``.)
"""

from __future__ import annotations

import ast
import builtins
import configparser
import gc
import importlib
import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch.distributed

from rltrainer.registry import Registry

ROOT = Path(__file__).resolve().parents[1]
#: The README, then every page of the site (a page added later is checked without editing this test).
DOCS = [ROOT / "README.md", *sorted((ROOT / ".ci" / "docs" / "pages").rglob("*.md"))]
RUN_MARK = "<!-- runs in tests/test_readme.py -->"
BLOCK = re.compile(r"(?P<mark><!--[^\n]*-->\n)?```(?P<lang>[\w-]*)\n(?P<code>.*?)^```", re.S | re.M)
#: Where a fragment's class names may come from (the names the README's prose has introduced).
PACKAGES = ("rltrainer", "rltrainer.strategies", "rltrainer.algorithms", "rltrainer.rewards", "rltrainer.data")


def blocks(lang: str, docs: list[Path] = DOCS) -> list[tuple[str, str, bool]]:
    """``(where, code, marked to run)`` for every fenced block of ``lang`` in ``docs``; ``where`` is
    ``path:line`` (the path from the repository root)."""
    out = []
    for path in docs:
        text = path.read_text()
        out += [(f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start('code')) + 1}", m["code"],
                 (m["mark"] or "").strip() == RUN_MARK) for m in BLOCK.finditer(text) if m["lang"] == lang]
    return out


PYTHON = blocks("python")
BASH = blocks("bash")
README_PYTHON = blocks("python", DOCS[:1])
README_BASH = blocks("bash", DOCS[:1])


def names(tree: ast.AST) -> tuple[set[str], set[str]]:
    """``(used, bound)``: the names a block reads, and those it binds anywhere (assignments,
    imports, definitions, arguments, loop and comprehension variables)."""
    used, bound = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (used if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return used, bound


def is_complete(tree: ast.AST) -> bool:
    return any(isinstance(node, (ast.Import, ast.ImportFrom)) for node in ast.walk(tree))


def ids(items: list[tuple[str, str, bool]]) -> list[str]:
    return [where for where, *_ in items]


def test_the_readme_has_snippets_to_run():
    assert README_PYTHON and README_BASH and any(run for *_, run in README_PYTHON)
    assert len(DOCS) > 10, f"the site's pages are missing: {DOCS}"


@pytest.mark.parametrize("where, code, run", PYTHON, ids=ids(PYTHON))
def test_python_snippet_is_sound(where, code, run):
    tree = ast.parse(code, filename=where)
    used, bound = names(tree)
    undefined = used - bound - set(dir(builtins))
    if is_complete(tree):
        assert not undefined, f"the snippet at {where} uses names it never defines: {sorted(undefined)}"
        for node in ast.walk(tree):  # its imports resolve (imports only: nothing is built or downloaded)
            if isinstance(node, ast.ImportFrom):
                module = importlib.import_module(node.module)
                missing = [a.name for a in node.names if not hasattr(module, a.name)
                           and importlib.util.find_spec(f"{node.module}.{a.name}") is None]  # or a submodule
                assert not missing, f"{where}: {node.module} has no {missing}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    importlib.import_module(alias.name)
    else:
        exported = {name for package in PACKAGES for name in dir(importlib.import_module(package))}
        unknown = {name for name in undefined if name[0].isupper()} - exported
        assert not unknown, f"the fragment at {where} names classes the package lacks: {sorted(unknown)}"


@pytest.mark.parametrize("where, code, run", [b for b in PYTHON if b[2]], ids=ids([b for b in PYTHON if b[2]]))
def test_cpu_snippet_runs(where, code, run, monkeypatch):
    monkeypatch.chdir(ROOT)  # the snippets use repository paths (recipes/data/...)
    name = "readme_" + re.sub(r"\W", "_", where)
    registries = [r for r in gc.get_objects() if isinstance(r, Registry)]
    kept = [(r, dict(r._entries), dict(r._descriptions)) for r in registries]
    grouped = torch.distributed.is_initialized()
    try:
        exec(compile(code, where, "exec"), {"__name__": name})
    finally:  # what a snippet registers (a user's loss, say) or starts (a process group) is the snippet's
        for registry, entries, descriptions in kept:
            registry._entries, registry._descriptions = entries, descriptions
        if not grouped and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def commands() -> list[tuple[str, list[str]]]:
    """Every command of the bash blocks (``(path:line, words)``), split at ``&&``, comments dropped."""
    out = []
    for where, code, _ in BASH:
        path, line = where.rsplit(":", 1)
        logical: list[tuple[int, str]] = []  # lines continued with a trailing backslash joined
        for offset, text in enumerate(code.splitlines()):
            if logical and logical[-1][1].endswith("\\"):
                logical[-1] = (logical[-1][0], logical[-1][1][:-1] + " " + text)
            else:
                logical.append((offset, text))
        for offset, text in logical:
            words = shlex.split(text, comments=True)
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                out.append((f"{path}:{int(line) + offset}", words[:cut]))
                words = words[cut + 1:]
    return out


def load_recipe(path: Path):
    spec = importlib.util.spec_from_file_location(f"readme_recipe_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up by name
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name, None)
    return module


def test_bash_commands_name_what_exists():
    extras = configparser.ConfigParser()
    extras.read(ROOT / "setup.cfg")
    known_extras = set(extras["options.extras_require"])
    checked = 0
    for place, words in commands():
        where = f"{place}: {' '.join(words)}"
        if words[:1] == ["python"] and len(words) > 1 and words[1].endswith(".py") and "/" in words[1]:
            script = ROOT / words[1]  # a bare name (``python train.py``) is the user's own script
            assert script.is_file(), f"{where}: no such script"
            if script.parent.name == "recipes":
                load_recipe(script).parse_args(words[2:])  # argparse exits (SystemExit) on a bad flag
            checked += 1
        elif words[:2] == ["pip", "install"]:
            for word in words[2:]:
                extra = re.fullmatch(r"\.\[(.+)\]", word)
                if extra:
                    unknown = set(extra[1].split(",")) - known_extras
                    assert not unknown, f"{where}: setup.cfg has no extra {sorted(unknown)}"
            checked += 1
    assert checked >= 5


def test_ci_runs_the_readme_test_command():
    lines = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    ci = next((line for line in lines if "pytest" in line and not line.startswith("#")), None)
    assert ci is not None, f".ci/run runs no pytest command: {lines}"
    assert any(ci == code.strip() for _, code, _ in README_BASH), f".ci/run's command is not in the README: {ci}"


def requirements(extras: set[str]) -> set[str]:
    """The distributions ``pip install -e ".[extras]"`` asks for: ``install_requires`` and those extras'."""
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    lines = setup["options"]["install_requires"].splitlines()
    lines += [line for extra in extras for line in setup["options.extras_require"][extra].splitlines()]
    return {re.split(r"[<>=!~;\[ #]", line.strip(), maxsplit=1)[0].lower().replace("_", "-")
            for line in lines if line.strip() and not line.strip().startswith("#")}


def test_the_readme_install_gives_the_command_line():
    """Issue 44, item 9: the README's first command installs ``.[plot]``; the ``rltrainer`` console
    script must work after it, so every package rltrainer/cli.py imports (its parser, jsonargparse,
    imported lazily) is a requirement of that install."""
    import importlib.metadata

    (install,) = [w for _, words in commands() for w in words if re.fullmatch(r"\.\[(.+)\]", w)][:1]
    installed = requirements(set(install[2:-1].split(",")))
    tree = ast.parse((ROOT / "rltrainer" / "cli.py").read_text())
    modules = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    modules |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
                and not node.level}
    by_module = importlib.metadata.packages_distributions()
    needed = {dist.lower().replace("_", "-") for m in modules - set(sys.stdlib_module_names) - {"rltrainer", "__future__"}
              for dist in by_module.get(m, [m])}
    assert "jsonargparse" in needed
    assert needed <= installed, f"the README's `pip install -e \"{install}\"` leaves out {sorted(needed - installed)}"
