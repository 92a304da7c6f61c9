import logging
from functools import partial
from typing import Any

import numpy as np
import pytest
import torch

from rltrainer.rewards import RewardManager, gsm8k_reward, gsm8k_strict

MANAGER_LOGGER = "rltrainer.rewards.manager"


def length_reward(completions: list[str], **kwargs: Any) -> list[float]:
    return [float(len(c)) for c in completions]


def picky_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """Raises on any completion containing 'bad'."""
    if any("bad" in c for c in completions):
        raise RuntimeError("cannot score a bad completion")
    return [1.0] * len(completions)


def test_weighted_sum_and_per_func() -> None:
    manager = RewardManager([gsm8k_strict, length_reward], weights=[2.0, 0.5])
    result = manager(["#### 3", "#### 4"], {"ground_truth": ["3", "3"], "question": ["q", "q"]})
    assert result.scores.dtype == torch.float32 and result.scores.shape == (2,)
    torch.testing.assert_close(result.per_func["gsm8k_strict"], torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(result.per_func["length_reward"], torch.tensor([6.0, 6.0]))
    torch.testing.assert_close(result.scores, torch.tensor([2.0 + 3.0, 3.0]))
    assert result.errors == 0


def test_default_weights_are_one_and_names_are_unique() -> None:
    lenient = partial(gsm8k_reward, mode="flexible")
    manager = RewardManager([gsm8k_reward, lenient, length_reward, length_reward])
    assert manager.names == ["gsm8k_reward", "gsm8k_reward_1", "length_reward", "length_reward_1"]
    result = manager(["it is 3"], {"ground_truth": ["3"]})
    torch.testing.assert_close(result.scores, torch.tensor([0.0 + 1.0 + 7.0 + 7.0]))
    assert set(result.per_func) == set(manager.names)


def test_a_raising_sample_scores_zero_and_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    manager = RewardManager([picky_reward, length_reward])
    with caplog.at_level(logging.WARNING, logger=MANAGER_LOGGER):
        first = manager(["ok", "bad", "fine"], {})
        second = manager(["bad", "bad!", "good"], {})
    torch.testing.assert_close(first.per_func["picky_reward"], torch.tensor([1.0, 0.0, 1.0]))
    torch.testing.assert_close(first.scores, torch.tensor([1.0 + 2, 0.0 + 3, 1.0 + 4]))  # other fn unaffected
    assert first.errors == 1 and first.errors_per_func == {"picky_reward": 1, "length_reward": 0}
    assert second.errors == 2
    torch.testing.assert_close(second.per_func["picky_reward"], torch.tensor([0.0, 0.0, 1.0]))
    warnings = [r for r in caplog.records if r.name == MANAGER_LOGGER]
    assert len(warnings) == 1
    assert "picky_reward" in warnings[0].getMessage() and "cannot score a bad completion" in warnings[0].getMessage()
    metrics = second.metrics()
    assert metrics["reward/errors"] == 2.0
    assert metrics["reward/picky_reward/mean"] == pytest.approx(1 / 3)
    assert metrics["reward/length_reward/mean"] == pytest.approx((3 + 4 + 4) / 3)
    assert metrics["reward/mean"] == pytest.approx(second.scores.mean().item())


def test_each_manager_logs_its_own_first_failure(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=MANAGER_LOGGER):
        RewardManager([picky_reward])(["bad"], {})
        RewardManager([picky_reward])(["bad"], {})
    assert len([r for r in caplog.records if r.name == MANAGER_LOGGER]) == 2


def test_wrong_weights_length() -> None:
    with pytest.raises(ValueError, match="Got 1 reward weights for 2 reward functions"):
        RewardManager([length_reward, picky_reward], weights=[1.0])
    with pytest.raises(ValueError, match="at least one"):
        RewardManager([])
    with pytest.raises(TypeError, match="callables.*'gsm8k'.*resolve_reward"):
        RewardManager(["gsm8k"])  # type: ignore[list-item]


def test_wrong_number_of_scores_raises() -> None:
    def short_reward(completions: list[str], **kwargs: Any) -> list[float]:
        return [1.0]

    with pytest.raises(ValueError, match=r"'short_reward' returned 1 scores \(\[1.0\]\) for 3 completions"):
        RewardManager([short_reward])(["a", "b", "c"], {})


def test_none_return_raises_type_error() -> None:
    def lazy_reward(completions: list[str], **kwargs: Any) -> None:
        return None

    with pytest.raises(TypeError, match="'lazy_reward' returned None"):
        RewardManager([lazy_reward])(["a"], {})


def test_missing_field_and_misaligned_field() -> None:
    manager = RewardManager([gsm8k_strict])
    with pytest.raises(TypeError, match="'gsm8k_strict'.*fields \\['question'\\].*ground_truth"):
        manager(["#### 1"], {"question": ["q"]})
    with pytest.raises(ValueError, match="'ground_truth' has 2 values for 1 completions"):
        manager(["#### 1"], {"ground_truth": ["1", "2"]})


def test_scores_from_tensors_and_empty_batch() -> None:
    def tensor_reward(completions: list[str], **kwargs: Any) -> torch.Tensor:
        return torch.ones(len(completions), dtype=torch.float64)

    result = RewardManager([tensor_reward])(["a", "b"], {})
    assert result.scores.dtype == torch.float32
    torch.testing.assert_close(result.scores, torch.ones(2))
    empty = RewardManager([tensor_reward])([], {})
    assert empty.scores.shape == (0,) and empty.metrics()["reward/mean"] == 0.0


def test_a_string_score_is_refused_even_one() -> None:
    """``"1"`` was scored 1.0: a string is a parsed answer returned in place of its score."""
    def parsed(completions: list[str], **kwargs: Any) -> list[Any]:
        return ["1" for _ in completions]

    with pytest.raises(TypeError, match=r"Reward function 'parsed' returned \['1', '1'\], which is not a list of "
                                        r"numbers .*'1' is a str, not a number; return float\(...\) of the score"):
        RewardManager([parsed])(["a", "b"])


def test_bools_and_numpy_numbers_are_scores() -> None:
    """What the module docstring promises: True is 1.0, numpy's numbers and 0-d arrays are numbers."""
    def mixed(completions: list[str], **kwargs: Any) -> list[Any]:
        return [True, np.float32(0.5), np.int64(2), np.bool_(False), np.array(0.25)]

    assert RewardManager([mixed])(list("abcde")).scores.tolist() == [1.0, 0.5, 2.0, 0.0, 0.25]


def test_a_list_per_completion_is_refused_when_it_returns_with_both_readings() -> None:
    """``[[0.4], [0.7]]`` (a one-element list each) against 5- and 2-token responses: named at once,
    with what came back and the two shapes a reward may have."""
    def partial_credit(completions: list[str], **kwargs: Any) -> list[list[float]]:
        return [[0.4], [0.7]]

    manager = RewardManager([length_reward, partial_credit])
    with pytest.raises(ValueError, match=r"Reward function 'partial_credit' returned a list for completion 0 with 1 "
                                         r"value\(s\), \[0.4\], but its response has 5 tokens \(completion_ids\[0\]\); "
                                         r"it returned \[\[0.4\], \[0.7\]\] for the batch\. A reward is one number per "
                                         r"completion \(return \[0.4, 0.7, ...\]; .*return \[x\[0\] for x in "
                                         r"...\]\) or, "
                                         r"for per-token rewards, a list of len\(completion_ids\[i\]\) numbers"):
        manager(["abcde", "fg"], {"completion_ids": [[1, 2, 3, 4, 5], [6, 7]]})
