"""Boxed-answer reward for MATH / MATH-500.

The answer is the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``) in
the completion. It is compared with the gold answer after the string normalisation of Hendrycks'
MATH ``math_equivalence.py`` (also used by verl's ``reward_score/math.py``), with an exact
numeric comparison as a fallback when both sides are plain numbers or simple fractions, so
``0.25``, ``\\frac14``, ``1/4`` and ``\\dfrac{1}{4}`` are all equal. No sympy: ``x+1`` and
``1+x`` are *not* equal.

Example::

    >>> math_reward(["... so the answer is $\\boxed{\\frac12}$."], ground_truth=["\\frac{1}{2}"])
    [1.0]
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed_only_string(text: str) -> str | None:
    """The last ``\\boxed{...}``/``\\fbox{...}`` in ``text`` with its braces, or ``None``.

    Nested braces are matched, so ``\\boxed{\\frac{1}{2}}`` is returned whole. The brace-less
    form ``\\boxed 5`` is returned up to the next ``$`` or newline (``"\\boxed 5"``). An unclosed box
    gives ``None``.
    """
    idx = max(text.rfind(command) for command in _BOX_COMMANDS)
    if idx < 0:
        return None
    command = next(c for c in _BOX_COMMANDS if text.startswith(c, idx))
    rest = text[idx + len(command) :]
    body = rest.lstrip(" ")
    if not body.startswith("{"):
        answer = re.split(r"[$\n]", body)[0].strip()  # "\boxed 5$": no braces, ends at "$"
        return command + " " + answer if rest.startswith(" ") and answer else None
    depth = 0
    for i, char in enumerate(body):
        depth += (char == "{") - (char == "}")
        if depth == 0:
            return command + body[: i + 1]
    return None


def remove_boxed(boxed: str) -> str:
    """``"\\boxed{x}"`` -> ``"x"`` (also ``\\fbox{x}`` and ``\\boxed x``)."""
    for command in _BOX_COMMANDS:
        if boxed.startswith(command + " "):
            return boxed[len(command) + 1 :]
        if boxed.startswith(command + "{") and boxed.endswith("}"):
            return boxed[len(command) + 1 : -1]
    raise ValueError(f"Expected a string like '\\boxed{{...}}' or '\\fbox{{...}}', got {boxed!r}.")


def _fix_fracs(string: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{72}`` -> ``\\frac{1}{72}``."""
    parts = string.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part.startswith("{") or len(part) < 2:
            out += part
            continue
        a, b = part[0], part[1]
        out += "{" + a + "}" + (b + part[2:] if b == "{" else "{" + b + "}" + part[2:])
    return out


def _fix_a_slash_b(string: str) -> str:
    """``"3/4"`` -> ``"\\frac{3}{4}"`` when both sides are plain integers."""
    match = re.fullmatch(r"(-?\d+)/(\d+)", string)
    return f"\\frac{{{match.group(1)}}}{{{match.group(2)}}}" if match else string


def _fix_sqrt(string: str) -> str:
    """``\\sqrt3`` -> ``\\sqrt{3}``."""
    return re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", string)


def _remove_right_units(string: str) -> str:
    """Drop a trailing unit such as ``\\text{ cm}`` or ``\\mbox{ inches}`` (never the whole answer)."""
    stripped = re.sub(r"\\(?:text|mbox)\{[^{}]*\}$", "", string).strip()
    return stripped if stripped else string


def strip_string(string: str) -> str:
    """Normalise a LaTeX answer (Hendrycks' MATH ``_strip_string``) so equal answers compare equal."""
    string = str(string).strip().replace("\n", "").replace("\\!", "")
    string = string.replace("\\\\", "\\")
    string = string.replace("tfrac", "frac").replace("dfrac", "frac")
    string = string.replace("\\left", "").replace("\\right", "")
    string = string.replace("^{\\circ}", "").replace("^\\circ", "")
    string = string.replace("\\$", "").replace("$", "")
    string = _remove_right_units(string)
    string = re.sub(r"\\text\{([^{}]*)\}", r"\1", string)  # "\text{(A)}" -> "(A)"
    string = string.replace("\\%", "").replace("%", "")
    string = string.replace(" .", " 0.").replace("{.", "{0.")
    string = string.rstrip(".").strip()
    if not string:
        return string
    if string[0] == ".":
        string = "0" + string
    sides = string.split("=")
    if len(sides) == 2 and len(sides[0].strip()) <= 2:  # "x = 5" -> "5", "k=3" -> "3"
        string = sides[1]
    string = _fix_sqrt(string)
    string = string.replace(" ", "")
    string = _fix_fracs(string)
    if string == "0.5":
        string = "\\frac{1}{2}"
    return _fix_a_slash_b(string)


_PLAIN_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|-?\.\d+")
_FRACTION = re.compile(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}")


def _as_number(string: str) -> Fraction | None:
    """The exact value of a normalised answer that is a plain number or integer fraction."""
    if _PLAIN_NUMBER.fullmatch(string):
        return Fraction(string.replace(",", "").rstrip("."))
    match = _FRACTION.fullmatch(string)
    if match and int(match.group(3)) != 0:
        value = Fraction(int(match.group(2)), int(match.group(3)))
        return -value if match.group(1) else value
    return None


def is_equiv(str1: str | None, str2: str | None) -> bool:
    """Whether two answers are equal after :func:`strip_string`, or equal as numbers.

    ``None`` (no answer) is never equivalent to anything, including another ``None``.
    """
    if str1 is None or str2 is None:
        return False
    ss1, ss2 = strip_string(str1), strip_string(str2)
    if ss1 == ss2:
        return True
    n1, n2 = _as_number(ss1), _as_number(ss2)
    return n1 is not None and n1 == n2


def extract_boxed_answer(text: str) -> str | None:
    """The content of the last box in ``text``, or ``None`` if there is none."""
    boxed = last_boxed_only_string(text)
    return None if boxed is None else remove_boxed(boxed)


def math_reward(completions: Sequence[str], ground_truth: Sequence[str], **kwargs: Any) -> list[float]:
    """Score each completion 1.0 if its last boxed answer is equivalent to the gold answer, else 0.0.

    Args:
        completions: ``N`` completion texts.
        ground_truth: ``N`` gold answers (MATH-500's ``answer`` column, without ``\\boxed``;
            a boxed gold answer is unboxed first).
        **kwargs: other dataset fields, ignored.
    """
    if len(completions) != len(ground_truth):
        raise ValueError(
            f"math_reward got {len(completions)} completions but {len(ground_truth)} ground truths; "
            "pass one ground truth per completion."
        )
    scores = []
    for completion, truth in zip(completions, ground_truth):
        gold = str(truth)
        gold = extract_boxed_answer(gold) or gold  # tolerate a gold answer given as "\\boxed{...}"
        scores.append(1.0 if is_equiv(extract_boxed_answer(completion), gold) else 0.0)
    return scores


math_reward.max_score, math_reward.correctness = 1.0, True  # type: ignore[attr-defined]  # 1.0 exactly when right
