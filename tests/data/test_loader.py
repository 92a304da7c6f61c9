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


def test_prompts_longer_than_the_models_positions_are_refused_at_setup(bpe_tokenizer, gsm8k_prompts, caplog):
    """They trained silently (RoPE has no hard limit): now fit says how many, the longest, and how to drop
    them before the first step; a prompt that leaves too few positions for its response is a warning."""
    import logging

    import pytest

    from rltrainer import GRPO, Callback, Trainer
    from rltrainer.data.datasets import filter_long_prompts
    from rltrainer.testing import length_reward, tiny_qwen2_config

    lengths = [len(row) for row in gsm8k_prompts["prompt_ids"]]
    positions = sorted(lengths)[len(lengths) // 2]
    over, longest = sum(n > positions for n in lengths), max(range(len(lengths)), key=lengths.__getitem__)

    class Steps(Callback):
        steps = 0

        def on_step_end(self, trainer, module, metrics):
            Steps.steps += 1

    def fit(prompts, max_new_tokens=4):
        config = tiny_qwen2_config(len(bpe_tokenizer), hidden_size=32, num_layers=1, max_positions=positions)
        module = GRPO(config, bpe_tokenizer, reward_funcs=length_reward, num_generations=2,
                      max_new_tokens=max_new_tokens)
        Trainer(max_steps=1, logger=False, enable_progress_bar=False, callbacks=[Steps()]).fit(
            module, prompt_dataloader(prompts, batch_size=2, shuffle=False))

    with pytest.raises(ValueError, match=rf"^{over} of the {len(lengths)} train prompts have more tokens than the "
                                         rf"model's max_position_embeddings \({positions}\): the longest, row "
                                         rf"{longest}, "
                                         rf"has {lengths[longest]}\. The model has no positions for them\. Drop them: "
                                         rf"PromptDataModule\(max_prompt_length={positions - 4}\) \(in a config: "
                                         r"data.max_prompt_length; .*\), which drops every prompt longer than that "
                                         r"and leaves max_new_tokens positions for the response; or train a model "
                                         r"with more positions\.$"):
        fit(gsm8k_prompts)
    assert Steps.steps == 0
    with caplog.at_level(logging.WARNING, logger="rltrainer.data.loader"):
        fit(filter_long_prompts(gsm8k_prompts, positions)[0])  # none over; the longest leave < 4 positions
    assert Steps.steps == 1
    assert "leave fewer than max_new_tokens=4 positions for the response" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rltrainer.data.loader"):
        fit(filter_long_prompts(gsm8k_prompts, positions - 4)[0])  # the fix the message gives
    assert Steps.steps == 2 and "positions" not in caplog.text
