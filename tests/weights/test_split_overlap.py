"""Split placement pushes beside generation (issue 30, item 10): with many buckets and a replica
busy in a slow request, the trainer's push hands every bucket off and returns while the request
is still generating; that request reports the old version, the next one the new; the broadcast
group's timeout is the rollout's ``sync_timeout_s``. A replica spanning two processes
(vLLM's tensor-parallel ranks) takes a request and a push sent from two controller threads in one
order on both ranks (issue 43, item 2)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rltrainer.controller import WorkerError
from rltrainer.rollout import SamplingParams
from rltrainer.rollout.hf import HFEngine
from rltrainer.rollout.rollout import Rollout
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
    marker = tmp_path / "generate.log"
    strategy = FSDP2Strategy(devices=1)
    rollout = Rollout(SlowEngine(str(marker), GENERATE_S), placement="split", transport=transport, bucket_bytes=4 << 10)
    try:
        strategy.setup(make_module(tiny_config, bpe_tokenizer), seed=0)
        sync = rollout.connect(strategy, bpe_tokenizer)
        engine = sync.engine
        sync.push(0, mode="wait")
        engine.weight_version = 0
        sampling = SamplingParams(max_new_tokens=2)
        running = engine.generate_async([[1, 2, 3]], sampling)  # asks for version 0
        wait_for_lines(marker, 1)  # it is generating on the replica

        strategy.forget_synced()  # every weight again: a sync of many buckets
        start = time.perf_counter()
        sync.push(1, mode="overlap")
        handed_off = time.perf_counter() - start
        assert not running.done(), f"the push waited for the request ({handed_off:.1f} s)"
        engine.weight_version = 1  # as the Trainer does once the push has started
        following = engine.generate_async([[4, 5]], sampling)  # asks for version 1

        assert running.result(timeout=60).weight_version == 0  # the whole request on the old weights
        stats = sync.wait()
        assert stats["sync/buckets"] > 10 and stats["sync/tensors"] == len(strategy.weight_names())
        assert following.result(timeout=60).weight_version == 1
        assert rollout.group.execute_all("engine_weight_version") == [1]
        loaded = rollout.group.execute_all("engine_weights")[0]
        for name, tensor in dict(strategy.export_weights()).items():
            assert torch.equal(loaded[name], tensor), name
        print(f"{transport}: {stats['sync/buckets']:.0f} buckets handed off in {handed_off:.2f} s while generating")
    finally:
        rollout.teardown()
        strategy.teardown()


@pytest.mark.usefixtures("warm_ranks")  # ranks reuse warm processes (tests/conftest.py)
def test_the_broadcast_group_takes_sync_timeout_s(tiny_config, bpe_tokenizer, ray_session):
    """Both ends build their group with the setting: trainer rank 0's group has it, and a replica
    waiting for a broadcast that never comes gives up after it, not after the default 600 s."""
    strategy = FSDP2Strategy(devices=1)
    rollout = Rollout(SlowHFEngine(delay_s=(0.0, 0.0)), placement="split", transport="broadcast", sync_timeout_s=3.0)
    try:
        strategy.setup(make_module(tiny_config, bpe_tokenizer), seed=0)
        sync = rollout.connect(strategy, bpe_tokenizer)
        assert sync.transport.timeout_s == 3.0
        assert strategy.group.worker.sender._group.timeout_s == 3.0  # rank 0 is this process (devices=1)
        entries = bucket_entries([("w", (4,), torch.float32)])
        start = time.perf_counter()
        with pytest.raises(WorkerError, match="rollout"):
            rollout.group.remote.receive_bucket(entries, 1, 0, 1)  # no sender
        assert 2.0 < time.perf_counter() - start < 30
    finally:
        rollout.teardown()
        strategy.teardown()


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan"), "60", True])
def test_sync_timeout_s_must_be_a_positive_number_of_seconds(value):
    with pytest.raises(ValueError, match=r"sync_timeout_s must be a number > 0 \(seconds .* got"):
        Rollout(placement="split", sync_timeout_s=value)


class TensorParallelEngine(HFEngine):
    """The ``hf`` engine as one rank of a replica spanning two processes, as vLLM's tensor-parallel
    ranks under ``external_launcher``: each request meets the other rank in an all-reduce (vLLM's
    TP all-reduce), and each rank logs, in ``{log_dir}/rank{r}.log``, every request with the weight
    version it ran on and every sync it loaded."""

    def __init__(self, log_dir: str) -> None:
        super().__init__()
        self.log_dir = log_dir

    @property
    def ranks_per_replica(self) -> int:
        return 2

    def _log(self, line: str) -> None:
        import torch.distributed as dist

        with open(f"{self.log_dir}/rank{dist.get_rank()}.log", "a") as f:
            f.write(line + "\n")

    def generate(self, prompts, sampling):
        import torch.distributed as dist

        self._log(f"generate v{self.weight_version}")
        dist.all_reduce(torch.zeros(1))  # the replica's ranks run each request together
        return super().generate(prompts, sampling)

    def finish_weight_update(self):
        self._log("load")
        return super().finish_weight_update()


class SubmitsSlowly:
    """Stands for rank 0's actor: after rank 0's ``generate`` is submitted, sets ``submitted`` and
    waits ``pause_s`` before the group goes on to rank 1 (a controller thread descheduled there)."""

    def __init__(self, actor, submitted: threading.Event, pause_s: float) -> None:
        self.actor, self.submitted, self.pause_s = actor, submitted, pause_s

    def __getattr__(self, method):
        handle = getattr(self.actor, method)
        if method != "generate":
            return handle
        outer = self

        class Slow:
            def remote(self, *args, **kwargs):
                ref = handle.remote(*args, **kwargs)
                outer.submitted.set()
                time.sleep(outer.pause_s)
                return ref

        return Slow()


def request_beside_a_push(strategy, rollout, sync):
    """Sync version 0; then send a request from a thread that pauses between submitting it to rank 0
    and to rank 1, and, meanwhile, start pushing version 1 from this thread (one_step_off's push
    beside async rollout, or a multi-turn episode's next turn); then one more request. Returns both
    results and, per request, the version each rank of the replica generated with."""
    engine = sync.engine
    sync.push(0, mode="wait")
    engine.weight_version = 0
    sampling = SamplingParams(max_new_tokens=2, seed=0)
    group, submitted, per_rank = rollout.group, threading.Event(), []
    get = group.get

    def recording_get(futures, method):
        out = get(futures, method)
        if method == "generate":
            per_rank.append([g.weight_version for g in out])
        return out

    group.get = recording_get
    group.actors = [SubmitsSlowly(group.actors[0], submitted, pause_s=1.0), *group.actors[1:]]
    sent = []
    request = threading.Thread(target=lambda: sent.append(engine.generate_async([[1, 2, 3]], sampling)))
    request.start()
    assert submitted.wait(60), "the request was not submitted"
    strategy.forget_synced()  # a sync that changes the weights on every rank
    sync.push(1, mode="overlap")  # while the request is half sent
    engine.weight_version = 1
    request.join(60)
    running = sent[0].result(timeout=120)
    sync.wait()
    return running, engine.generate([[4, 5]], sampling), per_rank


@pytest.mark.usefixtures("warm_ranks")  # ranks reuse warm processes (tests/conftest.py)
@pytest.mark.parametrize("transport", ["object_store", "broadcast"])
def test_a_tensor_parallel_replica_takes_a_request_and_a_push_in_one_order_on_every_rank(
        transport, tiny_config, bpe_tokenizer, ray_session, tmp_path):
    """Issue 43, item 2: a request and a push sent from two controller threads reach a replica's
    two ranks in the same order, even when the request's thread pauses between rank 0 and rank 1:
    both ranks run the request on the same weights, and it is tagged with them. Before, rank 1
    took the push first: the request ran on version 1 there and version 0 on rank 0, tagged 0
    (with NCCL's broadcast, rank 0 waits in the request's all-reduce, rank 1 in the broadcast: a hang)."""
    strategy = FSDP2Strategy(devices=1)
    rollout = Rollout(TensorParallelEngine(str(tmp_path)), placement="split", transport=transport, sync_timeout_s=30.0)
    try:
        strategy.setup(make_module(tiny_config, bpe_tokenizer), seed=0)
        sync = rollout.connect(strategy, bpe_tokenizer)
        assert rollout.group.world_size == 2 and sync.engine.replicas == 1
        running, following, per_rank = request_beside_a_push(strategy, rollout, sync)
        logs = [(tmp_path / f"rank{r}.log").read_text().split("\n")[:-1] for r in range(2)]
        assert logs[0] == logs[1], f"the replica's ranks took the calls in different orders: {logs}"
        assert logs[0] == ["load", "generate v0", "load", "generate v1"]
        assert per_rank == [[0, 0], [1, 1]]
        assert running.weight_version == 0 and following.weight_version == 1
    finally:
        rollout.teardown()
        strategy.teardown()


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("transport", ["object_store", "broadcast"])
def test_a_real_vllm_tensor_parallel_replica_takes_a_request_and_a_push_in_one_order(
        transport, bpe_tokenizer, vllm_python, ray_session):
    """The same with the real vLLM (the CPU build: TP=2 over gloo and vLLM's shared-memory
    all-reduce, about 20 s a case here). The second case also starts a TP=2 replica again on this
    node after the first one's processes were killed (the first left no shared-memory files)."""
    from rltrainer import VLLMEngine
    from rltrainer.testing import tiny_qwen2_config

    config = tiny_qwen2_config(len(bpe_tokenizer), hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1)
    strategy = FSDP2Strategy(devices=1)
    vllm = VLLMEngine(dtype=torch.float32, tensor_parallel_size=2, python=vllm_python)
    rollout = Rollout(vllm, placement="split", transport=transport, sync_timeout_s=60.0)
    try:
        strategy.setup(make_module(config, bpe_tokenizer), seed=0)
        sync = rollout.connect(strategy, bpe_tokenizer)
        running, following, per_rank = request_beside_a_push(strategy, rollout, sync)
        assert per_rank == [[0, 0], [1, 1]], f"the replica's ranks generated on versions {per_rank}"
        assert running.weight_version == 0 and following.weight_version == 1
        assert rollout.group.remote.engine_weight_version() == [1, 1]
    finally:
        rollout.teardown()
        strategy.teardown()
