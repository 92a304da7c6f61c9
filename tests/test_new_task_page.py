"""The docs page ``.ci/docs/pages/new-task.md`` builds a new task with ``rltrainer.toy`` in under
40 lines: its Python block runs end to end (with fewer steps) and reports held-out accuracy; and the
same task from the command line (its ``sort_task.py``, ``task.yaml`` and commands) runs too."""

from __future__ import annotations

import csv
import re
import runpy
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / ".ci" / "docs" / "pages" / "new-task.md"
SIZES = re.compile(r"^WARMUP_STEPS, GRPO_STEPS, HELD_OUT = .*$", re.M)


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)^```", PAGE.read_text(), re.S | re.M)


def page_code() -> str:
    return blocks("python")[0]


def test_the_example_is_under_40_lines_and_sizes_itself_in_one_line():
    code = page_code()
    assert len(code.splitlines()) < 40 and len(SIZES.findall(code)) == 1


def test_the_new_task_example_runs_end_to_end(capsys):
    """Sorting digits: tokenizer, problems, reward, warm-up, GRPO fit and held-out accuracy (about 15 s)."""
    code = SIZES.sub("WARMUP_STEPS, GRPO_STEPS, HELD_OUT = 20, 2, 20", page_code())
    namespace: dict = {"__name__": "new_task_page"}
    exec(compile(code, str(PAGE), "exec"), namespace)  # noqa: S102 - the page's own example
    assert 0.0 <= namespace["before"] <= 1.0 and 0.0 <= namespace["after"] <= 1.0
    assert namespace["trainer"].global_step == 2 and namespace["warm"].steps <= 20
    assert re.search(r"held-out accuracy \d+\.\d% -> \d+\.\d%", capsys.readouterr().out)


def test_the_same_task_runs_from_the_command_line(tmp_path, monkeypatch, capsys):
    """Issue 44, item 14: the page's sort_task.py (a 20-step warm-up here) and task.yaml (2 GRPO steps)
    through ``rltrainer validate`` and ``rltrainer fit``: the log holds val/accuracy before the first
    step (step 0) and at the end, and validate measures the warm model, then the best checkpoint."""
    from rltrainer.cli import main

    (script,), (config,) = blocks("python")[1:], blocks("yaml")
    assert "rltrainer.toy.ProblemsData" in config and "val_check_interval: 50" in config
    (tmp_path / "sort_task.py").write_text(script.replace("steps=1000", "steps=20"))
    (tmp_path / "task.yaml").write_text(config)
    monkeypatch.chdir(tmp_path)
    runpy.run_path("sort_task.py", run_name="__main__")
    assert (tmp_path / "warm" / "config.json").is_file() and (tmp_path / "warm" / "tokenizer.json").is_file()
    assert main(["validate", "--config", "task.yaml"]) == 0
    before = capsys.readouterr().out
    assert "rltrainer validate done: the model as configured (step 0)" in before and "val/accuracy" in before
    assert main(["fit", "--config", "task.yaml", "--trainer.max_steps", "2", "--trainer.enable_progress_bar",
                 "false"]) == 0
    out = capsys.readouterr().out
    assert "rltrainer fit done: 2/2 steps" in out and "best:" in out
    log_dir = max((tmp_path / "runs" / "sort" / "lightning_logs").glob("version_*"))
    rows = [r for r in csv.DictReader((log_dir / "metrics.csv").open()) if r.get("val/accuracy")]
    assert [int(r["step"]) for r in rows] == [0, 2]  # before the first step, and at the end
    assert main(["validate", "--config", "task.yaml", "--ckpt_path", "last"]) == 0
    assert "(step 2)" in capsys.readouterr().out
