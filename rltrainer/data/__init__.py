"""Batches and prompt datasets."""

from rltrainer.data.batch import RolloutBatch
from rltrainer.data.datamodule import DataModule, PromptDataModule
from rltrainer.data.datasets import load_rows, prepare_gsm8k, prepare_math500, prepare_prompts
from rltrainer.data.loader import collate_rows, prompt_dataloader

__all__ = ["DataModule", "PromptDataModule", "RolloutBatch", "collate_rows", "load_rows", "prepare_gsm8k",
           "prepare_math500", "prepare_prompts", "prompt_dataloader"]
