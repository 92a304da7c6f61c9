"""``prompt_dataloader``: a shuffled epoch's order is a function of the seed and the epoch alone, so a
run resumed in epoch ``e`` reads the prompts the first run read there."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from rltrainer.data import prompt_dataloader


def ids(loader) -> list[int]:
    return [row[0] for batch in loader for row in batch.non_tensors["prompt_ids"]]


def test_an_epochs_order_does_not_depend_on_the_passes_before_it():
    rows = [{"prompt_ids": [i]} for i in range(10)]
    first = prompt_dataloader(rows, batch_size=4, drop_last=False)
    orders = [ids(first) for _ in range(3)]  # a plain for over the loader: the next epoch's order each time
    assert len({tuple(o) for o in orders}) == 3 and all(sorted(o) == list(range(10)) for o in orders)
    resumed = prompt_dataloader(rows, batch_size=4, drop_last=False)  # a new process, resumed in epoch 2
    resumed.sampler.set_epoch(2)  # as the Trainer does before each epoch
    assert ids(resumed) == orders[2]
    resumed.sampler.set_epoch(1)
    assert ids(resumed) == orders[1]


def test_orders_are_the_seeded_torch_loaders_and_leave_the_global_rng_alone():
    rows = [{"prompt_ids": [i]} for i in range(10)]
    loader = prompt_dataloader(rows, batch_size=4, drop_last=False, seed=3)
    plain = DataLoader(list(range(10)), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3),
                       collate_fn=lambda rows: rows)
    before = torch.random.get_rng_state()
    assert [ids(loader) for _ in range(3)] == [[i for b in plain for i in b] for _ in range(3)]
    assert torch.equal(torch.random.get_rng_state(), before)
    assert ids(prompt_dataloader(rows, batch_size=4, shuffle=False)) == list(range(8))  # drop_last
