"""Prompt dataloaders: batches of dataset rows as :class:`RolloutBatch` es."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader

from rltrainer.data.batch import RolloutBatch


def collate_rows(rows: Sequence[Mapping[str, Any]]) -> RolloutBatch:
    """Collate dataset rows (dicts) into a batch of non-tensor fields (``prompt_ids`` stays a list
    per row: prompts are padded only once the rollout knows the whole batch)."""
    return RolloutBatch.from_rows(list(rows))


def prompt_dataloader(dataset: Any, batch_size: int, shuffle: bool = True, seed: int = 0,
                      drop_last: bool = True) -> DataLoader:
    """A ``DataLoader`` of ``batch_size`` prompts per step over a map-style dataset (a HF
    ``datasets.Dataset`` or a list of dicts). Shuffling is seeded, so runs are reproducible."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if len(dataset) < batch_size and drop_last:
        raise ValueError(f"The dataset has {len(dataset)} rows, fewer than batch_size={batch_size}; "
                         "lower batch_size or pass drop_last=False")
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=generator,
                      collate_fn=collate_rows, drop_last=drop_last)
