"""Prompt dataloaders: batches of dataset rows as :class:`RolloutBatch` es."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

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
    sampler = EpochShuffle(len(dataset), seed) if shuffle else None
    generator = torch.Generator().manual_seed(seed)  # the loader's own draws leave torch's global RNG alone
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, generator=generator,
                      collate_fn=collate_rows, drop_last=drop_last)


class EpochShuffle(Sampler[int]):
    """Dataset indices in a shuffled order that is a function of ``seed`` and the epoch alone, so a
    resumed run reads epoch ``e`` in the order the first run did (the Trainer calls
    :meth:`set_epoch`; a plain ``for`` over the loader moves to the next epoch's order by itself).
    The order is the one a ``DataLoader(shuffle=True)`` with a generator seeded with ``seed``
    gives on its ``e``-th pass, which depends on every pass before it."""

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed, self.epoch = size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed)
        for _ in range(self.epoch + 1):  # per pass: the loader's base seed, the order, the sampler's spare draw
            torch.empty((), dtype=torch.int64).random_(generator=generator)
            order = torch.randperm(self.size, generator=generator)
            torch.randperm(self.size, generator=generator)
        self.epoch += 1
        return iter(order.tolist())
