"""The README's GSM8K pipeline check, shortened: the GSM8K recipe's CPU preset (tiny Qwen2 + the real Qwen2.5
tokenizer + the shipped GSM8K copy) runs end to end offline."""

import importlib.util
import json
import math
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "grpo_gsm8k.py"


def load_recipe():
    spec = importlib.util.spec_from_file_location("grpo_gsm8k", RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_preset_runs_offline(tmp_path):
    recipe = load_recipe()
    summary = recipe.main(["--preset", "cpu", "--max-steps", "2", "--val-check-interval", "2", "--val-batches", "1",
                           "--max-new-tokens", "16", "--output-dir", str(tmp_path), "--no-progress-bar"])
    assert {"val/accuracy", "val/score", "critic/score/mean", "timing_s/step"} <= set(summary)
    assert all(math.isfinite(v) for v in summary.values())
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert list(tmp_path.glob("lightning_logs/version_*/metrics.csv"))


def test_cpu_preset_with_tiny_qwen3_and_its_tokenizer(tmp_path):
    recipe = load_recipe()
    rows = tmp_path / "rows.jsonl"  # 8 GSM8K rows: tokenising the whole split would dominate the run
    rows.write_text("".join(Path(recipe.data_path("gsm8k", "train.jsonl")).read_text().splitlines(True)[:8]))
    summary = recipe.main(["--preset", "cpu", "--model", "tiny-qwen3", "--train-file", str(rows), "--val-file",
                           str(rows), "--max-steps", "1", "--val-check-interval", "1", "--val-batches", "1",
                           "--max-new-tokens", "8", "--output-dir", str(tmp_path), "--no-progress-bar"])
    assert {"val/accuracy", "critic/score/mean"} <= set(summary) and all(math.isfinite(v) for v in summary.values())


def test_cpu_preset_on_two_fsdp2_ranks(tmp_path, ray_session):
    recipe = load_recipe()
    summary = recipe.main(["--preset", "cpu", "--strategy", "fsdp2", "--devices", "2", "--max-steps", "2",
                           "--val-check-interval", "2", "--val-batches", "1", "--max-new-tokens", "16",
                           "--output-dir", str(tmp_path), "--no-progress-bar"])
    assert {"val/accuracy", "val/score", "critic/score/mean", "timing_s/step"} <= set(summary)
    assert all(math.isfinite(v) for v in summary.values())
