"""Token-in/token-out chat: the model's tokens are kept as sampled; only the environment's
messages are rendered with the chat template and tokenized, then appended.

Re-rendering the whole conversation each turn (``apply_chat_template(messages)``) would re-tokenize
the model's earlier turns: decoding and encoding again does not give back the sampled tokens in
general (a BPE merges differently), and templates rewrite past turns (Qwen3 drops the ``<think>``
block of every assistant turn before the last user message). The log-probs the engine reported
would then belong to other tokens. So the episode is a token list that only grows.

How the new messages are rendered: the template's text for ``base + messages`` (with the
generation prompt) minus its text for ``base`` alone, where ``base`` is one fixed user message;
preceded by what the template writes after the model's end-of-turn token (``"\\n"`` in ChatML),
or, when the model's turn stopped at the token limit, by the whole end of an assistant turn
(``"<|im_end|>\\n"``). The pieces are tokenized on their own: the template's special tokens
separate them, so that is the text's own tokenization.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

_BASE = [{"role": "user", "content": "\x00base\x00"}]
_PROBE = "\x00assistant\x00"


class ChatFormat:
    """Renders prompts and observations with ``tokenizer``'s chat template.

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        tools: the tools' JSON schemas, passed to the template for the first messages.
        template_kwargs: extra template variables (e.g. ``{"enable_thinking": False}`` for Qwen3).
    """

    def __init__(self, tokenizer: Any, tools: Sequence[dict[str, Any]] = (),
                 template_kwargs: dict[str, Any] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"Multi-turn rollouts render messages with the tokenizer's chat template, and this "
                             f"{type(tokenizer).__name__} has none. Set tokenizer.chat_template (a Jinja template, "
                             "e.g. ChatML) or use an instruct model's tokenizer.")
        self.tokenizer = tokenizer
        self.tools = list(tools) or None
        self.template_kwargs = dict(template_kwargs or {})
        self.separator, self.turn_end = self._turn_suffixes()
        self._cache: dict[str, list[int]] = {}

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool, tools: Any = None) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt, **self.template_kwargs)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def _turn_suffixes(self) -> tuple[str, str]:
        """What follows the model's end-of-turn token (``separator``) and the whole text after an
        assistant message's content (``turn_end``), read off the template."""
        text = self._render(_BASE + [{"role": "assistant", "content": _PROBE}], generation_prompt=False)
        if _PROBE not in text:
            raise ValueError("The chat template does not render an assistant message's content verbatim; multi-turn "
                             "rollouts need it to (ChatML-style templates do).")
        turn_end = text[text.rindex(_PROBE) + len(_PROBE):]
        eos = self.tokenizer.eos_token or ""
        separator = turn_end.split(eos, 1)[1] if eos and eos in turn_end else ""
        return separator, turn_end

    def prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        """The first messages (and the tools' schemas) with the generation prompt, as token ids."""
        key = json.dumps(["prompt", messages], sort_keys=True, default=str)
        cached = self._cache.get(key)
        if cached is None:
            cached = self._encode(self._render(messages, generation_prompt=True, tools=self.tools))
            if len(self._cache) < 4096:
                self._cache[key] = cached
        return list(cached)

    def observation(self, messages: list[dict[str, Any]], stopped: bool) -> list[int]:
        """Token ids to append after a model turn: the end of the turn (``stopped``: the model's
        end-of-turn token is already there), ``messages`` and the next generation prompt."""
        key = json.dumps([stopped, messages], sort_keys=True, default=str)
        cached = self._cache.get(key)
        if cached is None:
            head = self.separator if stopped else self.turn_end
            base = self._render(_BASE, generation_prompt=False)
            full = self._render(_BASE + messages, generation_prompt=True)
            if not full.startswith(base):
                raise ValueError("The chat template renders the conversation's start differently once more messages "
                                 "follow; rltrainer cannot append an observation's tokens to it.")
            cached = self._encode(head) + self._encode(full[len(base):]) if head else self._encode(full[len(base):])
            if len(self._cache) < 4096:
                self._cache[key] = cached
        return list(cached)
