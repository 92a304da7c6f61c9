"""GSM8K answer reward (the rule verl and ReFT use), comparing answers as numbers.

``strict`` mode reads the number after the last ``#### `` marker, so it also checks the format
the prompt asked for; ``flexible`` mode takes the last number anywhere in the completion.
Numbers compare by value: ``18.00 == 18``, ``1,080 == 1080``, ``$18 == 18``.

Example::

    >>> gsm8k_reward(["... so she earns #### $1,080.00"], ground_truth=["1080"])
    [1.0]
    >>> from functools import partial
    >>> lenient = partial(gsm8k_reward, mode="flexible", format_score=0.1)
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

MODES = ("strict", "flexible")

# A number: optional sign and dollar sign, digits with proper thousands separators or plain
# digits, optional decimals. Trailing "." (end of sentence) is not part of the match.
_NUMBER = r"-?\$?-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_STRICT_RE = re.compile(r"####\s*(" + _NUMBER + ")")


def _normalize(number: str) -> str:
    """``"$-1,080.00."`` -> ``"-1080.00"``: drop ``$``, thousands separators and a trailing dot."""
    text = number.strip().replace(",", "").replace("$", "").rstrip(".")
    if text.count("-") > 1 or (text.count("-") == 1 and not text.startswith("-")):
        text = "-" + text.replace("-", "")
    return text


def _to_number(text: str) -> Fraction | None:
    """The exact value of a normalised number string, or ``None`` if it is not a number."""
    try:
        return Fraction(_normalize(text))
    except (ValueError, ZeroDivisionError):
        return None


def extract_gsm8k_answer(text: str, mode: str = "strict") -> str | None:
    """The final answer in ``text``, normalised (no ``$``, no ``,``), or ``None`` if absent.

    Args:
        text: a model completion.
        mode: ``"strict"`` takes the number after the last ``####``; ``"flexible"`` takes the
            last number anywhere in the text.
    """
    if mode not in MODES:
        raise ValueError(f"GSM8K extraction mode {mode!r} is not supported; use one of {MODES}.")
    pattern = _STRICT_RE if mode == "strict" else _NUMBER_RE
    matches = pattern.findall(text)
    if not matches:
        return None
    return _normalize(matches[-1])


def gsm8k_reward(
    completions: Sequence[str],
    ground_truth: Sequence[str | int | float],
    mode: str = "strict",
    correct_score: float = 1.0,
    format_score: float = 0.0,
    **kwargs: Any,
) -> list[float]:
    """Score each completion against its GSM8K gold answer.

    Args:
        completions: ``N`` completion texts.
        ground_truth: ``N`` gold answers (``"1080"``, ``"1,080"`` and ``1080`` are all accepted).
        mode: ``"strict"`` (answer after ``####``) or ``"flexible"`` (last number in the text).
        correct_score: score of a correct answer.
        format_score: score of an answer that was found but is wrong.
        **kwargs: other dataset fields, ignored.

    Returns:
        ``N`` floats: ``correct_score``, ``format_score``, or ``0.0`` when no answer was found.
    """
    if len(completions) != len(ground_truth):
        raise ValueError(
            f"gsm8k_reward got {len(completions)} completions but {len(ground_truth)} ground truths; "
            "pass one ground truth per completion."
        )
    scores = []
    for completion, truth in zip(completions, ground_truth):
        gold = _to_number(str(truth))
        if gold is None:
            raise ValueError(f"GSM8K ground truth {truth!r} is not a number; expected e.g. '72' or '1,080'.")
        answer = extract_gsm8k_answer(completion, mode)
        if answer is None:
            scores.append(0.0)
        elif _to_number(answer) == gold:
            scores.append(float(correct_score))
        else:
            scores.append(float(format_score))
    return scores


def gsm8k_strict(completions: Sequence[str], ground_truth: Sequence[str | int | float], **kwargs: Any) -> list[float]:
    """GSM8K reward in strict mode: 1.0 if the number after the last ``####`` is correct."""
    return gsm8k_reward(completions, ground_truth, mode="strict", **kwargs)


def gsm8k_flexible(completions: Sequence[str], ground_truth: Sequence[str | int | float], **kwargs: Any) -> list[float]:
    """GSM8K reward in flexible mode: 1.0 if the last number in the completion is correct."""
    return gsm8k_reward(completions, ground_truth, mode="flexible", **kwargs)


# What validation reads (rltrainer.rewards.manager.reward_max_score / declares_correctness): each scores
# ``correct_score`` (1.0) exactly when the answer is right, whatever its ``format_score``. A partial
# with another ``correct_score`` sets ``max_score`` on itself.
for _fn in (gsm8k_reward, gsm8k_strict, gsm8k_flexible):
    _fn.max_score, _fn.correctness = 1.0, True  # type: ignore[attr-defined]
