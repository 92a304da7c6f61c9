"""The docs page ``.ci/docs/pages/new-task.md`` builds a new task with ``rltrainer.toy`` in under
40 lines: its Python block runs end to end (with fewer steps) and reports held-out accuracy."""

from __future__ import annotations

import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / ".ci" / "docs" / "pages" / "new-task.md"
SIZES = re.compile(r"^WARMUP_STEPS, GRPO_STEPS, HELD_OUT = .*$", re.M)


def page_code() -> str:
    (code,) = re.findall(r"```python\n(.*?)^```", PAGE.read_text(), re.S | re.M)
    return code


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
