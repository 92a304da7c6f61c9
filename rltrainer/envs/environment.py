"""The ``Environment`` protocol: what a multi-turn task implements. The docstrings are the spec.

An episode: ``reset(row)`` gives the first messages; the model answers; if its turn holds tool
calls, each is dispatched to the environment's method of that name and the results go back as
``tool`` messages; otherwise ``step(text)`` gets the turn and returns the observation (more
messages), a reward and whether the episode is done. Repeat until done or a limit is hit
(:class:`~rltrainer.envs.MultiTurn`'s ``max_turns``, ``max_episode_tokens``).

A new environment object is made for every episode (``G`` per prompt), so it may keep state in
``self``. Its methods run in a controller thread; episodes of one batch run concurrently.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Message = dict[str, Any]  # {"role": "user" | "tool" | "system", "content": str}

#: Methods of an environment that are never tools.
RESERVED = frozenset({"reset", "step", "close", "tools"})


@dataclass
class StepResult:
    """What :meth:`Environment.step` returns.

    ``messages``: the observation, appended after the model's turn (a ``str`` is one ``user``
    message; ``[]``: none). ``reward``: this turn's reward; an episode's score is the sum over its
    turns (give it per turn, or only on the last). ``done``: the episode ends here (its observation
    is then not shown to the model). ``info``: anything to keep with the episode (not trained on).
    """

    messages: list[Message] | str = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Environment:
    """Base class for multi-turn environments (duck typing works too: any object with ``reset``
    and ``step``). Override :meth:`reset` and :meth:`step`; add tools as public methods.

    Tools: every public method other than ``reset``, ``step`` and ``close``, with type hints and a
    Google-style docstring (an ``Args:`` section), as TRL's ``environment_factory`` reads them. The
    JSON schema passed to the chat template is built from them (transformers'
    ``get_json_schema``). A tool returns a string (anything else is ``str()``-ed); if it raises,
    the model sees the error as the tool's result. Example::

        class Calculator(Environment):
            def reset(self, row):
                self.answer = row["answer"]
                return [{"role": "user", "content": row["question"]}]

            def add(self, a: int, b: int) -> str:
                \"\"\"Add two integers.

                Args:
                    a: the first number
                    b: the second number
                \"\"\"
                return str(a + b)

            def step(self, text):
                return StepResult(reward=float(text.strip() == self.answer), done=True)
    """

    def reset(self, row: Mapping[str, Any]) -> list[Message] | str:
        """Start an episode for the dataset ``row`` (its columns); return the first messages (a
        ``str`` is one ``user`` message). They are rendered with the tokenizer's chat template, the
        tools' schemas included, and a generation prompt. Required."""
        raise NotImplementedError

    def step(self, text: str) -> StepResult | tuple[Any, float, bool]:
        """The model's turn ``text`` (decoded, without its end-of-turn token; a turn holding tool
        calls goes to the tools instead). Return a :class:`StepResult`, or
        ``(messages, reward, done)``. Required."""
        raise NotImplementedError

    def close(self) -> None:
        """Called once when the episode ends (also after an error); free what it holds."""


def tool_methods(env: Any) -> dict[str, Callable[..., Any]]:
    """The environment's tools: its public bound methods except the reserved ones, by name."""
    base = set(dir(Environment))
    tools = {}
    for name in dir(type(env)):
        if name.startswith("_") or name in RESERVED or (isinstance(env, Environment) and name in base):
            continue
        member = getattr(env, name, None)
        if inspect.ismethod(member):
            tools[name] = member
    return tools


def tool_schemas(tools: Mapping[str, Callable[..., Any]]) -> list[dict[str, Any]]:
    """The JSON schemas of ``tools`` (for ``apply_chat_template(tools=...)``); raises, naming the
    tool, when its type hints or docstring are missing."""
    from transformers.utils import get_json_schema

    schemas = []
    for name, method in tools.items():
        try:
            schemas.append(get_json_schema(method))
        except Exception as exc:
            raise ValueError(
                f"Tool {name!r} ({getattr(method, '__qualname__', name)}) has no usable schema: {exc}. A tool needs "
                "type hints on every argument and a Google-style docstring with an 'Args:' section describing each; "
                "make it private (a leading '_') if it is not a tool.") from exc
    return schemas


def as_step_result(value: Any) -> StepResult:
    """:meth:`Environment.step`'s return value as a :class:`StepResult` (or a ``TypeError`` that
    says what was returned and what is allowed)."""
    if isinstance(value, StepResult):
        return value
    if isinstance(value, tuple) and len(value) in (3, 4):
        return StepResult(value[0], float(value[1]), bool(value[2]), dict(value[3]) if len(value) == 4 else {})
    raise TypeError(f"Environment.step returned {type(value).__name__} {value!r:.80}; return a StepResult(messages, "
                    "reward, done) or a tuple (messages, reward, done)")


def as_messages(value: Any, where: str) -> list[Message]:
    """Messages from ``reset`` / ``step`` / a tool: a ``str`` is one ``user`` message. The roles an
    environment may add are ``user``, ``tool`` and ``system`` (the assistant's turns are the model's
    own tokens, never re-rendered)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, Sequence) or not all(isinstance(m, Mapping) for m in value):
        raise TypeError(f"{where} returned {type(value).__name__} {value!r:.80}; return a str or a list of messages "
                        "({'role': ..., 'content': ...})")
    messages = [dict(m) for m in value]
    bad = [m.get("role") for m in messages if m.get("role") not in ("user", "tool", "system")]
    if bad:
        raise ValueError(f"{where} returned messages with roles {bad}; an environment adds 'user', 'tool' or 'system' "
                         "messages (the assistant's turns are the model's own tokens)")
    return messages


def check_environment(factory: Any) -> None:
    """Raise at construction if ``factory`` cannot make environments."""
    if not callable(factory):
        raise TypeError(f"environment must be a class or a zero-argument callable returning an environment; got "
                        f"{type(factory).__name__} {factory!r:.80}")
    target = factory if inspect.isclass(factory) else None
    if target is not None:
        missing = [m for m in ("reset", "step") if not callable(getattr(target, m, None))]
        if missing:
            raise TypeError(f"environment class {target.__name__} lacks {missing}; an environment has reset(row) and "
                            "step(text) (subclass rltrainer.envs.Environment)")
