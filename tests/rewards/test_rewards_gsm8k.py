import json
from functools import partial

import pytest

from rltrainer.testing import DATA_DIR

from rltrainer.rewards import REWARDS, extract_gsm8k_answer, gsm8k_flexible, gsm8k_reward, gsm8k_strict, resolve_reward

SHARED = DATA_DIR  # the offline copies shipped in recipes/data


@pytest.mark.parametrize(
    ("completion", "truth"),
    [
        ("#### 18.00", "18"),
        ("#### 1,080", "1080"),
        ("#### 1080", "1,080"),
        ("#### $18", "18"),
        ("#### $1,080.00.", "1080"),
        ("#### -3", "-3"),
        ("#### 18.", "18"),
        ("So 16 - 3 - 4 = 9 eggs, 9 * 2 = 18.\n#### 18", 18),
        ("first guess #### 5, no wait #### 18", "18"),  # the last marker wins
    ],
)
def test_strict_compares_numbers(completion: str, truth: str) -> None:
    assert gsm8k_reward([completion], ground_truth=[truth]) == [1.0]


def test_strict_needs_the_marker_flexible_does_not() -> None:
    completions = ["The answer is 18.", "The answer is $1,080.", "#### 7"]
    truths = ["18", "1080", "7"]
    assert gsm8k_reward(completions, truths) == [0.0, 0.0, 1.0]
    assert gsm8k_reward(completions, truths, mode="flexible") == [1.0, 1.0, 1.0]
    assert gsm8k_flexible(completions, ground_truth=truths) == [1.0, 1.0, 1.0]
    assert gsm8k_strict(completions, ground_truth=truths) == [0.0, 0.0, 1.0]


def test_flexible_takes_the_last_number() -> None:
    assert extract_gsm8k_answer("3 apples and 4 pears make 7 fruits.", "flexible") == "7"
    assert extract_gsm8k_answer("it drops to -3 degrees", "flexible") == "-3"
    assert extract_gsm8k_answer("values 1,2,3", "flexible") == "3"
    assert gsm8k_reward(["I got 12, then 13"], ["12"], mode="flexible") == [0.0]


def test_no_answer_scores_zero_and_wrong_answer_gets_format_score() -> None:
    completions = ["I don't know", "#### 17", "#### 18"]
    scores = gsm8k_reward(completions, ["18"] * 3, correct_score=2.0, format_score=0.1)
    assert scores == [0.0, 0.1, 2.0]
    assert extract_gsm8k_answer("no digits here", "strict") is None
    assert extract_gsm8k_answer("#### none", "strict") is None


def test_partial_and_extra_fields() -> None:
    lenient = partial(gsm8k_reward, mode="flexible", format_score=0.5)
    assert lenient(["it is 5", "it is 6"], ground_truth=["5", "7"], question=["q1", "q2"]) == [1.0, 0.5]


def test_errors_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="mode 'loose'.*strict"):
        extract_gsm8k_answer("#### 1", "loose")
    with pytest.raises(ValueError, match="2 completions but 1 ground truths"):
        gsm8k_reward(["a", "b"], ["1"])
    with pytest.raises(ValueError, match="ground truth 'abc' is not a number"):
        gsm8k_reward(["#### 1"], ["abc"])


def test_registry_and_names() -> None:
    assert resolve_reward("gsm8k") is gsm8k_reward
    assert resolve_reward("gsm8k_flexible") is gsm8k_flexible
    assert resolve_reward(gsm8k_strict) is gsm8k_strict
    assert gsm8k_strict.__name__ == "gsm8k_strict" and gsm8k_flexible.__name__ == "gsm8k_flexible"
    assert {"gsm8k", "gsm8k_flexible", "math"} <= set(REWARDS.names())
    with pytest.raises(ValueError, match="Unknown reward 'gsm9k'.*gsm8k"):
        resolve_reward("gsm9k")
    with pytest.raises(TypeError, match="got int 3"):
        resolve_reward(3)  # type: ignore[arg-type]


def test_gold_answers_from_the_real_test_split() -> None:
    path = SHARED / "gsm8k" / "test.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    truths = [row["answer"].rsplit("\n#### ", 1)[1] for row in rows]
    # The reference solutions themselves end with "#### <N>" and must score 1 against their own gold.
    assert gsm8k_reward([row["answer"] for row in rows], truths) == [1.0] * len(rows)
