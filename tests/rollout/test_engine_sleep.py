"""Sleep, wake-up and the weight syncs around them (issue 12, items 2 and 3), with fakes that
do what SGLang 0.5.23 and vLLM 0.33.0 do (each cites the wheel's source it reproduces)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rltrainer.controller.watchdog import Watchdog
from rltrainer.rollout import SamplingParams
from rltrainer.rollout.rollout import Rollout
from rltrainer.rollout.sglang import SGLangEngine
from rltrainer.strategies import FSDP2Strategy, SingleDeviceStrategy
from rltrainer.testing import DiscardingHFEngine, FrozenEmbeddingGRPO, length_reward
from rltrainer.weights.sync import WeightSync
from rltrainer.weights.transports import InProcessTransport

ALL_TAGS = ["kv_cache", "weights", "cuda_graph"]  # sglang/srt/constants.py:6-10


class MemorySavingSGLang:
    """``sglang.Engine`` with ``enable_memory_saver``, as far as sleep and weight updates go.

    - ``release_memory_occupation(tags)``: no tags means all three
      (sglang/srt/managers/scheduler_components/weight_updater.py:343-346). Released weights keep no
      copy unless ``enable_weights_cpu_backup`` (model_runner_components/load_model_utils.py:307; off
      by default, arg_groups/fields/exec_.py:62-65): their memory comes back holding garbage (NaN here).
    - ``resume_memory_occupation(tags)``: ``self.offload_tags.remove(tag)`` (weight_updater.py:390)
      raises for a tag that was not released.
    - weights load only inside ``begin_weight_update`` / ``end_weight_update``, and (memory saver)
      only into resumed memory; generation needs everything resumed.
    """

    def __init__(self, cpu_backup: bool = False) -> None:
        self.cpu_backup, self.weights, self.released, self.calls, self.session = cpu_backup, {}, set(), [], False

    def release_memory_occupation(self, tags=None):
        tags = tags or ALL_TAGS
        self.calls.append(("release", sorted(tags)))
        self.released.update(tags)
        if "weights" in tags and not self.cpu_backup:
            self.weights = {n: torch.full_like(t, float("nan")) for n, t in self.weights.items()}

    def resume_memory_occupation(self, tags=None):
        tags = tags or ALL_TAGS
        self.calls.append(("resume", sorted(tags)))
        for tag in tags:
            self.released.remove(tag)

    def begin_weight_update(self):
        self.calls.append(("begin",))
        self.session = True
        return True, "Success"

    def end_weight_update(self):
        self.calls.append(("end",))
        self.session = False
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, flush_cache=False):
        self.calls.append(("update",))
        if not self.session or "weights" in self.released:
            return False, "outside a session, or into released memory"
        self.weights.update((n, t.clone()) for n, t in named_tensors)
        return True, "Success"

    def flush_cache(self):
        self.calls.append(("flush",))
        return True, "Success"

    def generate(self, input_ids, sampling_params, return_logprob):
        self.calls.append(("generate",))
        if self.released:
            raise RuntimeError(f"generate with {sorted(self.released)} released")
        garbage = sorted(n for n, t in self.weights.items() if torch.isnan(t).any())
        if garbage:
            raise RuntimeError(f"generate with garbage weights {garbage[:3]}")
        return [{"output_ids": [5], "text": "", "meta_info": {"output_token_logprobs": [(-1.0, 5, None)],
                                                               "finish_reason": {"type": "length"}}}
                for _ in input_ids]


@pytest.fixture
def sglang(monkeypatch):
    """An SGLangEngine on a :class:`MemorySavingSGLang`; ``torch.cuda.empty_cache`` is recorded."""

    def make(cpu_backup: bool = False) -> SGLangEngine:
        fake = MemorySavingSGLang(cpu_backup)
        monkeypatch.setattr("rltrainer.rollout.sglang.free_cached_blocks", lambda: fake.calls.append("empty_cache"))
        engine = SGLangEngine(engine_kwargs={"enable_weights_cpu_backup": True} if cpu_backup else None)
        engine.engine, engine.tokenizer = fake, SimpleNamespace(eos_token_id=2, pad_token_id=0)
        return engine

    return make


GREEDY = SamplingParams(max_new_tokens=1, temperature=0.0)


def test_sglang_wakes_weights_for_the_update_and_kv_cache_for_generation(sglang):
    """Issue 12.3: resume the weights alone for an update, the KV cache and CUDA graphs only for
    generation, and hand the trainer's cached blocks back before each."""
    engine = sglang()
    engine.update_weights([("w", torch.ones(4))])
    engine.sleep(2)
    engine.engine.calls.clear()
    engine.update_weights([("w", torch.ones(4))])
    engine.generate([[1]], GREEDY)
    assert engine.engine.calls == ["empty_cache", ("resume", ["weights"]), ("begin",), ("update",), ("end",),
                                   ("flush",), "empty_cache", ("resume", ["cuda_graph", "kv_cache"]), ("generate",)]
    engine.engine.calls.clear()
    engine.generate([[1]], GREEDY)  # awake: nothing to resume
    assert engine.engine.calls == [("generate",)]


def test_sglang_sleep_levels(sglang):
    """Level 1 keeps the weights; level 2 releases them and, with no CPU backup, says they are gone.
    With ``enable_weights_cpu_backup`` the released weights survive, so level 1 releases them too."""
    engine = sglang()
    engine.update_weights([("w", torch.ones(4))])
    engine.sleep(1)
    assert engine.engine.calls[-1] == ("release", ["cuda_graph", "kv_cache"]) and not engine.weights_discarded
    engine.engine.calls.clear()
    engine.update_weights([("w", torch.ones(4))])  # the weights never left: nothing to resume
    assert engine.engine.calls[:2] == [("begin",), ("update",)]
    engine.wake_up()
    engine.sleep(2)  # from awake: everything
    assert engine.engine.calls[-1] == ("release", ["cuda_graph", "kv_cache", "weights"]) and engine.weights_discarded
    engine.wake_up()
    engine.sleep(1)
    engine.sleep(2)  # KV cache already released: only the weights now
    assert engine.engine.calls[-1] == ("release", ["weights"])
    backed_up = sglang(cpu_backup=True)  # the weights survive in CPU memory: level 1 releases them too
    backed_up.update_weights([("w", torch.ones(4))])
    backed_up.sleep(1)
    assert backed_up.engine.calls[-1] == ("release", ["cuda_graph", "kv_cache", "weights"])
    assert not backed_up.weights_discarded
    backed_up.wake_up()
    backed_up.sleep(2)
    assert not backed_up.weights_discarded
    backed_up.generate([[1]], GREEDY)  # the fake restored them from its copy
    with pytest.raises(ValueError, match=r"SGLangEngine.sleep\(level=3\): level must be 1 .* or 2"):
        engine.sleep(3)


def test_after_a_sleep_that_discards_weights_the_next_sync_sends_every_weight(sglang, tiny_config, bpe_tokenizer):
    """Issue 12.2: a sync sends only the parameters changed since the last one, so a frozen
    embedding would stay garbage after SGLang released the weights."""
    module = FrozenEmbeddingGRPO(tiny_config, bpe_tokenizer, reward_funcs=length_reward, num_generations=2)
    strategy = SingleDeviceStrategy(device="cpu")
    strategy.setup(module, seed=0)
    engine = sglang()
    sync = WeightSync(engine, InProcessTransport(strategy, engine), strategy, Watchdog())  # set up already
    names = strategy.weight_names()
    assert sync.push(0, mode="wait")["sync/tensors"] == len(names)
    trainable = [n for n, p in module.policy.named_parameters() if p.requires_grad]
    assert 0 < len(trainable) < len(names)  # the embedding is frozen

    strategy.versions.bump(trainable)  # as an optimizer step would
    engine.sleep(1)
    assert sync.push(1, mode="wait")["sync/tensors"] == len(trainable)  # level 1 kept the rest
    engine.generate([[1]], GREEDY)

    strategy.versions.bump(trainable)
    engine.sleep(2)
    stats = sync.push(2, mode="wait")
    assert stats["sync/tensors"] == len(names) and stats["sync/skipped"] == 0 and not engine.weights_discarded
    engine.generate([[1]], GREEDY)  # no garbage left
    for name, p in module.policy.named_parameters():
        torch.testing.assert_close(engine.engine.weights[name], p.detach().to(torch.bfloat16), rtol=0, atol=0)
    assert sync.push(3, mode="wait")["sync/tensors"] == 0  # and back to sending what changed


def test_colocated_replicas_that_discarded_weights_get_every_weight(tiny_config, bpe_tokenizer):
    """The same through the worker group (FSDP2, one rank in process): the controller's
    ``RemoteEngine.sleep(2)`` asks the replicas, and the next sync re-sends everything."""
    module = FrozenEmbeddingGRPO(tiny_config, bpe_tokenizer, reward_funcs=length_reward, num_generations=2)
    strategy = FSDP2Strategy(devices=1)
    strategy.setup(module, seed=0)
    try:
        sync = Rollout(DiscardingHFEngine()).connect(strategy, bpe_tokenizer)
        engine = sync.engine
        names = strategy.weight_names()
        assert sync.push(0, mode="wait")["sync/tensors"] == len(names)
        engine.sleep(1)
        assert not engine.weights_discarded and sync.push(1, mode="wait")["sync/tensors"] == 0
        engine.sleep(2)
        assert engine.weights_discarded
        engine.wake_up()
        assert sync.push(2, mode="wait")["sync/tensors"] == len(names) and not engine.weights_discarded
        loaded = strategy.group.execute_all("engine_weights")[0]
        assert not any(torch.isnan(t).any() for t in loaded.values())
        assert sync.push(3, mode="wait")["sync/tensors"] == 0
    finally:
        strategy.teardown()


class RecordingLLM:
    def __init__(self, calls):
        self.calls = calls

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))


def test_vllm_level_2_discards_the_weights():
    """vLLM's level 2 keeps only buffers (vllm/v1/worker/gpu_worker.py:305-311): the next sync must
    send every weight. (Waking, vLLM's allocator empties the CUDA cache itself: cumem.py:342-343.)"""
    from rltrainer.rollout.vllm import VLLMEngine

    calls: list = []
    engine = VLLMEngine()
    engine.llm = RecordingLLM(calls)
    engine.sleep(1)
    assert not engine.weights_discarded
    engine.wake_up()
    engine.sleep(2)
    assert engine.weights_discarded
    engine.wake_up()
    assert calls == [("sleep", 1), ("wake_up", None), ("sleep", 2), ("wake_up", None)]
    with pytest.raises(ValueError, match=r"VLLMEngine.sleep\(level=0\)"):
        engine.sleep(0)


class LoadingLLM(RecordingLLM):
    """``vllm.LLM`` as ``VLLMEngine`` loads weights: one weight-transfer session per update
    (``start_weight_update``, ``update_weights`` per chunk, ``finish_weight_update``), then ``reset_prefix_cache``."""

    def start_weight_update(self):
        self.calls.append(("start",))

    def update_weights(self, request):
        self.calls.append(("load", [n for n, _ in request["update_info"]["weights"]]))

    def finish_weight_update(self):
        self.calls.append(("finish",))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


def test_vllm_wakes_the_weights_once_per_sleep_not_once_per_bucket():
    """Issue 30.13c: a sync calls ``update_weights`` once per bucket; each woke the weights again
    (``LLM.wake_up(tags=["weights"])``: a ``gc.collect``, a CUDA cache flush and a device sync in
    vllm/device_allocator/cumem.py and v1/worker/gpu_worker.py), since nothing recorded that they were awake."""
    from rltrainer.rollout.vllm import VLLMEngine

    calls: list = []
    engine = VLLMEngine()
    engine.llm = LoadingLLM(calls)
    engine._checkpoint = SimpleNamespace(convert=lambda weights: weights)  # setup's: names as they come
    engine.sleep(2)
    for i in range(3):  # three buckets of one sync
        engine.update_weights([(f"w{i}", torch.zeros(2))])
    engine.wake_up()  # generation wakes the rest: the KV cache
    assert [c for c in calls if c[0] in ("sleep", "wake_up")] == [("sleep", 2), ("wake_up", ["weights"]),
                                                                   ("wake_up", ["kv_cache"])]
    assert [c[1] for c in calls if c[0] == "load"] == [["w0"], ["w1"], ["w2"]]
    calls.clear()
    engine.sleep(1)  # the next sleep: the next sync wakes the weights again, once
    engine.update_weights([("w0", torch.zeros(2))])
    engine.update_weights([("w1", torch.zeros(2))])
    assert [c for c in calls if c[0] in ("sleep", "wake_up")] == [("sleep", 1), ("wake_up", ["weights"])]
    calls.clear()
    engine.wake_up()
    engine.update_weights([("w0", torch.zeros(2))])  # awake: nothing to wake
    assert calls == [("wake_up", ["kv_cache"]), ("start",), ("load", ["w0"]), ("finish",), ("reset_prefix_cache",)]
