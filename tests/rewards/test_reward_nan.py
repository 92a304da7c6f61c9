"""Non-finite scores are caught where they enter: counted as errors with the function and rows."""

from __future__ import annotations

import math

import torch

from rltrainer.rewards import RewardManager


def nan_on_empty(completions, **kwargs):
    return [float("nan") if not c else 1.0 for c in completions]


def always_one(completions, **kwargs):
    return [1.0] * len(completions)


def test_non_finite_scores_count_as_errors_and_mark_rows(caplog) -> None:
    manager = RewardManager([nan_on_empty, always_one], weights=[1.0, 0.5])
    with caplog.at_level("WARNING"):
        result = manager(["a", "", "b", ""], {})
    assert result.invalid.tolist() == [False, True, False, True]
    assert result.errors == 2 and result.errors_per_func == {"nan_on_empty": 2, "always_one": 0}
    assert torch.isfinite(result.scores).all() and result.scores.tolist() == [1.5, 0.5, 1.5, 0.5]
    metrics = result.metrics()
    assert metrics["reward/non_finite_share"] == 0.5 and all(math.isfinite(v) for v in metrics.values())
    assert metrics["reward/nan_on_empty/non_finite_share"] == 0.5 and metrics["reward/always_one/non_finite_share"] == 0
    assert "'nan_on_empty'" in caplog.text and "rows [1, 3] of 4" in caplog.text
    assert RewardManager([always_one])(["a"], {}).invalid is None
