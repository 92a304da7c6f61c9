"""Every snippet in the README runs as written (issue 18, item 2).

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
import importlib
import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN_MARK = "<!-- runs in tests/test_readme.py -->"
BLOCK = re.compile(r"(?P<mark><!--[^\n]*-->\n)?```(?P<lang>[\w-]*)\n(?P<code>.*?)^```", re.S | re.M)
#: Where a fragment's class names may come from (the names the README's prose has introduced).
PACKAGES = ("rltrainer", "rltrainer.strategies", "rltrainer.algorithms", "rltrainer.rewards", "rltrainer.data")


def blocks(lang: str) -> list[tuple[int, str, bool]]:
    """``(line, code, marked to run)`` for every fenced block of ``lang`` in the README."""
    text = (ROOT / "README.md").read_text()
    return [(text.count("\n", 0, m.start("code")) + 1, m["code"], (m["mark"] or "").strip() == RUN_MARK)
            for m in BLOCK.finditer(text) if m["lang"] == lang]


PYTHON = blocks("python")
BASH = blocks("bash")


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


def ids(items: list[tuple[int, str, bool]]) -> list[str]:
    return [f"README.md:{line}" for line, *_ in items]


def test_the_readme_has_snippets_to_run():
    assert PYTHON and BASH and any(run for *_, run in PYTHON)


@pytest.mark.parametrize("line, code, run", PYTHON, ids=ids(PYTHON))
def test_python_snippet_is_sound(line, code, run):
    tree = ast.parse(code, filename=f"README.md:{line}")
    used, bound = names(tree)
    undefined = used - bound - set(dir(builtins))
    if is_complete(tree):
        assert not undefined, f"the snippet at README.md:{line} uses names it never defines: {sorted(undefined)}"
        for node in ast.walk(tree):  # its imports resolve (imports only: nothing is built or downloaded)
            if isinstance(node, ast.ImportFrom):
                module = importlib.import_module(node.module)
                missing = [a.name for a in node.names if not hasattr(module, a.name)]
                assert not missing, f"README.md:{line}: {node.module} has no {missing}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    importlib.import_module(alias.name)
    else:
        exported = {name for package in PACKAGES for name in dir(importlib.import_module(package))}
        unknown = {name for name in undefined if name[0].isupper()} - exported
        assert not unknown, f"the fragment at README.md:{line} names classes the package lacks: {sorted(unknown)}"


@pytest.mark.parametrize("line, code, run", [b for b in PYTHON if b[2]], ids=ids([b for b in PYTHON if b[2]]))
def test_cpu_snippet_runs(line, code, run, monkeypatch):
    monkeypatch.chdir(ROOT)  # the snippets use repository paths (recipes/data/...)
    exec(compile(code, f"README.md:{line}", "exec"), {"__name__": f"readme_{line}"})


def commands() -> list[tuple[int, list[str]]]:
    """Every command of the bash blocks, split at ``&&``, comments dropped."""
    out = []
    for line, code, _ in BASH:
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
                out.append((line + offset, words[:cut]))
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
    for line, words in commands():
        where = f"README.md:{line}: {' '.join(words)}"
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
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert any(ci == code.strip() for _, code, _ in BASH), f".ci/run's command is not in the README: {ci}"
