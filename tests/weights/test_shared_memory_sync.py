"""Split placement's shared-memory transport on CPU (FSDP2 -> ``hf`` replicas on this node):
``"auto"`` picks it, a sync makes every replica equal the policy bit for bit and sends only what
changed, the engines report the sync's version (also for a sync with nothing to send), the
trainer side returns before the engines have loaded, and nothing is left in ``/dev/shm``."""

from __future__ import annotations

import glob

import pytest
import torch

from rltrainer import Trainer, prompt_dataloader
from rltrainer.rollout import SamplingParams
from rltrainer.rollout.hf import HFEngine
from rltrainer.rollout.rollout import Rollout
from rltrainer.strategies import FSDP2Strategy
from rltrainer.testing import FrozenEmbeddingGRPO, length_reward
from rltrainer.weights import SharedMemoryTransport

FROZEN = ["model.embed_tokens.weight"]


def make_module(config, tokenizer):
    return FrozenEmbeddingGRPO(config, tokenizer, reward_funcs=length_reward, num_generations=2, max_new_tokens=8,
                               lr=1e-2, kl_coef=0.05)


@pytest.mark.usefixtures("warm_ranks")  # ranks reuse warm processes (tests/conftest.py)
@pytest.mark.parametrize("devices", [1, 2])
def test_split_on_one_node_syncs_through_shared_memory(devices, tiny_config, bpe_tokenizer, gsm8k_prompts,
                                                       ray_session):
    """devices=1: trainer rank 0 is this process and copies each bucket into the slot; devices=2:
    both FSDP2 ranks map the slots and gather straight into them."""
    strategy = FSDP2Strategy(devices=devices, micro_batch_size=4)
    rollout = Rollout(placement="split", bucket_bytes=16 << 10)
    trainer = Trainer(strategy=strategy, rollout=rollout, max_steps=1, logger=False, enable_progress_bar=False, seed=3)
    with trainer:
        trainer.fit(make_module(tiny_config, bpe_tokenizer), prompt_dataloader(gsm8k_prompts, batch_size=2))
        transport = trainer.sync.transport
        assert isinstance(transport, SharedMemoryTransport)  # "auto", CPU, one node
        assert not glob.glob(f"/dev/shm/*{transport.tag}*")  # unlinked once mapped
        m = trainer.callback_metrics
        names = strategy.weight_names()
        assert m["sync/skipped"] == len(FROZEN) and m["sync/tensors"] == len(names) - len(FROZEN)
        assert m["sync/buckets"] > 2  # 16 KiB buckets: both slots reused
        full = dict(strategy.export_weights())
        assert m["sync/bytes"] == sum(t.numel() * t.element_size() for n, t in full.items() if n not in FROZEN)
        for name, tensor in rollout.group.execute_all("engine_weights")[0].items():
            assert torch.equal(tensor, full[name]), name

        again = trainer.sync.push(41, mode="wait")  # nothing changed: a commit only
        assert again["sync/buckets"] == 0 and again["sync/skipped"] == len(names)
        assert rollout.group.execute_all("engine_weight_version") == [41]
        assert trainer.engine.weight_version == 41 and trainer.sync.version == 41

        strategy.group.execute_all("forget_synced")  # every tensor again
        stats = trainer.sync.push(42, mode="wait")
        assert stats["sync/tensors"] == len(names) and stats["sync/gb_per_s"] > 0  # (bytes / seconds > 0)
        assert rollout.group.execute_all("engine_weight_version") == [42]
        assert trainer.engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2)).response_ids.shape[0] == 1
    assert not glob.glob(f"/dev/shm/*{transport.tag}*")


@pytest.mark.usefixtures("warm_ranks")  # ranks reuse warm processes (tests/conftest.py)
def test_shared_memory_start_returns_before_the_engines_load(tiny_config, bpe_tokenizer, ray_session):
    """One training rank in this process, 2 replicas: the transport's ``start`` returns with the load
    calls submitted; a ``generate`` sent right after asks for that version and generates with it
    (it waits for the sync to arrive), and ``wait`` reports the version in both replicas."""
    strategy = FSDP2Strategy(devices=1)
    rollout = Rollout(HFEngine(), placement="split", replicas=2, transport="shared_memory")
    try:
        strategy.setup(make_module(tiny_config, bpe_tokenizer), seed=0)
        sync = rollout.connect(strategy, bpe_tokenizer)
        engine = sync.engine
        assert engine.weight_version == -1
        handle = sync.transport.start(3)
        assert not handle.done  # one bucket: handed off, not waited for
        engine.weight_version = 3  # what the Trainer does once the push has started: requests ask for it
        generation = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=2))
        assert generation.weight_version == 3 and generation.row_weight_versions is None
        assert handle.wait()["buckets"] == 1 and engine.weight_version == 3
        assert rollout.group.execute_all("engine_weight_version") == [3, 3]
        expected = dict(strategy.export_weights())
        for weights in rollout.group.execute_all("engine_weights"):
            for name, tensor in expected.items():
                assert torch.equal(weights[name], tensor), name
    finally:
        rollout.teardown()
        strategy.teardown()
