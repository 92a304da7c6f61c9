import json

import pytest

from rltrainer.testing import DATA_DIR

from rltrainer.rewards import REWARDS, is_equiv, last_boxed_only_string, math_reward, resolve_reward, strip_string
from rltrainer.rewards.math import extract_boxed_answer, remove_boxed

SHARED = DATA_DIR  # the offline copies shipped in recipes/data


@pytest.mark.parametrize(
    ("text", "boxed"),
    [
        ("so $\\boxed{\\frac{1}{2}}$.", "\\boxed{\\frac{1}{2}}"),
        ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}"),
        ("first \\boxed{1}, finally \\boxed{2}", "\\boxed{2}"),
        ("\\fbox{7}", "\\fbox{7}"),
        ("the answer is $\\boxed 5$.", "\\boxed 5"),
        ("no box here", None),
        ("\\boxed{unclosed {", None),
    ],
)
def test_last_boxed_only_string(text: str, boxed: str | None) -> None:
    assert last_boxed_only_string(text) == boxed


def test_remove_boxed() -> None:
    assert remove_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert remove_boxed("\\fbox{7}") == "7"
    assert remove_boxed("\\boxed 5") == "5"
    assert extract_boxed_answer("nothing") is None
    with pytest.raises(ValueError, match="got '5'"):
        remove_boxed("5")


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("\\frac12", "\\frac{1}{2}"),
        ("\\dfrac{1}{2}", "\\tfrac12"),
        ("0.5", "\\frac{1}{2}"),
        (".5", "\\frac{1}{2}"),
        ("0.25", "\\frac14"),  # numeric fallback
        ("3/4", "\\frac{3}{4}"),
        ("5.4 \\text{ cents}", "5.4"),
        ("10\\text{ cm}", "10"),
        ("90^\\circ", "90"),
        ("\\$18", "18"),
        ("x = 3", "3"),
        ("18.", "18"),
        ("18.00", "18"),
        ("58,500", "58500"),
        ("11,\\! 111,\\! 111,\\! 100", "11111111100"),
        ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),
        ("\\sqrt3", "\\sqrt{3}"),
        ("50\\%", "50"),
        ("\\text{(C)}", "(C)"),
    ],
)
def test_equivalent(a: str, b: str) -> None:
    assert is_equiv(a, b)
    assert is_equiv(b, a)


@pytest.mark.parametrize(
    ("a", "b"),
    [("1+x", "x+1"), ("0.33", "\\frac13"), ("(1,2)", "(2,1)"), ("1,2", "12"), ("2", "3"), (None, "3"), (None, None)],
)
def test_not_equivalent(a: str | None, b: str | None) -> None:
    assert not is_equiv(a, b)


def test_strip_string() -> None:
    assert strip_string("\\left( 3, \\dfrac{\\pi}{2} \\right)") == "(3,\\frac{\\pi}{2})"
    assert strip_string(" k = 7 \\text{ units}") == "7"


def test_math_reward() -> None:
    completions = [
        "We get $\\boxed{\\frac12}$.",
        "Answer: \\boxed{\\dfrac{1}{2}}",
        "Answer: \\boxed{\\frac{1}{3}}",
        "I think it is 1/2",  # no box: 0
    ]
    assert math_reward(completions, ground_truth=["\\frac{1}{2}"] * 4, problem=["p"] * 4) == [1.0, 1.0, 0.0, 0.0]
    assert math_reward(["\\boxed{3}"], ground_truth=["\\boxed{3}"]) == [1.0]  # boxed gold is unboxed
    assert resolve_reward("math") is math_reward and "math" in REWARDS
    with pytest.raises(ValueError, match="1 completions but 2 ground truths"):
        math_reward(["\\boxed{1}"], ["1", "2"])


def test_math500_gold_answers_match_their_own_boxed_solutions() -> None:
    path = SHARED / "math500" / "test.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    scores = math_reward([f"so \\boxed{{{row['answer']}}}" for row in rows], [row["answer"] for row in rows])
    assert scores == [1.0] * len(rows)
    # The reference solutions box the gold answer, sometimes written differently (\dfrac, spaces, units).
    solution_scores = math_reward([row["solution"] for row in rows], [row["answer"] for row in rows])
    assert solution_scores == [1.0] * len(rows)
