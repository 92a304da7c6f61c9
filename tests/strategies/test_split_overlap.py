"""The weight broadcast group's timeout is the strategy's ``weight_sync_timeout_s`` (issue 30,
item 10): it reaches both ends of the group, and it is validated."""

from __future__ import annotations

import time

import pytest
import torch

from rltrainer.controller import WorkerError
from rltrainer.strategies import FSDP2Strategy
from rltrainer.testing import FrozenEmbeddingGRPO, SlowHFEngine, length_reward
from rltrainer.weights.wire import bucket_entries


def make_module(config, tokenizer):
    return FrozenEmbeddingGRPO(config, tokenizer, reward_funcs=length_reward, num_generations=2, max_new_tokens=4)


@pytest.mark.usefixtures("warm_ranks")  # ranks reuse warm processes (tests/conftest.py)
def test_the_broadcast_group_takes_weight_sync_timeout_s(tiny_config, bpe_tokenizer, ray_session):
    """Both ends build their group with the setting: trainer rank 0's group has it, and a replica
    waiting for a broadcast that never comes gives up after it, not after the default 600 s."""
    strategy = FSDP2Strategy(devices=1, rollout_placement="split", weight_transport="broadcast",
                             weight_sync_timeout_s=3.0)
    try:
        strategy.setup(make_module(tiny_config, bpe_tokenizer), seed=0)
        strategy.connect_engine(SlowHFEngine(delay_s=(0.0, 0.0)), bpe_tokenizer)
        assert strategy.transport.timeout_s == 3.0
        assert strategy.group.worker.sender._group.timeout_s == 3.0  # rank 0 is this process (devices=1)
        entries = bucket_entries([("w", (4,), torch.float32)])
        start = time.perf_counter()
        with pytest.raises(WorkerError, match="rollout"):
            strategy.rollout_group.execute_all("receive_weights", "receive", entries, 1)  # no sender
        assert 2.0 < time.perf_counter() - start < 30
    finally:
        strategy.teardown()


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan"), "60", True])
def test_weight_sync_timeout_s_must_be_a_positive_number_of_seconds(value):
    with pytest.raises(ValueError, match=r"weight_sync_timeout_s must be a finite number of seconds > 0 .* got"):
        FSDP2Strategy(rollout_placement="split", weight_sync_timeout_s=value)
