"""``PromptDataModule``: prompt files to the train and validation dataloaders, for a config file.

The config-file CLI (:mod:`rltrainer.cli`) builds one from the ``data:`` section and hands it the
module's tokenizer; in Python, :func:`~rltrainer.data.prepare_prompts` (or ``prepare_gsm8k``) and
:func:`~rltrainer.data.prompt_dataloader` do the same in two lines. Anything else with
``train_dataloader()`` (optionally ``val_dataloader()`` and ``setup(tokenizer)``) is a data module
too: :class:`DataModule` is that protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from rltrainer.data.datasets import load_rows, prepare_gsm8k, prepare_math500, prepare_prompts
from rltrainer.data.loader import prompt_dataloader
from rltrainer.values import check_int

#: ``format=`` names: how raw rows become prompt rows. ``"prompts"``: any rows, the prompt from
#: ``prompt_column`` (:func:`~rltrainer.data.prepare_prompts`).
FORMATS: dict[str, Callable[..., Any]] = {"prompts": prepare_prompts, "gsm8k": prepare_gsm8k,
                                          "math500": prepare_math500}


@runtime_checkable
class DataModule(Protocol):
    """What ``Trainer.fit(datamodule=...)`` and the CLI's ``data:`` take: ``train_dataloader()``;
    optionally ``val_dataloader()`` and ``setup(tokenizer)`` (the CLI calls it with the module's
    tokenizer before the loaders are built)."""

    def train_dataloader(self) -> Any: ...


class PromptDataModule:
    """Prompt files (or Hub datasets) prepared with the module's tokenizer.

    Args:
        train_file: a ``.jsonl`` / ``.json`` / ``.parquet`` file, a folder, or a Hub dataset name
            (see :func:`~rltrainer.data.load_rows`).
        val_file: the same for validation (``None``: no validation).
        format: how a raw row becomes a prompt: ``"prompts"`` (any columns: the prompt is
            ``prompt_column``, nothing is added to it unless ``instruction`` is set), ``"gsm8k"``
            (``question`` / ``answer``, adds GSM8K's instruction) or ``"math500"`` (``problem`` /
            ``answer``). Every column of a row reaches the reward functions as a keyword argument.
        prompt_column: ``"prompts"``: the column holding the prompt (a string, or a list of chat
            messages).
        instruction: text appended to each prompt after a space (``None``: the format's own: none
            for ``"prompts"``, the step-by-step instruction for ``"gsm8k"`` / ``"math500"``).
        system_prompt: a system message put first (``None``: none).
        use_chat_template: render prompts with the tokenizer's chat template when it has one
            (``False``: the plain text).
        batch_size: prompts per training step (``B``).
        val_batch_size: prompts per validation batch (default: ``batch_size``).
        max_prompt_length: drop prompts with more tokens than this (``None``: keep all).
        limit_train_rows / limit_val_rows: use only the first N raw rows (``None``: all).
        seed: the training loader's shuffling seed.
    """

    def __init__(self, train_file: str, val_file: str | None = None, format: str = "gsm8k",
                 prompt_column: str = "prompt", instruction: str | None = None, system_prompt: str | None = None,
                 use_chat_template: bool = True, batch_size: int = 8, val_batch_size: int | None = None,
                 max_prompt_length: int | None = 512, limit_train_rows: int | None = None,
                 limit_val_rows: int | None = None, seed: int = 0) -> None:
        if format not in FORMATS:
            raise ValueError(f"PromptDataModule(format={format!r}) is not a known format; choose from "
                             f"{', '.join(FORMATS)} ('prompts' with prompt_column= for your own columns), or "
                             "give data a class_path of your own data module.")
        if format != "prompts" and prompt_column != "prompt":
            raise ValueError(f"PromptDataModule(prompt_column={prompt_column!r}) is read by format='prompts' only; "
                             f"format={format!r} takes its prompt from its own column. Set format='prompts'.")
        for name, value, low, none in (
                ("batch_size", batch_size, 1, None), ("val_batch_size", val_batch_size, 1, "batch_size"),
                ("max_prompt_length", max_prompt_length, 1, "keep all"), ("seed", seed, None, None),
                ("limit_train_rows", limit_train_rows, 1, "all"), ("limit_val_rows", limit_val_rows, 1, "all")):
            check_int(name, value, at_least=low, none=none, owner="PromptDataModule")
        self.train_file, self.val_file, self.format = train_file, val_file, format
        self.prompt_column, self.instruction, self.system_prompt = prompt_column, instruction, system_prompt
        self.use_chat_template = use_chat_template
        self.batch_size, self.val_batch_size = batch_size, val_batch_size or batch_size
        self.max_prompt_length, self.seed = max_prompt_length, seed
        self.limit_train_rows, self.limit_val_rows = limit_train_rows, limit_val_rows
        self.tokenizer: Any = None
        self._datasets: dict[str, Any] = {}  # by split, prepared by setup()

    def setup(self, tokenizer: Any) -> None:
        """Prepare the prompts with ``tokenizer`` (the module's): a file that is not there, a column that
        is missing or a row that cannot be read is refused here (a ``ValueError`` naming the setting,
        from the error that says what is wrong), before any model is built."""
        self.tokenizer = tokenizer
        self._datasets = {"train": self._prepared("train_file", self.train_file, self.limit_train_rows),
                          "val": self._prepared("val_file", self.val_file, self.limit_val_rows)
                          if self.val_file is not None else None}

    def train_dataloader(self) -> Any:
        return prompt_dataloader(self._dataset("train"), self.batch_size, seed=self.seed)

    def val_dataloader(self) -> Any:
        if self.val_file is None:
            return None
        return prompt_dataloader(self._dataset("val"), self.val_batch_size, shuffle=False, drop_last=False)

    def _dataset(self, split: str) -> Any:
        if self.tokenizer is None:
            raise RuntimeError("PromptDataModule.setup(tokenizer) must be called before its dataloaders are built")
        return self._datasets[split]

    def _prepared(self, setting: str, source: str, limit: int | None) -> Any:
        options: dict[str, Any] = {"system_prompt": self.system_prompt, "use_chat_template": self.use_chat_template,
                                   "max_prompt_length": self.max_prompt_length}
        if self.format == "prompts":
            options["prompt_column"] = self.prompt_column
        if self.instruction is not None or self.format == "prompts":
            options["instruction"] = self.instruction
        try:
            rows = load_rows(source)
            if limit is not None:
                rows = rows.select(range(min(limit, len(rows))))
            return FORMATS[self.format](rows, self.tokenizer, **options)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:  # what load_rows and the formats raise
            raise ValueError(f"PromptDataModule({setting}={source!r}, format={self.format!r}): {exc}") from exc
