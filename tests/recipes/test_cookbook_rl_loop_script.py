"""The by-hand cookbook check (tests/benchmarks/cookbook_rl_loop.py) without the cookbook: its rows are
GSM8K-shaped with the held-out pairs in none of them, and it changes exactly the cookbook's
``load_dataset`` line, refusing clearly when a cookbook release no longer has it."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_script():
    spec = importlib.util.spec_from_file_location("cookbook_rl_loop", ROOT / "tests" / "benchmarks" / "cookbook_rl_loop.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rows_are_gsm8k_shaped_and_leave_the_held_out_pairs_out(tmp_path):
    script = load_script()
    train, held_out = script.split_pairs(seed=3, top=10, num_held_out=25)
    assert len(held_out) == 25 and len(train) == 75 and not set(train) & set(held_out)
    script.write_rows(tmp_path / "rows.jsonl", train, rows=200, seed=3)
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert len(rows) == 200
    questions = {f"What is {a} + {b}?" for a, b in held_out}
    for row in rows:
        assert row["question"] not in questions
        a, b = (int(x) for x in row["question"].removeprefix("What is ").removesuffix("?").split(" + "))
        # GSM8K's answers end with "#### <number>", what the cookbook's extract_gsm8k_final_answer reads
        assert row["answer"].splitlines()[-1] == f"#### {a + b}"


def test_only_the_load_dataset_line_changes(tmp_path, capsys):
    script = load_script()
    recipes = tmp_path / "cache" / "tinker_cookbook" / "recipes"
    recipes.mkdir(parents=True)
    source = ["import datasets\n", "def main():\n", script.DATASET_LINE, "    return dataset\n"]
    (recipes / "rl_loop.py").write_text("".join(source))
    out = script.patched_loop(tmp_path / "cache", tmp_path)
    patched = out.read_text().splitlines(keepends=True)
    changed = [(a, b) for a, b in zip(source, patched) if a != b]
    assert len(patched) == len(source) and len(changed) == 1
    assert f'data_files={{"train": "{tmp_path / "addition_gsm8k.jsonl"}"}}' in changed[0][1]
    assert "+    dataset = datasets.load_dataset(\"json\"" in capsys.readouterr().out
    (recipes / "rl_loop.py").write_text("import datasets\n")
    with pytest.raises(SystemExit, match="no longer has the line"):
        script.patched_loop(tmp_path / "cache", tmp_path)
