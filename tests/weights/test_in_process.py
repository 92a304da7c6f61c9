"""The in-process transport: an ``hf`` engine in the controller, fed by the ``single`` strategy's
``export_weights``; changed-only, and the engine reports each sync's version."""

from __future__ import annotations

import torch

from rltrainer.rollout.hf import HFEngine
from rltrainer.rollout.rollout import Rollout
from rltrainer.strategies import SingleDeviceStrategy
from rltrainer.testing import FrozenEmbeddingGRPO, length_reward


def test_in_process_sync_sends_what_changed_and_sets_the_version(tiny_config, bpe_tokenizer):
    module = FrozenEmbeddingGRPO(tiny_config, bpe_tokenizer, reward_funcs=length_reward, num_generations=2)
    strategy = SingleDeviceStrategy(device="cpu")
    strategy.setup(module, seed=0)
    sync = Rollout(HFEngine()).connect(strategy, bpe_tokenizer)
    engine = sync.engine
    assert engine.weight_version == -1 and sync.version == 0
    handle = sync.transport.start(5)
    assert handle.done is False and engine.weight_version == 5  # in-process: loaded before start returns
    stats = handle.wait()
    names = strategy.weight_names()
    assert stats["tensors"] == len(names) and stats["skipped"] == 0 and stats["buckets"] == 1
    for name, p in module.policy.named_parameters():
        assert torch.equal(dict(engine.model.named_parameters())[name], p), name
    again = sync.push(mode="wait")  # nothing stepped: nothing sent, the version still moves
    assert again["sync/tensors"] == 0 and again["sync/skipped"] == len(names) and again["sync/buckets"] == 0
    assert engine.weight_version == sync.version == 0
    strategy.versions.bump(["model.norm.weight"])  # as an optimizer step would
    assert sync.push(9, mode="wait")["sync/tensors"] == 1 and engine.weight_version == 9
