"""A numeric setting, checked where it is written: :func:`check_int` and :func:`check_float`.

Every class a user builds (the Trainer, the modules and their parts, the engines, the strategies,
the callbacks, the data module) checks its numbers with these, so ``max_new_tokens=2.5`` is refused
by the constructor that took it, naming the setting, instead of failing later inside torch. The
rules, the same everywhere:

- an int setting takes an ``int`` (a numpy integer too); a float, even ``2.0``, is refused with the
  int to write instead: a config's ``2.0`` is a typo that jsonargparse refuses for an int too;
- a float setting takes an ``int`` or a ``float`` (numpy's too), never NaN, and infinity only where
  it means something (``finite=False``: a timeout that never ends);
- ``True`` / ``False`` are never numbers, and neither is a string such as ``"5"``;
- ``None`` only where the setting gives it a meaning (``none="no limit"``).

A refusal is a :class:`SettingError`: a ``TypeError`` and a ``ValueError`` both, so code that
catches either (the command line turns both into one usage message) still does.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any


class SettingError(TypeError, ValueError):
    """A setting's value is of the wrong type or out of its range: what was given, what is allowed."""


def check_int(name: str, value: Any, *, at_least: int | None = None, at_most: int | None = None,
              none: str | None = None, special: Mapping[int, str] | None = None, meaning: str = "",
              owner: str = "") -> Any:
    """``value`` as an ``int`` (``None`` where ``none`` says what it means; a ``special`` value, e.g.
    ``{-1: "no limit"}``, as it is); else raise :class:`SettingError` naming ``owner(name=...)``."""
    if value is None and none is not None:
        return None
    allowed = _allowed("an int", at_least, None, at_most, None, none, special, meaning)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        if int(value) in (special or {}) or _in_range(int(value), at_least, None, at_most, None):
            return int(value)
        raise SettingError(f"{_where(owner, name)} must be {allowed}, got {value!r}.")
    raise SettingError(f"{_where(owner, name)} must be {allowed}, got {_given(value)}.{_int_fix(name, value)}")


def check_float(name: str, value: Any, *, at_least: float | None = None, above: float | None = None,
                at_most: float | None = None, below: float | None = None, none: str | None = None,
                finite: bool = True, meaning: str = "", owner: str = "") -> Any:
    """``value`` as a ``float`` (``None`` where ``none`` says what it means); infinity only with
    ``finite=False``, NaN never; else raise :class:`SettingError` naming ``owner(name=...)``."""
    if value is None and none is not None:
        return None
    allowed = _allowed("a number", at_least, above, at_most, below, none, None, meaning)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        number = float(value)
        if _in_range(number, at_least, above, at_most, below) and (not finite or math.isfinite(number)):
            return number
        infinite = " (infinity is not allowed here)" if math.isinf(number) and finite else ""
        raise SettingError(f"{_where(owner, name)} must be {allowed}, got {value!r}{infinite}.")
    raise SettingError(f"{_where(owner, name)} must be {allowed}, got {_given(value)}.{_number_fix(value)}")


def _where(owner: str, name: str) -> str:
    return f"{owner}({name}=...): {name}" if owner else name


def _allowed(kind: str, at_least: Any, above: Any, at_most: Any, below: Any, none: str | None,
             special: Mapping[int, str] | None, meaning: str) -> str:
    bounds = [f">= {at_least:g}" if at_least is not None else "", f"> {above:g}" if above is not None else "",
              f"<= {at_most:g}" if at_most is not None else "", f"< {below:g}" if below is not None else ""]
    text = " ".join([kind, " and ".join(b for b in bounds if b)]).strip()
    text += f" ({meaning})" if meaning else ""
    text += "".join(f" or {k} ({v})" for k, v in (special or {}).items())
    return text + (f" or None ({none})" if none is not None else "")


def _in_range(value: float, at_least: Any, above: Any, at_most: Any, below: Any) -> bool:
    return ((at_least is None or value >= at_least) and (above is None or value > above)
            and (at_most is None or value <= at_most) and (below is None or value < below))


def _given(value: Any) -> str:
    return f"{value!r} (a {type(value).__name__})"


def _int_fix(name: str, value: Any) -> str:
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
        if float(value).is_integer():
            return f" Write {name}={int(value)}."
        return f" Write a whole number, e.g. {name}={math.floor(value)} or {math.ceil(value)}."
    return _number_fix(value)


def _number_fix(value: Any) -> str:
    if isinstance(value, bool):
        return " True and False are not numbers here: write the number itself."
    if isinstance(value, (str, bytes)):
        return " Write the number itself, not a string (in YAML: unquoted)."
    return ""


def named_keywords(owner: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Decorate an ``__init__``: its own signature stays (``inspect.signature`` and ``help`` show it),
    and an unknown keyword raises ``TypeError`` naming the closest valid one (Python 3.11 names none)."""
    def decorate(init: Callable[..., None]) -> Callable[..., None]:
        names = list(inspect.signature(init).parameters)[1:]

        @functools.wraps(init)
        def checked(self: Any, *args: Any, **kwargs: Any) -> None:
            unknown = [k for k in kwargs if k not in names]
            if unknown:
                close = difflib.get_close_matches(unknown[0], names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; valid: {', '.join(names)}"
                raise TypeError(f"{owner}() got an unexpected keyword argument {unknown[0]!r}{hint}")
            init(self, *args, **kwargs)
        return checked
    return decorate
