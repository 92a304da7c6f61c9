"""Adapters from environments users already have to :class:`~rltrainer.envs.Environment`.

- :class:`GymText`: a Gymnasium-style environment whose observations and actions are text
  (``reset(seed=, options=) -> (obs, info)``, ``step(action) -> (obs, reward, terminated,
  truncated, info)``): a ``gymnasium.make`` id (gymnasium is then imported) or any factory.
- :class:`ReasoningGym`: a `reasoning-gym <https://github.com/open-thought/reasoning-gym>`_ task
  (Apache-2.0; procedural, offline: every question is generated from a seed): its rows, an
  environment that lets the model retry after a wrong answer, and a single-turn reward function.

Each is a picklable factory: ``MultiTurn(GymText("my-text-env-v0"))``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from rltrainer.envs.environment import Environment, StepResult


class GymText:
    """Makes :class:`GymTextEnvironment` episodes from ``make``: a Gymnasium id (``gymnasium.make(make,
    **make_kwargs)``) or a zero-argument callable returning a Gymnasium-style environment. The row's
    ``seed_field`` (if present) seeds ``reset``; the whole row is passed as ``options``."""

    def __init__(self, make: str | Callable[[], Any], seed_field: str = "seed", **make_kwargs: Any) -> None:
        if not isinstance(make, str) and not callable(make):
            raise TypeError(f"GymText(make=...) takes a gymnasium id or a zero-argument callable; got "
                            f"{type(make).__name__}")
        self.make, self.seed_field, self.make_kwargs = make, seed_field, make_kwargs
        self.__name__ = f"GymText({make if isinstance(make, str) else getattr(make, '__name__', 'env')})"

    def __call__(self) -> GymTextEnvironment:
        if isinstance(self.make, str):
            try:
                import gymnasium
            except ImportError as exc:
                raise ImportError(f"GymText({self.make!r}) makes the environment with gymnasium.make: pip install "
                                  "gymnasium (or pass a callable that builds the environment)") from exc
            return GymTextEnvironment(gymnasium.make(self.make, **self.make_kwargs), self.seed_field)
        return GymTextEnvironment(self.make(**self.make_kwargs), self.seed_field)


class GymTextEnvironment(Environment):
    """One Gymnasium-style environment as an :class:`Environment`: observations become ``user``
    messages, the model's turn is the action, ``terminated or truncated`` ends the episode."""

    def __init__(self, env: Any, seed_field: str = "seed") -> None:
        self.env, self.seed_field = env, seed_field

    def reset(self, row: Mapping[str, Any]) -> str:
        seed = row.get(self.seed_field)
        observation, _ = self.env.reset(seed=None if seed is None else int(seed), options=dict(row))
        return _text(observation, "reset")

    def step(self, text: str) -> StepResult:
        observation, reward, terminated, truncated, info = self.env.step(text)
        done = bool(terminated or truncated)
        return StepResult([] if done else _text(observation, "step"), float(reward), done, dict(info or {}))

    def close(self) -> None:
        self.env.close()


def _text(observation: Any, where: str) -> str:
    if not isinstance(observation, str):
        raise TypeError(f"The Gymnasium environment's {where} returned an observation of type "
                        f"{type(observation).__name__}; GymText needs text observations (str). Wrap the environment "
                        "to render its observation as text.")
    return observation


ANSWER = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
INSTRUCTION = "Give your final answer inside <answer></answer> tags."


def extract_answer(text: str) -> str:
    """The last ``<answer>...</answer>`` in ``text``, else the whole text (stripped)."""
    found = ANSWER.findall(text)
    return (found[-1] if found else text).strip()


class ReasoningGym:
    """A reasoning-gym task: ``reasoning_gym.create_dataset(name, size=size, seed=seed, **config)``.

    - :meth:`rows`: dataset rows (``question``, ``rg_index``) to train on.
    - As a factory (``MultiTurn(ReasoningGym("basic_arithmetic"), max_turns=3)``): episodes that ask
      the question and, after a wrong answer, say so and let the model try again, up to
      ``max_turns``. The reward is the task's score of the answer that ended the episode (its own
      verifier, ``score_answer``), given once; an episode that runs out of turns scores 0.
    - :meth:`reward`: the same verifier as a single-turn reward function
      (``GRPO(reward_funcs=task.reward)``), on rows from :meth:`rows`.

    ``dataset`` may be given instead of a name (any object with ``__len__``, ``__getitem__`` giving
    ``{"question", "answer", "metadata"}`` and ``score_answer(answer, entry)``).
    """

    def __init__(self, name: str | None = None, size: int = 500, seed: int = 0, dataset: Any = None,
                 instruction: str = INSTRUCTION, **config: Any) -> None:
        if dataset is None:
            if name is None:
                raise ValueError("ReasoningGym needs a task name (e.g. 'basic_arithmetic') or dataset=...")
            try:
                import reasoning_gym
            except ImportError as exc:
                raise ImportError("ReasoningGym needs reasoning-gym: pip install 'reasoning-gym==0.1.25' (Apache-2.0; "
                                  "it generates its tasks offline)") from exc
            dataset = reasoning_gym.create_dataset(name, size=size, seed=seed, **config)
        self.dataset, self.instruction = dataset, instruction
        self.__name__ = f"ReasoningGym({name or type(dataset).__name__})"

    def rows(self) -> list[dict[str, Any]]:
        return [{"question": self.dataset[i]["question"], "rg_index": i} for i in range(len(self.dataset))]

    def score(self, text: str, index: int) -> float:
        return float(self.dataset.score_answer(extract_answer(text), self.dataset[int(index)]))

    def reward(self, completions: list[str], rg_index: list[int], **kwargs: Any) -> list[float]:
        """The task's verifier on single-turn completions (rows from :meth:`rows`)."""
        return [self.score(text, index) for text, index in zip(completions, rg_index)]

    def __call__(self) -> ReasoningGymEnvironment:
        return ReasoningGymEnvironment(self)


class ReasoningGymEnvironment(Environment):
    """One question of a :class:`ReasoningGym` task; a wrong answer gets "not right, try again"."""

    def __init__(self, task: ReasoningGym) -> None:
        self.task = task

    def reset(self, row: Mapping[str, Any]) -> str:
        self.index = int(row["rg_index"])
        question = self.task.dataset[self.index]["question"]
        return f"{question}\n\n{self.task.instruction}" if self.task.instruction else question

    def step(self, text: str) -> StepResult:
        score = self.task.score(text, self.index)
        if score >= 1.0:
            return StepResult(reward=score, done=True)
        return StepResult("That is not right. Try again.", reward=0.0)
