"""MkDocs hooks for the rltrainer site (``hooks:`` in mkdocs.yml).

- ``<!-- registries -->`` in a page becomes one table per registry: each entry's name, its
  description (the docstring's first line, or the one it was registered with) and its parameters
  with their defaults. The registries are found in the source (every module-level
  ``NAME = Registry(...)`` under ``rltrainer/``) and read from the imported package, so a new entry,
  or a new registry, appears without editing a page.
- ``<!-- include tests/benchmarks/README.md -->`` includes a file of the repository (its first
  heading dropped), so the benchmark figures live in one place.
- ``<!-- vllm-families -->`` becomes the table of model families on the vLLM CPU build, from
  ``tests/rollout/vllm_families.json`` (which ``tests/rollout/test_vllm_families.py`` checks).
- The images of ``tests/benchmarks/figures/`` are copied into the site (``figures/``).
- Sphinx roles left in the docstrings (``:class:`Name```) are shown as code in the API pages.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
REGISTRY = re.compile(r"^(?P<name>[A-Z][A-Z_]*)\s*(?::[^=]+)?=\s*Registry\(", re.M)
INCLUDE = re.compile(r"^<!-- include (?P<path>[\w./-]+) -->$", re.M)
FIGURES = "tests/benchmarks/figures"
VLLM_FAMILIES = "tests/rollout/vllm_families.json"
#: A Sphinx role the docstrings use (``:class:`~rltrainer.data.RolloutBatch```), as mkdocstrings renders it.
ROLE = re.compile(r":(?:mod|class|func|meth|attr|data|exc|obj):<code>(~?)([^<]*)</code>")
SENTENCE_END = re.compile(r"(?<!\bal)(?<!\bDr)(?<!\bvs)\.\s(?=[A-Z])")  # not "et al. 2024", "Dr. GRPO"


def find_registries() -> list[tuple[str, str]]:
    """``(module, NAME)`` of every module-level registry in the package's source, in path order."""
    found = []
    for path in sorted((ROOT / "rltrainer").rglob("*.py")):
        for match in REGISTRY.finditer(path.read_text()):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found.append((module.removesuffix(".__init__"), match["name"]))
    return found


def public_path(module: str, name: str) -> str:
    """The shortest import path that exports ``name`` (``rltrainer.STRATEGIES`` before
    ``rltrainer.strategies.strategy.STRATEGIES``)."""
    parts = module.split(".")
    for end in range(1, len(parts) + 1):
        candidate = ".".join(parts[:end])
        if name in getattr(importlib.import_module(candidate), "__all__", ()):
            return f"{candidate}.{name}"
    return f"{module}.{name}"


def cell(text: Any) -> str:
    """Docstring text as a Markdown table cell: Sphinx roles (``:func:`name```) as code, no pipes."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"``\1``", str(text)).replace("\n", " ")
    # a pipe inside a code span stays as it is (the table splits around code spans, and an escape
    # there would be shown); outside one it is escaped
    parts = re.split(r"(`+[^`]*?`+)", text)
    return "".join(part if part.startswith("`") else part.replace("|", "\\|") for part in parts)


def summary(fn: Any, described: str) -> str:
    """The entry's description: the one it was registered with, or its docstring's first sentence
    (the registry keeps the first line, which a wrapped docstring cuts mid-sentence)."""
    doc = inspect.getdoc(fn) or ""
    if not described or not doc.startswith(described):
        return described
    paragraph = " ".join(doc.split("\n\n", 1)[0].split())
    end = SENTENCE_END.search(paragraph)
    return paragraph if end is None else paragraph[:end.start() + 1]


def registry_tables() -> str:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # this checkout's package, not another installed copy
    found = [(public_path(module, name), importlib.import_module(module), name) for module, name in find_registries()]
    out = []
    for path, module, name in sorted(found, key=lambda item: (item[0].count("."), item[0])):
        registry = getattr(module, name)
        out += [f"## `{path}`", "",
                f"{len(registry.names())} {registry.kind} names.", "",
                "| name | what it is | parameters (defaults) |", "| --- | --- | --- |"]
        for entry, described in registry.describe().items():
            params = ", ".join(f"`{k}={v!r}`" for k, v in registry.defaults(entry).items()) or "none"
            out.append(f"| `{entry}` | {cell(summary(registry.get(entry), described)) or '(no docstring)'} "
                       f"| {cell(params)} |")
        out.append("")
    return "\n".join(out)


def vllm_family_table() -> str:
    """One row per family: works (with the tolerances its test holds it to), or what stops it."""
    record = json.loads((ROOT / VLLM_FAMILIES).read_text())
    out = [f"| family (`model_type`) | on {record['engine']} | checked to |", "| --- | --- | --- |"]
    for family, entry in record["families"].items():
        if entry["status"] == "works":
            checked = f"log-probs within {entry['log_prob_atol']} of the trainer's (bf16)"
            if "route_agreement" in entry:
                checked += (f"; routes equal transformers' in >= {entry['route_agreement']:.0%} of (token, layer), "
                            f"misses within {entry['route_tie']} (router logits) of a tie")
            status = "works" + (f" ({entry['why']})" if "why" in entry else "")
        else:
            status, checked = f"{entry['status']}: `{entry['message']}`", cell(entry["why"])
        out.append(f"| `{family}` | {cell(status)} | {checked} |")
    return "\n".join(out)


def include(match: re.Match) -> str:
    text = (ROOT / match["path"]).read_text()
    return re.sub(r"\A# [^\n]*\n", "", text)  # the page has its own title


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    if "<!-- registries -->" in markdown:
        markdown = markdown.replace("<!-- registries -->", registry_tables())
    if "<!-- vllm-families -->" in markdown:
        markdown = markdown.replace("<!-- vllm-families -->", vllm_family_table())
    return INCLUDE.sub(include, markdown)


def on_page_content(html: str, page: Any, config: Any, files: Files) -> str:
    """Sphinx roles in docstrings shown as code (``~`` keeps the last name, as Sphinx does)."""
    return ROLE.sub(lambda m: f"<code>{m[2].rsplit('.', 1)[-1] if m[1] else m[2]}</code>", html)


def on_files(files: Files, config: Any) -> Files:
    for figure in sorted((ROOT / FIGURES).glob("*.png")):
        path = f"{FIGURES}/{figure.name}".replace("tests/benchmarks/", "")
        files.append(File(path, str(ROOT / "tests/benchmarks"), config["site_dir"], config["use_directory_urls"]))
    return files
