"""The "Coming from TRL or verl" tables (the docs page ``.ci/docs/pages/coming-from.md``) are true:
each TRL default is TRL's own (``GRPOConfig()`` built here; TRL is in the dev extra), each rltrainer
default the signature's."""

from __future__ import annotations

import ast
import enum
import inspect
import re
from pathlib import Path

import pytest

import rltrainer
import rltrainer.data

PAGE = Path(__file__).resolve().parents[1] / ".ci" / "docs" / "pages" / "coming-from.md"
CALL = re.compile(r"^`(\w+)\((\w+)\)`$")


def table(header: str) -> list[list[str]]:
    """The rows (cells stripped) of the page's table whose header starts with ``header``."""
    lines = PAGE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header}"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def literal(cell: str) -> object:
    return ast.literal_eval(cell.strip("`"))


def rltrainer_default(cell: str) -> object:
    """The default of ``Class(param)`` (a class or function exported by rltrainer or rltrainer.data)."""
    match = CALL.match(cell)
    assert match, f"not a `Name(parameter)` cell: {cell}"
    name, param = match.groups()
    target = getattr(rltrainer, name, None) or getattr(rltrainer.data, name)
    if isinstance(target, type) and issubclass(target, rltrainer.PolicyGradient):  # named or flat (its parts')
        return target.default_of(param)
    parameter = inspect.signature(target).parameters.get(param)
    assert parameter is not None, f"{name} has no parameter {param!r}"
    return parameter.default


def test_trl_table_matches_both_defaults():
    pytest.importorskip("trl", reason="TRL is in the dev extra; the TRL side needs it")
    from trl import GRPOConfig

    config = GRPOConfig(output_dir="unused", report_to=[], use_cpu=True, bf16=False)
    rows = table("TRL `GRPOConfig`")
    assert len(rows) >= 25
    for trl_arg, trl_default, ours, our_default, _note in rows:
        actual = getattr(config, trl_arg.strip("`"))
        actual = actual.value if isinstance(actual, enum.Enum) else actual
        assert actual == literal(trl_default), f"TRL {trl_arg}: the page says {trl_default}, TRL has {actual!r}"
        assert rltrainer_default(ours) == literal(our_default), f"{ours}: the page says {our_default}"


def test_verl_table_names_real_arguments_with_their_defaults():
    rows = table("verl key")
    assert len(rows) >= 30
    for key, ours, our_default, _note in rows:
        assert re.match(r"^`(algorithm|actor_rollout_ref|critic|data|trainer)\.", key), key
        assert rltrainer_default(ours) == literal(our_default), f"{key} -> {ours}: the page says {our_default}"
