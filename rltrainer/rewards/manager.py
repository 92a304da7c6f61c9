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
A function that returns the wrong number of scores, or ``None``, is a bug and raises.

Slow rewards run in parallel (:mod:`rltrainer.rewards.parallel`): ``async def`` functions are
awaited sample by sample, ``max_concurrency`` at once; with ``num_workers > 0`` synchronous ones run
sample by sample in a pool of that many processes, all functions' samples queued at once. Under a
``timeout`` (seconds per sample) a sample that runs past it scores 0 and counts as an error. A
function that never returns is the Trainer's ``stage_timeout_s`` to catch (stage
``reward.reward_step``): the timeout names the function, and kills the pool it hangs in.

Per-token rewards: a function may return, for a completion, a list of numbers (one per response
token) instead of one number; ``per_func`` and ``scores`` hold their sums and ``token_scores`` the
weighted lists (see :class:`RewardResult`). Where the batch has ``completion_ids`` (the Trainer's
does), a list of another length is refused as soon as the function returns, naming it.

What counts as a number: ``int`` and ``float``, numpy's numbers and 0-d tensors (a 1-d one is a
per-token list), and ``bool`` (``True`` is 1.0, ``False`` 0.0: ``[answer == truth for ...]`` is a
correctness reward; numpy's ``bool_`` too). A string is refused, even ``"1"``: it is a bug
(a parsed answer returned instead of its score), not a score.

A non-finite score (NaN, inf) is caught where it enters: it counts in ``errors``, the rows are
logged with the function's name, and they are marked in ``invalid`` (GRPO leaves them out of the
advantages and the loss).
"""

from __future__ import annotations

import functools
import inspect
import logging
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rltrainer.controller.watchdog import doing
from rltrainer.rewards.parallel import RewardPool, RewardTimeout, is_async, run_async, sample_fields
from rltrainer.values import check_float, check_int

logger = logging.getLogger(__name__)

RewardFn = Callable[..., Sequence[Any]]
Value = float | list[float]  # one completion's reward: a number, or one number per response token


def reward_name(fn: Callable[..., Any]) -> str:
    """A display name: ``__name__``, the wrapped function's name for a ``functools.partial``,
    or the class name for a callable object."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", type(fn).__name__)


def reward_attribute(fn: Callable[..., Any], name: str, default: Any) -> Any:
    """``fn.<name>``, looked up through ``functools.partial`` wrappers (the outermost wins)."""
    while True:
        if name in getattr(fn, "__dict__", {}) or (not isinstance(fn, functools.partial) and hasattr(fn, name)):
            return getattr(fn, name)
        if not isinstance(fn, functools.partial):
            return default
        fn = fn.func


def reward_max_score(fn: Callable[..., Any]) -> float:
    """The score of a full-credit completion: the function's ``max_score`` attribute, default 1.0
    (set it on a function, or on a ``functools.partial`` of one, whose full credit is another value)."""
    return float(reward_attribute(fn, "max_score", 1.0))


def declares_correctness(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` scores ``max_score`` exactly when the answer is right (its ``correctness``
    attribute: the shipped ``gsm8k*`` and ``math`` rewards set it), so validation's ``val/accuracy``
    can count right answers even where other terms (a format bonus) add partial credit."""
    return bool(reward_attribute(fn, "correctness", False))


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
        errors: number of (function, sample) evaluations that raised (or timed out) and were scored 0.
        errors_per_func: the same count for each function.
        token_scores: with per-token rewards, each completion's weighted per-token list (the sum
            of the functions that returned a list for it; ``None`` for a completion none did),
            whose sum is part of ``scores``; ``None`` when no function returned lists.
        invalid: ``[N]`` bool, rows that some function scored NaN or inf (their scores are 0 here);
            ``None`` when there are none.
        non_finite_share: for each function, the share of rows it scored NaN or inf (0.0 for none).
    """

    scores: torch.Tensor
    per_func: dict[str, torch.Tensor]
    errors: int = 0
    errors_per_func: dict[str, int] = field(default_factory=dict)
    token_scores: list[list[float] | None] | None = None
    invalid: torch.Tensor | None = None
    non_finite_share: dict[str, float] = field(default_factory=dict)

    def token_level_scores(self, response_mask: torch.Tensor) -> torch.Tensor:
        """``[N, T]`` rewards on the response tokens whose row sums are ``scores``: a completion's
        per-token list on its first tokens (it must have one value per token of ``response_mask``),
        the rest of its score (the functions that returned one number) on its last token."""
        rewards = torch.zeros(response_mask.shape, dtype=torch.float32)
        lengths = response_mask.sum(-1).long().tolist()
        for i, (length, tokens) in enumerate(zip(lengths, self.token_scores or [None] * len(lengths))):
            rest = float(self.scores[i])
            if tokens is not None:
                if len(tokens) != length:
                    raise ValueError(
                        f"A reward function returned a list for completion {i} with {len(tokens)} value(s), "
                        f"{_preview(tokens)}, but its response has {length} tokens (response_mask). A reward is one "
                        f"number per completion (return [0.4, 0.7, ...], not a list each) or, for per-token "
                        f"rewards, a list of one number per response token.")
                rewards[i, :length] = torch.tensor(tokens, dtype=torch.float32)
                rest -= float(sum(tokens))
            if length:
                rewards[i, length - 1] += rest
        return rewards * response_mask.to(rewards.dtype)

    def metrics(self) -> dict[str, float]:
        """Flat scalars for a logger: ``reward/mean``, ``reward/<name>/mean``, ``reward/errors``..."""
        out = {"reward/mean": _mean(self.scores), "reward/std": _std(self.scores)}
        for name, values in self.per_func.items():
            out[f"reward/{name}/mean"] = _mean(values)
        out["reward/errors"] = float(self.errors)
        out["reward/non_finite_share"] = float(self.invalid.float().mean()) if self.invalid is not None else 0.0
        for name, share in self.non_finite_share.items():  # which function's NaN/inf rows those were
            out[f"reward/{name}/non_finite_share"] = share
        return out


def _mean(values: torch.Tensor) -> float:
    return values.mean().item() if values.numel() else 0.0


def _std(values: torch.Tensor) -> float:
    return values.std(unbiased=False).item() if values.numel() else 0.0


class RewardManager:
    """Evaluates ``reward_funcs`` on a batch and combines them with ``weights`` (default all 1).

    Args:
        reward_funcs: callables ``fn(completions: list[str], **fields) -> list[float]`` (or a list
            of per-token lists), plain or ``async def``.
        weights: one weight per function; ``None`` means 1.0 each.
        num_workers: run synchronous functions in a pool of this many processes (``0``: in this
            process, one function after another). Functions travel to the pool by value.
        timeout: seconds a sample may take (async functions, or with ``num_workers > 0``); past it
            the sample scores 0 and counts in ``errors``. ``None``: no limit.
        max_concurrency: async functions: samples awaited at once.
    """

    def __init__(self, reward_funcs: Sequence[RewardFn], weights: Sequence[float] | None = None,
                 num_workers: int = 0, timeout: float | None = None, max_concurrency: int = 64) -> None:
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
        weights = [check_float(f"weights[{i}]", w, meaning="a reward's weight") for i, w in enumerate(weights)]
        num_workers = check_int("num_workers", num_workers, at_least=0, meaning="reward processes; 0: in this process")
        timeout = check_float("timeout", timeout, above=0, none="no limit", meaning="seconds per sample")
        max_concurrency = check_int("max_concurrency", max_concurrency, at_least=1,
                                    meaning="async samples awaited at once")
        untimed = [reward_name(fn) for fn in reward_funcs if not is_async(fn)]
        if timeout is not None and num_workers == 0 and untimed:
            raise ValueError(f"timeout={timeout} needs num_workers > 0 for the synchronous reward functions {untimed}: "
                             "a call in this process cannot be interrupted. Set num_workers (a process pool), make "
                             "them async def, or leave timeout=None.")
        self.reward_funcs = reward_funcs
        self.weights = weights
        self.names = _unique_names(reward_funcs)
        self.timeout, self.max_concurrency = timeout, max_concurrency
        self.pool = RewardPool(num_workers, timeout) if num_workers else None
        self._logged: set[str] = set()

    @property
    def max_score(self) -> float:
        """The weighted score of a completion every function gives full credit (``sum w * max_score``;
        a negative weight's best is taken as 0)."""
        return sum(max(w * reward_max_score(fn), 0.0) for fn, w in zip(self.reward_funcs, self.weights))

    def close(self) -> None:
        """Stop the reward processes (if any)."""
        if self.pool is not None:
            self.pool.close()

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
        for fn, name in zip(self.reward_funcs, self.names):
            self._check_signature(fn, name, columns)
        pending, queued = {}, 0
        if self.pool is not None:  # every synchronous function's samples queued at once
            for fn, name in zip(self.reward_funcs, self.names):
                if not is_async(fn):
                    pending[name] = (self.pool.submit(fn, completions, columns), queued)
                    queued += n
        total = torch.zeros(n, dtype=torch.float32)
        per_func: dict[str, torch.Tensor] = {}
        errors_per_func: dict[str, int] = {}
        tokens: list[list[float] | None] = [None] * n
        invalid = torch.zeros(n, dtype=torch.bool)
        non_finite: dict[str, float] = {}
        for fn, name, weight in zip(self.reward_funcs, self.names, self.weights):
            pooled = name in pending
            with doing(f"reward function {name!r}" + (f" (in a pool of {self.pool.num_workers} processes, killed)"
                                                      if pooled else ""), self.pool.close if pooled else None):
                if is_async(fn):
                    outcomes = run_async(fn, completions, columns, self.timeout, self.max_concurrency)
                elif pooled:
                    outcomes = self.pool.collect(*pending[name])
                else:
                    outcomes = self._evaluate(fn, name, completions, columns)
            values, errors = self._collect(name, outcomes)
            if "completion_ids" in columns:  # per-token lists: one value per response token, checked now
                _check_token_lists(name, values, columns["completion_ids"])
            scores = torch.tensor([_total(v) for v in values], dtype=torch.float32)  # [N]
            bad = self._non_finite(name, scores)  # [N] bool
            per_func[name] = scores.masked_fill(bad, 0.0)
            errors_per_func[name] = errors + int(bad.sum())
            invalid |= bad
            non_finite[name] = float(bad.float().mean()) if n else 0.0
            total += weight * per_func[name]
            _add_tokens(tokens, values, weight, name)
        token_scores = tokens if any(t is not None for t in tokens) else None
        return RewardResult(total, per_func, sum(errors_per_func.values()), errors_per_func, token_scores,
                            invalid if invalid.any() else None, non_finite)

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

    def _evaluate(self, fn: RewardFn, name: str, completions: list[str], columns: dict[str, list[Any]]) -> list[Any]:
        """In this process: one call on the batch (a list per sample, each in a one-element list),
        or, if it raises, one call per sample (the outcome is then the sample's result or error)."""
        try:
            result = fn(completions, **columns)
        except Exception:  # noqa: BLE001 - user code: find the failing samples below
            pass
        else:
            return [[value] for value in self._checked(name, result, len(completions))]
        outcomes: list[Any] = []
        for i, completion in enumerate(completions):
            try:
                outcomes.append(fn([completion], **sample_fields(columns, i)))
            except Exception as error:  # noqa: BLE001 - user code; the sample scores 0
                outcomes.append(error)
        return outcomes

    def _collect(self, name: str, outcomes: list[Any]) -> tuple[list[Value], int]:
        """Per-sample values from per-sample outcomes (a one-element result, or the exception): an
        error scores 0, is counted, and the function's first one is logged."""
        values: list[Value] = []
        errors = 0
        for i, outcome in enumerate(outcomes):
            if isinstance(outcome, BaseException):
                errors += 1
                values.append(0.0)
                if name not in self._logged:
                    self._logged.add(name)
                    what = "timed out" if isinstance(outcome, RewardTimeout) else "raised"
                    logger.warning(
                        "Reward function %r %s on sample %d (scored 0; later failures of this function are "
                        "counted in RewardResult.errors but not logged): %r", name, what, i, outcome, exc_info=outcome)
                continue
            values.append(self._checked(name, outcome, 1)[0])
        return values, errors

    @staticmethod
    def _checked(name: str, result: Any, expected: int) -> list[Value]:
        """``result`` as ``expected`` values (a number, or a list of numbers per token, each); raise
        if it is ``None``, not numbers, or the wrong length."""
        if result is None:
            raise _RewardTypeError(
                f"Reward function {name!r} returned None; it must return a list of {expected} floats."
            )
        try:
            values = [_value(x) for x in _as_list(result, expected)]
        except (TypeError, ValueError) as error:
            raise _RewardTypeError(
                f"Reward function {name!r} returned {_preview(result)}, which is not a list of numbers (or of "
                f"per-token lists of numbers): {error}"
            ) from error
        if len(values) != expected:
            raise _RewardLengthError(
                f"Reward function {name!r} returned {len(values)} scores ({_preview(result)}) for "
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


def _as_list(result: Any, expected: int) -> list[Any]:
    """A function's result as a list of per-completion entries (a tensor of ``expected`` rows too)."""
    if isinstance(result, torch.Tensor):
        return list(result.flatten()) if result.dim() <= 1 else list(result)
    if isinstance(result, (str, bytes)) or not hasattr(result, "__len__"):
        raise _RewardTypeError(f"expected a list of {expected} scores, got {type(result).__name__} {_preview(result)}")
    return list(result)


def _value(x: Any) -> Value:
    """One completion's reward: a float, or a list of floats (per token); see the module docstring
    for what counts as a number."""
    if isinstance(x, torch.Tensor):
        return _number(x) if x.dim() == 0 else [_number(v) for v in x.flatten()]
    if isinstance(x, (list, tuple)) or getattr(x, "ndim", 0) >= 1:  # a numpy array: per token
        return [_number(v) for v in x]
    return _number(x)


def _number(x: Any) -> float:
    """``x`` as a float if it is a number (a bool, numpy's, a 0-d tensor or array included)."""
    numeric = isinstance(x, numbers.Real) or (getattr(x, "shape", None) == () and getattr(
        getattr(x, "dtype", None), "kind", "") in "biuf" and not isinstance(x, (str, bytes)))
    if not numeric or isinstance(x, (str, bytes)):
        raise TypeError(f"{x!r} is a {type(x).__name__}, not a number; return float(...) of the score (a string is "
                        f"refused, even {'1'!r}: it is a parsed answer, not a score)")
    return float(x)


def _check_token_lists(name: str, values: list[Value], completion_ids: Sequence[Sequence[int]]) -> None:
    """Raise if a per-token list of ``name`` does not have one value per response token."""
    for i, (value, ids) in enumerate(zip(values, completion_ids)):
        if isinstance(value, list) and len(value) != len(ids):
            lists = [v for v in values if isinstance(v, list)]
            raise _RewardLengthError(
                f"Reward function {name!r} returned a list for completion {i} with {len(value)} value(s), "
                f"{_preview(value)}, but its response has {len(ids)} tokens (completion_ids[{i}]); "
                f"it returned {_preview(lists, 120)} for the batch. A reward is one number per completion "
                f"(return [0.4, 0.7, ...]; if each list holds that number, return [x[0] for x in ...]) or, for "
                f"per-token rewards, a list of len(completion_ids[i]) numbers per completion.")


def _total(value: Value) -> float:
    return float(sum(value)) if isinstance(value, list) else value


def _add_tokens(tokens: list[list[float] | None], values: list[Value], weight: float, name: str) -> None:
    """Add ``weight x`` each per-token list of ``values`` into ``tokens`` (lists of one completion
    must have one length)."""
    for i, value in enumerate(values):
        if not isinstance(value, list):
            continue
        if tokens[i] is None:
            tokens[i] = [weight * v for v in value]
        elif len(tokens[i]) != len(value):
            raise _RewardLengthError(f"Reward function {name!r} returned {len(value)} per-token rewards for completion "
                                     f"{i}, another function {len(tokens[i])}; per-token lists need one value per "
                                     "response token.")
        else:
            tokens[i] = [t + weight * v for t, v in zip(tokens[i], value)]


class _RewardContractError(Exception):
    """A reward function broke its return contract: a bug to raise, not a sample to isolate."""


class _RewardTypeError(_RewardContractError, TypeError):
    """A reward function returned ``None`` or something that is not a list of numbers."""


class _RewardLengthError(_RewardContractError, ValueError):
    """A reward function returned the wrong number of scores."""


def _preview(result: Any, limit: int = 80) -> str:
    text = repr(result)
    return text if len(text) <= limit else text[: limit - 3] + "..."
