"""The documentation site builds in strict mode (issue 31, item 8): ``mkdocs build --strict -f
.ci/docs/mkdocs.yml`` fails on a broken link, a missing anchor, a page left out of the nav or a
reference mkdocstrings cannot resolve, and this test fails with mkdocs' warnings. The registries page
is generated at build time (``.ci/docs/hooks.py``): every entry of every registry is on it."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import rltrainer
from rltrainer.algorithms import ADVANTAGES, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES, ROLLOUT_CORRECTIONS
from rltrainer.envs import TOOL_PARSERS
from rltrainer.rewards import REWARDS

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / ".ci" / "docs" / "mkdocs.yml"
REGISTRIES = {
    "rltrainer.STRATEGIES": rltrainer.STRATEGIES, "rltrainer.ENGINES": rltrainer.ENGINES,
    "rltrainer.algorithms.ADVANTAGES": ADVANTAGES, "rltrainer.algorithms.POLICY_LOSSES": POLICY_LOSSES,
    "rltrainer.algorithms.KL_ESTIMATORS": KL_ESTIMATORS, "rltrainer.algorithms.AGGREGATIONS": AGGREGATIONS,
    "rltrainer.algorithms.ROLLOUT_CORRECTIONS": ROLLOUT_CORRECTIONS, "rltrainer.envs.TOOL_PARSERS": TOOL_PARSERS,
    "rltrainer.rewards.REWARDS": REWARDS,
}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if importlib.util.find_spec("mkdocs") is None:
        message = 'mkdocs is not installed: pip install -e ".[dev]" -c .ci/constraints.txt'
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(CONFIG), "-d", str(out)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    warnings = [line for line in result.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert result.returncode == 0 and not warnings, (
        "the documentation site does not build in strict mode (mkdocs build --strict -f .ci/docs/mkdocs.yml):\n"
        + "\n".join(warnings or result.stderr.splitlines()[-30:]))
    return out


def test_the_site_builds_strictly(site: Path) -> None:
    for page in ("index.html", "getting-started.html", "concepts.html", "registries.html", "api/trainer.html",
                 "coming-from.html", "benchmarks.html", "figures/grpo_addition.png"):
        assert (site / page).is_file(), f"the built site has no {page}"
    api = (site / "api" / "trainer.html").read_text() + (site / "api" / "module.html").read_text()
    for anchor in ("rltrainer.trainer.Trainer.fit", "rltrainer.module.RLModule.advantage_step"):
        assert f'id="{anchor}"' in api, f"the API reference has no {anchor} (mkdocstrings rendered nothing?)"
    assert "Current figures" in (site / "benchmarks.html").read_text(), "tests/benchmarks/README.md was not included"


def test_the_registries_page_lists_every_entry(site: Path) -> None:
    sys.path.insert(0, str(CONFIG.parent))
    try:
        from hooks import find_registries, public_path  # the hook's own discovery
    finally:
        sys.path.remove(str(CONFIG.parent))
    found = {public_path(module, name) for module, name in find_registries()}
    assert set(REGISTRIES) <= found, f"the docs hook did not find {sorted(set(REGISTRIES) - found)}"
    html = (site / "registries.html").read_text()
    for path, registry in REGISTRIES.items():
        assert f"<code>{path}</code>" in html, f"registries.html has no section for {path}"
        missing = [name for name in registry.names() if f"<code>{name}</code>" not in html]
        assert not missing, f"registries.html does not list {path} entries {missing}"


def test_the_readme_links_resolve() -> None:
    """The README links into the pages (read on GitHub or from a clone): every relative link names a
    file of the repository, and an anchor one of its headings."""
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert any(link.startswith(".ci/docs/pages/") for link in links), "the README links to no page of the docs"
    for link in links:
        if re.match(r"\w+://", link):
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.is_file(), f"README.md links to {link}, which does not exist"
        if anchor:
            slugs = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-")
                     for h in re.findall(r"^#+ (.+)$", target.read_text(), re.M)}
            assert anchor in slugs, f"README.md links to {link}: {path} has no heading {anchor!r} ({sorted(slugs)})"


def test_the_grpo_signature_on_the_algorithms_page_is_the_real_one() -> None:
    text = (CONFIG.parent / "pages" / "algorithms.md").read_text()
    block = re.search(r"```python\n(GRPO\(.*?)\n```", text, re.S)
    assert block, "algorithms.md has no GRPO(...) signature block"
    call = ast.parse(block[1]).body[0].value
    written = [arg.id for arg in call.args] + [keyword.arg or keyword.value.id for keyword in call.keywords]
    defaults = {keyword.arg: ast.literal_eval(keyword.value) for keyword in call.keywords if keyword.arg}
    real = inspect.signature(rltrainer.GRPO).parameters
    assert written == list(real), f"algorithms.md lists GRPO's arguments as {written}; they are {list(real)}"
    wrong = {name: (value, real[name].default) for name, value in defaults.items() if real[name].default != value}
    assert not wrong, f"algorithms.md gives GRPO defaults that differ (page, real): {wrong}"


def test_the_flat_keywords_table_on_the_algorithms_page_is_the_real_mapping() -> None:
    """The one mapping of flat keywords (``flat_keywords``), as the page's table shows it: each
    row's keywords are the fields of its part or group, with their defaults."""
    from rltrainer.algorithms import parts
    from rltrainer.modules import settings

    text = (CONFIG.parent / "pages" / "algorithms.md").read_text()
    rows = re.findall(r"^\| `(\w+)`[^|]*\| `(\w+)` \| (.+) \|$", text, re.M)
    assert len(rows) == 12, rows
    for kind, name, cell in rows:
        cls = getattr(parts, name, None) or getattr(settings, name)
        written = dict(re.findall(r"`(\w+)=([^`]+)`", cell))
        own = {f.name: f.default for f in dataclasses.fields(cls) if f.init}
        assert cls.kind == kind if hasattr(cls, "kind") else kind in settings.flat_keywords({kind: cls}).values()
        assert set(written) <= set(own), (name, set(written) - set(own))
        assert {k: ast.literal_eval(v) for k, v in written.items()} == {k: own[k] for k in written}, name


def test_the_model_families_table_is_the_one_the_checks_give() -> None:
    """gpus.md's "Model families per strategy" table is rendered from the family configs, the
    strategies' and engines' own checks, megatron's rules and vLLM's recorded outcomes
    (rltrainer.testing.family_table): a change to any of them fails here until the page is
    regenerated."""
    import difflib

    if importlib.util.find_spec("megatron") is None:
        pytest.skip('megatron-core is not installed (the table has its column): pip install -e ".[dev]"')
    from rltrainer.testing.family_table import page_table, render

    page, rendered = page_table(), render()
    diff = "\n".join(difflib.unified_diff(page.splitlines(), rendered.splitlines(), "gpus.md", "rendered", lineterm=""))
    assert page == rendered, ("the family table in .ci/docs/pages/gpus.md is not the one the checks give; "
                              f"regenerate it: python -m rltrainer.testing.family_table --write\n{diff}")
