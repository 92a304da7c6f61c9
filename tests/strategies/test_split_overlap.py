"""Split placement pushes beside generation (issue 30, item 10): with many buckets and a replica
busy in a slow request, the trainer's push hands every bucket off and returns while the request
is still generating; that request reports the old version, the next one the new; the broadcast
group's timeout is the strategy's ``weight_sync_timeout_s``."""

from __future__ import annotations

import time

import pytest
import torch

from rltrainer.controller import WorkerError
from rltrainer.rollout import SamplingParams
from rltrainer.rollout.hf import HFEngine
from rltrainer.strategies import FSDP2Strategy
from rltrainer.testing import FrozenEmbeddingGRPO, SlowHFEngine, length_reward
from rltrainer.weights.wire import bucket_entries

GENERATE_S = 8.0  # the slow request; the push must be handed off well within it


def make_module(config, tokenizer):
    return FrozenEmbeddingGRPO(config, tokenizer, reward_funcs=length_reward, num_generations=2, max_new_tokens=4)


class SlowEngine(HFEngine):
    """The ``hf`` engine; each ``generate`` notes its start in ``marker``, then sleeps ``seconds``."""

    def __init__(self, marker: str, seconds: float) -> None:
        super().__init__()
        self.marker, self.seconds = marker, seconds

    def generate(self, prompts, sampling):
        with open(self.marker, "a") as f:
            f.write("started\n")
        time.sleep(self.seconds)
        return super().generate(prompts, sampling)


def wait_for_lines(path, count: int, within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    while not (path.exists() and len(path.read_text().split()) >= count):
        assert time.monotonic() < deadline, f"no generate started within {within_s} s"
        time.sleep(0.05)


@pytest.mark.usefixtures("warm_ranks")  # ranks reuse warm processes (tests/conftest.py)
@pytest.mark.parametrize("transport", ["shared_memory", "object_store", "broadcast"])
def test_a_push_is_handed_off_while_the_replica_generates(transport, tiny_config, bpe_tokenizer, ray_session,
                                                          tmp_path):
    strategy = FSDP2Strategy(devices=1, rollout_placement="split", weight_transport=transport, bucket_bytes=4 << 10)
    marker = tmp_path / "generate.log"
    try:
        strategy.setup(make_module(tiny_config, bpe_tokenizer), seed=0)
        engine = strategy.connect_engine(SlowEngine(str(marker), GENERATE_S), bpe_tokenizer)
        strategy.sync_weights(engine, 0)
        engine.weight_version = 0
        sampling = SamplingParams(max_new_tokens=2)
        running = engine.generate_async([[1, 2, 3]], sampling)  # asks for version 0
        wait_for_lines(marker, 1)  # it is generating on the replica

        strategy.forget_synced()  # every weight again: a sync of many buckets
        start = time.perf_counter()
        handle = strategy.start_weight_sync(engine, 1)
        handed_off = time.perf_counter() - start
        assert not running.done(), f"the push waited for the request ({handed_off:.1f} s)"
        engine.weight_version = 1  # as the Trainer does once the push has started
        following = engine.generate_async([[4, 5]], sampling)  # asks for version 1

        assert running.result(timeout=60).weight_version == 0  # the whole request on the old weights
        stats = handle.wait()
        assert stats["buckets"] > 10 and stats["tensors"] == len(strategy.weight_names())
        assert following.result(timeout=60).weight_version == 1
        assert strategy.rollout_group.execute_all("engine_weight_version") == [1]
        loaded = strategy.rollout_group.execute_all("engine_weights")[0]
        for name, tensor in dict(strategy.export_weights()).items():
            assert torch.equal(loaded[name], tensor), name
        print(f"{transport}: {stats['buckets']:.0f} buckets handed off in {handed_off:.2f} s while generating")
    finally:
        strategy.teardown()


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
            strategy.rollout_group.remote.receive_bucket(entries, 1, 0, 1)  # no sender
        assert 2.0 < time.perf_counter() - start < 30
    finally:
        strategy.teardown()


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan"), "60", True])
def test_weight_sync_timeout_s_must_be_a_positive_number_of_seconds(value):
    with pytest.raises(ValueError, match=r"weight_sync_timeout_s must be a finite number of seconds > 0 .* got"):
        FSDP2Strategy(rollout_placement="split", weight_sync_timeout_s=value)
