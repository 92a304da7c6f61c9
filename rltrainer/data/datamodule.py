"""``PromptDataModule``: prompt files to the train and validation dataloaders, for a config file.

The config-file CLI (:mod:`rltrainer.cli`) builds one from the ``data:`` section and hands it the
module's tokenizer; in Python, :func:`~rltrainer.data.prepare_gsm8k` and
:func:`~rltrainer.data.prompt_dataloader` do the same in two lines.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rltrainer.data.datasets import load_rows, prepare_gsm8k, prepare_math500
from rltrainer.data.loader import prompt_dataloader

#: ``format=`` names: how raw rows become prompt rows.
FORMATS: dict[str, Callable[..., Any]] = {"gsm8k": prepare_gsm8k, "math500": prepare_math500}


class PromptDataModule:
    """Prompt files (or Hub datasets) prepared with the module's tokenizer.

    Args:
        train_file: a ``.jsonl`` / ``.json`` / ``.parquet`` file, a folder, or a Hub dataset name
            (see :func:`~rltrainer.data.load_rows`).
        val_file: the same for validation (``None``: no validation).
        format: how a raw row becomes a prompt: ``"gsm8k"`` (``question`` / ``answer``) or
            ``"math500"`` (``problem`` / ``answer``).
        batch_size: prompts per training step (``B``).
        val_batch_size: prompts per validation batch (default: ``batch_size``).
        max_prompt_length: drop prompts with more tokens than this (``None``: keep all).
        limit_train_rows / limit_val_rows: use only the first N raw rows (``None``: all).
        seed: the training loader's shuffling seed.
    """

    def __init__(self, train_file: str, val_file: str | None = None, format: str = "gsm8k", batch_size: int = 8,
                 val_batch_size: int | None = None, max_prompt_length: int | None = 512,
                 limit_train_rows: int | None = None, limit_val_rows: int | None = None, seed: int = 0) -> None:
        if format not in FORMATS:
            raise ValueError(f"PromptDataModule(format={format!r}) is not a known format; choose from "
                             f"{', '.join(FORMATS)}, or build the dataloaders in Python and call Trainer.fit.")
        self.train_file, self.val_file, self.format = train_file, val_file, format
        self.batch_size, self.val_batch_size = batch_size, val_batch_size or batch_size
        self.max_prompt_length, self.seed = max_prompt_length, seed
        self.limit_train_rows, self.limit_val_rows = limit_train_rows, limit_val_rows
        self.tokenizer: Any = None

    def setup(self, tokenizer: Any) -> None:
        """Set the tokenizer the prompts are tokenised with (the module's)."""
        self.tokenizer = tokenizer

    def train_dataloader(self) -> Any:
        return prompt_dataloader(self._prepared(self.train_file, self.limit_train_rows), self.batch_size,
                                 seed=self.seed)

    def val_dataloader(self) -> Any:
        if self.val_file is None:
            return None
        return prompt_dataloader(self._prepared(self.val_file, self.limit_val_rows), self.val_batch_size,
                                 shuffle=False, drop_last=False)

    def _prepared(self, source: str, limit: int | None) -> Any:
        if self.tokenizer is None:
            raise RuntimeError("PromptDataModule.setup(tokenizer) must be called before its dataloaders are built")
        rows = load_rows(source)
        if limit is not None:
            rows = rows.select(range(min(limit, len(rows))))
        return FORMATS[self.format](rows, self.tokenizer, max_prompt_length=self.max_prompt_length)
