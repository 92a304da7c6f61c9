"""Tool calls in the model's text: parsed in the chat template's own format, dispatched to the
environment's methods, answered with ``tool`` messages.

Qwen2.5's and Qwen3's templates (and Hermes') ask for one JSON object per call inside
``<tool_call>...</tool_call>``: ``{"name": <function-name>, "arguments": <args-json-object>}``.
A call that cannot be parsed or run (bad JSON, an unknown tool, wrong arguments, a tool that
raises) is answered with an ``Error: ...`` tool message, which the model sees, and counted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rltrainer.registry import Registry

TOOL_PARSERS: Registry[Any] = Registry("tool-call parser")


@dataclass
class ToolCall:
    """One call: ``name`` and ``arguments``; or ``error`` (what was wrong with it) if malformed."""

    name: str = ""
    arguments: dict[str, Any] | None = None
    error: str | None = None


@TOOL_PARSERS.register("hermes")
class HermesToolParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as Qwen2.5's, Qwen3's and
    Hermes' chat templates render tool calls (``arguments`` may also be a JSON string)."""

    pattern = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> list[ToolCall]:
        """Every call in ``text`` (``[]``: the turn holds none)."""
        if "<tool_call>" not in text:
            return []
        return [self._call(body, closed=bool(end)) for body, end in self.pattern.findall(text)]

    @staticmethod
    def _call(body: str, closed: bool) -> ToolCall:
        if not closed:
            return ToolCall(error="the tool call was not closed with </tool_call>")
        try:
            data = json.loads(body.strip())
        except json.JSONDecodeError as exc:
            return ToolCall(error=f"the tool call is not valid JSON ({exc.msg} at position {exc.pos})")
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return ToolCall(error='a tool call is a JSON object {"name": <function-name>, "arguments": {...}}')
        arguments = data.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return ToolCall(name=data["name"], error="the arguments are a string that is not a JSON object")
        if not isinstance(arguments, dict):
            return ToolCall(name=data["name"], error="the arguments must be a JSON object")
        return ToolCall(name=data["name"], arguments=arguments)


def parser_for(tokenizer: Any, name: str | None) -> Any:
    """The parser named ``name``; ``None``: the one the tokenizer's chat template uses (Hermes
    ``<tool_call>`` for Qwen2.5 / Qwen3). Raises when the template has no tool-call format known here."""
    if name is not None:
        return TOOL_PARSERS.build(name)
    template = getattr(tokenizer, "chat_template", None) or ""
    if "<tool_call>" in template:
        return HermesToolParser()
    raise ValueError(f"The environment has tools, but the tokenizer's chat template ({type(tokenizer).__name__}) "
                     f"renders no tool-call format rltrainer knows (Hermes/Qwen '<tool_call>'). Pass "
                     f"MultiTurn(tool_parser=...) "
                     f"with one of {TOOL_PARSERS.names()} (or register one on rltrainer.envs.TOOL_PARSERS), or use a "
                     "tokenizer whose template supports tools (Qwen2.5, Qwen3).")


def run_tool(call: ToolCall, tools: Mapping[str, Callable[..., Any]]) -> tuple[str, bool]:
    """The tool message's content for ``call`` and whether the call failed."""
    if call.error is not None:
        return f"Error: {call.error}.", True
    tool = tools.get(call.name)
    if tool is None:
        return f"Error: there is no tool {call.name!r}; the tools are {sorted(tools)}.", True
    try:
        result = tool(**(call.arguments or {}))
    except TypeError as exc:  # wrong or missing arguments
        return f"Error: {call.name} was called with {call.arguments}: {exc}.", True
    except Exception as exc:  # the tool's own failure is the model's observation, not the run's
        return f"Error: {call.name} raised {type(exc).__name__}: {exc}.", True
    return result if isinstance(result, str) else str(result), False
