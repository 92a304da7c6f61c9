"""Combine several reward functions into one score per completion, isolating failures.

A reward function is a plain callable ``fn(completions, **fields) -> list[float]``; each dataset
field is passed as a list aligned with ``completions`` (TRL's convention)::

    manager = RewardManager([gsm8k_strict, format_reward], weights=[1.0, 0.1])
    result = manager(completions, {"ground_truth": truths})
    result.scores            # [N] float32, the weighted sum
    result.per_func          # {"gsm8k_strict": [N], "format_reward": [N]}, unweighted
    logger.log_metrics(result.metrics())

A function that raises on the whole batch is retried sample by sample; each sample that still
raises scores 0, is counted in ``errors``, and the first failure of each function is logged once.
A non-finite score (NaN, inf) is caught where it enters: it counts in ``errors``, the rows are
logged with the function's name, and they are marked in ``invalid`` (GRPO leaves them out of the
advantages and the loss). A function that returns the wrong number of scores, or ``None``, is a
bug and raises.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

RewardFn = Callable[..., Sequence[float]]


def reward_name(fn: Callable[..., Any]) -> str:
    """A display name: ``__name__``, the wrapped function's name for a ``functools.partial``,
    or the class name for a callable object."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", type(fn).__name__)


def _unique_names(funcs: Sequence[Callable[..., Any]]) -> list[str]:
    """Names of ``funcs``, later duplicates suffixed ``_1``, ``_2``, ..."""
    names: list[str] = []
    for fn in funcs:
        base = name = reward_name(fn)
        suffix = 0
        while name in names:
            suffix += 1
            name = f"{base}_{suffix}"
        names.append(name)
    return names


@dataclass
class RewardResult:
    """Scores of ``N`` completions.

    Attributes:
        scores: ``[N]`` float32, ``sum_i weights[i] * per_func[name_i]``.
        per_func: unweighted ``[N]`` float32 scores of each function, keyed by its unique name.
        errors: number of (function, sample) evaluations that raised and were scored 0.
        errors_per_func: the same count for each function.
        invalid: ``[N]`` bool, rows that some function scored NaN or inf (their scores are 0 here);
            ``None`` when there are none.
    """

    scores: torch.Tensor
    per_func: dict[str, torch.Tensor]
    errors: int = 0
    errors_per_func: dict[str, int] = field(default_factory=dict)
    invalid: torch.Tensor | None = None

    def metrics(self) -> dict[str, float]:
        """Flat scalars for a logger: ``reward/mean``, ``reward/<name>/mean``, ``reward/errors``..."""
        out = {"reward/mean": _mean(self.scores), "reward/std": _std(self.scores)}
        for name, values in self.per_func.items():
            out[f"reward/{name}/mean"] = _mean(values)
        out["reward/errors"] = float(self.errors)
        out["reward/non_finite_share"] = float(self.invalid.float().mean()) if self.invalid is not None else 0.0
        return out


def _mean(values: torch.Tensor) -> float:
    return values.mean().item() if values.numel() else 0.0


def _std(values: torch.Tensor) -> float:
    return values.std(unbiased=False).item() if values.numel() else 0.0


class RewardManager:
    """Evaluates ``reward_funcs`` on a batch and combines them with ``weights`` (default all 1).

    Args:
        reward_funcs: callables ``fn(completions: list[str], **fields) -> list[float]``.
        weights: one weight per function; ``None`` means 1.0 each.
    """

    def __init__(self, reward_funcs: Sequence[RewardFn], weights: Sequence[float] | None = None) -> None:
        if callable(reward_funcs):
            reward_funcs = [reward_funcs]
        reward_funcs = list(reward_funcs)
        if not reward_funcs:
            raise ValueError("RewardManager needs at least one reward function; got an empty list.")
        for fn in reward_funcs:
            if not callable(fn):
                raise TypeError(
                    f"Reward functions must be callables fn(completions, **fields) -> list[float]; got {fn!r}. "
                    "Use rltrainer.rewards.resolve_reward to turn a registered name into a function."
                )
        if weights is None:
            weights = [1.0] * len(reward_funcs)
        if len(weights) != len(reward_funcs):
            raise ValueError(
                f"Got {len(weights)} reward weights for {len(reward_funcs)} reward functions; "
                "pass one weight per function, or weights=None for all 1.0."
            )
        self.reward_funcs = reward_funcs
        self.weights = [float(w) for w in weights]
        self.names = _unique_names(reward_funcs)
        self._logged: set[str] = set()

    def __call__(self, completions: Sequence[str], fields: Mapping[str, Sequence[Any]] | None = None) -> RewardResult:
        """Score ``completions``; each value of ``fields`` is a sequence aligned with them."""
        completions = list(completions)
        n = len(completions)
        columns = {key: list(values) for key, values in (fields or {}).items()}
        for key, values in columns.items():
            if len(values) != n:
                raise ValueError(
                    f"Reward field {key!r} has {len(values)} values for {n} completions; "
                    "every field must be aligned with the completions."
                )
        total = torch.zeros(n, dtype=torch.float32)
        per_func: dict[str, torch.Tensor] = {}
        errors_per_func: dict[str, int] = {}
        invalid = torch.zeros(n, dtype=torch.bool)
        for fn, name, weight in zip(self.reward_funcs, self.names, self.weights):
            self._check_signature(fn, name, columns)
            values, errors = self._evaluate(fn, name, completions, columns)
            bad = self._non_finite(name, values)  # [N] bool
            values = values.masked_fill(bad, 0.0)
            per_func[name] = values  # [N]
            errors_per_func[name] = errors + int(bad.sum())
            invalid |= bad
            total += weight * values
        return RewardResult(total, per_func, sum(errors_per_func.values()), errors_per_func,
                            invalid if invalid.any() else None)

    def _non_finite(self, name: str, values: torch.Tensor) -> torch.Tensor:
        """``[N]`` bool: the scores of ``name`` that are NaN or inf, logged with their rows (every
        call: a reward that returns NaN is a bug to fix, not noise)."""
        bad = ~torch.isfinite(values)
        if bad.any():
            rows = bad.nonzero().flatten().tolist()
            logger.warning(
                "Reward function %r returned %d non-finite score(s) (%s) for rows %s of %d; they count in "
                "reward/errors, score 0, and are left out of the advantages. Make the function return a finite "
                "float for every completion (e.g. 0.0 when it cannot score one).",
                name, len(rows), sorted({str(values[i].item()) for i in rows}), rows[:20], len(values))
        return bad

    def _evaluate(
        self, fn: RewardFn, name: str, completions: list[str], columns: dict[str, list[Any]]
    ) -> tuple[torch.Tensor, int]:
        """Scores of one function on the batch, falling back to one call per sample if it raises."""
        try:
            result = fn(completions, **columns)
        except Exception:  # noqa: BLE001 - user code: find the failing samples below
            pass
        else:
            return self._checked(name, result, len(completions)), 0
        scores = torch.zeros(len(completions), dtype=torch.float32)
        errors = 0
        for i, completion in enumerate(completions):
            try:
                result = fn([completion], **{key: [values[i]] for key, values in columns.items()})
            except Exception as error:  # noqa: BLE001 - user code; the sample scores 0
                errors += 1
                if name not in self._logged:
                    self._logged.add(name)
                    logger.warning(
                        "Reward function %r raised on sample %d (scored 0; later failures of this "
                        "function are counted in RewardResult.errors but not logged): %r",
                        name, i, error, exc_info=error,
                    )
                continue
            scores[i] = self._checked(name, result, 1)[0]
        return scores, errors

    @staticmethod
    def _checked(name: str, result: Any, expected: int) -> torch.Tensor:
        """``result`` as a ``[expected]`` float32 tensor; raise if it is ``None`` or the wrong length."""
        if result is None:
            raise _RewardTypeError(
                f"Reward function {name!r} returned None; it must return a list of {expected} floats."
            )
        try:
            values = torch.as_tensor(
                result if isinstance(result, torch.Tensor) else [float(x) for x in result], dtype=torch.float32
            ).flatten()
        except (TypeError, ValueError) as error:
            raise _RewardTypeError(
                f"Reward function {name!r} returned {_preview(result)}, which is not a list of numbers: {error}"
            ) from error
        if values.numel() != expected:
            raise _RewardLengthError(
                f"Reward function {name!r} returned {values.numel()} scores ({_preview(result)}) for "
                f"{expected} completions; it must return exactly one score per completion."
            )
        return values

    @staticmethod
    def _check_signature(fn: RewardFn, name: str, columns: dict[str, list[Any]]) -> None:
        """Raise early if ``fn`` needs a field that is not in the batch or rejects extra fields."""
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # builtins and some C callables have no signature
            return
        try:
            signature.bind([], **columns)
        except TypeError as error:
            raise TypeError(
                f"Reward function {name!r} cannot be called as fn(completions, **fields) with fields "
                f"{sorted(columns)}: {error}. Reward functions take dataset columns as keyword "
                "arguments and must accept **kwargs for the ones they do not use."
            ) from error


class _RewardContractError(Exception):
    """A reward function broke its return contract: a bug to raise, not a sample to isolate."""


class _RewardTypeError(_RewardContractError, TypeError):
    """A reward function returned ``None`` or something that is not a list of numbers."""


class _RewardLengthError(_RewardContractError, ValueError):
    """A reward function returned the wrong number of scores."""


def _preview(result: Any, limit: int = 80) -> str:
    text = repr(result)
    return text if len(text) <= limit else text[: limit - 3] + "..."
