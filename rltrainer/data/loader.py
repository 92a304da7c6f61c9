"""Prompt dataloaders: batches of dataset rows as :class:`RolloutBatch` es."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from rltrainer.data.batch import RolloutBatch
from rltrainer.values import check_int

log = logging.getLogger(__name__)


def collate_rows(rows: Sequence[Mapping[str, Any]]) -> RolloutBatch:
    """Collate dataset rows (dicts) into a batch of non-tensor fields (``prompt_ids`` stays a list
    per row: prompts are padded only once the rollout knows the whole batch)."""
    return RolloutBatch.from_rows(list(rows))


def prompt_dataloader(dataset: Any, batch_size: int, shuffle: bool = True, seed: int = 0,
                      drop_last: bool = True) -> DataLoader:
    """A ``DataLoader`` of ``batch_size`` prompts per step over a map-style dataset (a HF
    ``datasets.Dataset`` or a list of dicts). Shuffling is seeded, so runs are reproducible."""
    batch_size = check_int("batch_size", batch_size, at_least=1, meaning="prompts per step", owner="prompt_dataloader")
    seed = check_int("seed", seed, owner="prompt_dataloader")
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


def resolve_dataloaders(train: Any, val: Any, datamodule: Any, need_train: bool = True,
                        need_val: str = "") -> tuple[Any, Any]:
    """Take loaders directly or from a datamodule (anything with ``train_dataloader()``); ``need_val``:
    what needs validation prompts (``"validate()"``), which then raises if there are none."""
    if datamodule is not None:
        if train is not None or val is not None:
            raise ValueError("Pass either dataloaders or a datamodule, not both")
        train = datamodule.train_dataloader() if need_train else None
        val = datamodule.val_dataloader() if hasattr(datamodule, "val_dataloader") else None
    if need_train and train is None:
        raise ValueError("fit() needs train_dataloaders or a datamodule with train_dataloader()")
    if need_val and val is None:
        raise ValueError(f"{need_val} needs validation prompts, and none were given: pass val_dataloaders (or a "
                         "datamodule with val_dataloader(); command line: data.val_file).")
    return train, val


def estimate_training_steps(loader: Any, max_epochs: int | None, max_steps: int) -> int | None:
    """The training steps of a run over ``loader``: the fewer of ``max_epochs`` passes and
    ``max_steps`` (``-1``: no limit); ``None`` when neither bounds it (a loader without a length)."""
    try:
        per_epoch = len(loader)
    except TypeError:
        per_epoch = None
    by_epochs = per_epoch * max_epochs if per_epoch is not None and max_epochs else None
    candidates = [n for n in (by_epochs, max_steps if max_steps != -1 else None) if n is not None]
    return min(candidates) if candidates else None


def prompt_lengths(loader: Any) -> list[int] | None:
    """The token count of each prompt of a loader's dataset (its ``prompt_ids``), or ``None`` where it
    cannot be read without iterating the loader (an iterable dataset, rows without ``prompt_ids``)."""
    dataset = getattr(loader, "dataset", None)
    names = getattr(dataset, "column_names", None)
    if names is not None:  # a datasets.Dataset
        return [len(ids) for ids in dataset["prompt_ids"]] if "prompt_ids" in names else None
    if isinstance(dataset, Sequence) and len(dataset) and all(
            isinstance(row, Mapping) and "prompt_ids" in row for row in dataset):
        return [len(row["prompt_ids"]) for row in dataset]
    return None


def check_prompt_lengths(max_positions: int | None, max_new_tokens: int, **loaders: Any) -> None:
    """Before the first step: refuse prompts longer than the model's ``max_positions``
    (``max_position_embeddings``), with their count, the longest and how to drop them; warn when
    a prompt leaves fewer than ``max_new_tokens`` positions for its response. ``loaders`` by name
    (``train=...``, ``val=...``); one whose prompts cannot be read without iterating is skipped."""
    if not max_positions:
        return
    room = max_positions - max_new_tokens
    fix = (f"Drop them: PromptDataModule(max_prompt_length={room if room > 0 else max_positions}) (in a config: "
           f"data.max_prompt_length; in Python prepare_prompts(..., max_prompt_length=...)), which drops every "
           f"prompt longer than that{' and leaves max_new_tokens positions for the response' if room > 0 else ''}; "
           "or train a model with more positions.")
    for name, loader in loaders.items():
        lengths = prompt_lengths(loader) if loader is not None else None
        if not lengths:
            continue
        longest = max(range(len(lengths)), key=lengths.__getitem__)
        over = sum(n > max_positions for n in lengths)
        if over:
            raise ValueError(f"{over} of the {len(lengths)} {name} prompts have more tokens than the model's "
                             f"max_position_embeddings ({max_positions:,}): the longest, row {longest}, has "
                             f"{lengths[longest]:,}. The model has no positions for them. {fix}")
        cut = sum(n + max_new_tokens > max_positions for n in lengths)
        if cut:
            log.warning("%d of the %d %s prompts leave fewer than max_new_tokens=%d positions for the response (the "
                        "model's max_position_embeddings is %d; the longest prompt, row %d, has %d tokens): their "
                        "responses can run past the model's last position. %s", cut, len(lengths), name,
                        max_new_tokens, max_positions, longest, lengths[longest], fix)
