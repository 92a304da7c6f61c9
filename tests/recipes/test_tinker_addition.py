"""Issue 46, point 3: the RL loop written only against the tinker SDK (``recipes/tinker_addition.py``)
learns through ``rltrainer serve``: held-out addition accuracy rises, as with ``Trainer.fit``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


@pytest.mark.slow
def test_the_sdk_loop_raises_held_out_accuracy(monkeypatch):
    """200 steps of 32 prompts x 8 samples, 4 updates a batch, over the server. Measured on 2 shared
    cores (2026-12-05): seed 0 21.7% -> 56.0% (280 s), seed 1 12.3% -> 28.0% (226 s); lr 1e-3
    collapsed both to 0 %. Two runs are too few for the Trainer recipe's 15-point bar (held over 20),
    so the bar is 10 points."""
    pytest.importorskip("tinker", reason="the loop is written against the tinker SDK: pip install tinker==0.38.0")
    monkeypatch.syspath_prepend(str(RECIPES))  # the recipe takes the task from grpo_addition.py beside it
    monkeypatch.setenv("TINKER_API_KEY", "tml-local")
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    sys.modules.pop("tinker_addition", None)
    from tinker_addition import main

    result = main(["--steps", "200", "--print-every", "50"])
    gain = result["after"] - result["before"]
    assert gain >= 0.10, f"the SDK loop raised held-out accuracy by only {gain:+.1%}: {result}"
