"""RemoteEngine: prompts split across replicas in order; a replica that spans several processes
(vLLM's tensor-parallel ranks under ``external_launcher``) gets the same prompts and seed on each
of them, and only its first rank's output is used."""

from __future__ import annotations

import pytest
import torch

from rltrainer.rollout.worker import Worker
from rltrainer.controller.worker_group import WorkerGroup
from rltrainer.rollout.engine import Generation, SamplingParams
from rltrainer.rollout.remote import RemoteEngine
from rltrainer.rollout.vllm import VLLMEngine


class Done:
    def __init__(self, value):
        self.value, self.error = value, None


class RecordingGroup:
    """A worker group whose ranks answer ``generate`` with their rank as every token."""

    name = "rollout"

    def __init__(self, world_size):
        self.world_size = world_size
        self.calls = {}

    def _call_async(self, ranks, method, per_rank):
        assert method == "generate"
        out = []
        for rank, ((prompts, sampling), _) in zip(ranks, per_rank):
            self.calls[rank] = ([list(p) for p in prompts], sampling.seed)
            n = len(prompts) * sampling.n
            ids = torch.full((n, 2), rank)
            out.append(Done(Generation(ids, torch.ones_like(ids), torch.zeros(n, 2), [str(rank)] * n,
                                       ["length"] * n, metrics={"gen_tokens": float(2 * n)})))
        return out

    def get(self, futures, method):
        return [f.value for f in futures]


class Tok:
    pad_token_id = 0


def test_replicas_spanning_two_processes_get_identical_calls():
    group = RecordingGroup(world_size=4)
    engine = RemoteEngine(group, Tok(), ranks_per_replica=2)
    assert engine.replicas == 2
    prompts = [[1], [2], [3]]
    gen = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=2, seed=10))
    assert group.calls[0] == group.calls[1] == ([[1], [2]], 10)  # replica 0: ranks 0 and 1
    assert group.calls[2] == group.calls[3] == ([[3]], 14)  # replica 1: ranks 2 and 3; its prompts start at 2
    assert gen.text == ["0"] * 4 + ["2"] * 2  # first rank of each replica, prompts in order
    assert gen.metrics["gen_tokens"] == 12.0  # counted once per replica


class SplitVersionGroup(RecordingGroup):
    """Ranks that generated with the weight versions ``versions`` (rank ``r``: ``versions[r]``)."""

    def __init__(self, versions):
        super().__init__(world_size=len(versions))
        self.versions = versions

    def _call_async(self, ranks, method, per_rank):
        out = super()._call_async(ranks, method, per_rank)
        for rank, done in zip(ranks, out):
            done.value.weight_version = self.versions[rank]
        return out


def test_a_replica_whose_ranks_generated_on_different_versions_raises():
    """Issue 43, item 2: a tensor-parallel replica's ranks hold shards of one model; a request that
    ran on shards of two versions (the ranks took a push and it in different orders) is an error,
    not a result tagged with the first rank's version."""
    engine = RemoteEngine(SplitVersionGroup([0, 1, 1, 1]), Tok(), ranks_per_replica=2)
    with pytest.raises(RuntimeError, match=r"ranks \[0, 1\] of one replica generated with weight versions \[0, 1\]"):
        engine.generate([[1], [2]], SamplingParams(n=1, max_new_tokens=2))
    gen = RemoteEngine(SplitVersionGroup([0, 0, 1, 1]), Tok(), ranks_per_replica=2).generate(
        [[1], [2]], SamplingParams(n=1, max_new_tokens=2))
    assert gen.weight_version == 0 and gen.row_weight_versions.tolist() == [0, 1]  # replicas may differ


def test_one_process_per_replica_splits_prompts_over_every_rank():
    group = RecordingGroup(world_size=2)
    gen = RemoteEngine(group, Tok()).generate([[1], [2], [3]], SamplingParams(n=1, max_new_tokens=2, seed=0))
    assert group.calls == {0: ([[1], [2]], 0), 1: ([[3]], 2)}
    assert gen.text == ["0", "0", "1"]


def test_replica_span_must_tile_the_group():
    with pytest.raises(ValueError, match="spanning 2 processes does not tile the 3 processes"):
        RemoteEngine(RecordingGroup(world_size=3), Tok(), ranks_per_replica=2)


def test_vllm_replica_spans_its_tensor_parallel_ranks():
    assert VLLMEngine(tensor_parallel_size=2).ranks_per_replica == 2  # no vLLM import needed to ask
    assert VLLMEngine().ranks_per_replica == 1


def test_replicas_seed_each_sample_as_one_engine_would():
    """With a seed, the replica whose share starts at prompt ``i`` gets ``seed + i * n``, so
    per-sample seeds (SGLang, vLLM: ``seed + i * n + j``) match one engine's and never repeat
    across replicas (``seed + replica`` gave replica 1's first sample replica 0's second seed)."""
    from rltrainer.rollout.sglang import sglang_requests

    group = RecordingGroup(world_size=3)
    prompts, sampling = [[1], [2], [3], [4], [5]], SamplingParams(n=2, max_new_tokens=2, seed=7)
    RemoteEngine(group, Tok()).generate(prompts, sampling)
    per_sample = []
    for rank in range(3):
        share, seed = group.calls[rank]
        per_sample += [p["sampling_seed"] for p in sglang_requests(share, SamplingParams(n=2, seed=seed), [2])[1]]
    one_engine = [p["sampling_seed"] for p in sglang_requests(prompts, sampling, [2])[1]]
    assert per_sample == one_engine == list(range(7, 17))


class SleepingGroup(WorkerGroup):
    """A worker group whose engines report (and reset) whether a sleep discarded their weights."""

    world_size = 2
    worker_cls = Worker

    def __init__(self, discarded):
        self.discarded, self.calls = list(discarded), []

    def _call_async(self, ranks, method, per_rank):
        args, _ = per_rank[0]
        self.calls.append((method, *args))
        if method == "take_weights_discarded" and args == ():
            answer, self.discarded = self.discarded, [False] * self.world_size
            return answer
        return [None] * len(ranks)

    def get(self, futures, method):
        return list(futures)


def test_remote_sleep_asks_the_replicas_at_level_2_only():
    group = SleepingGroup([False, True])
    engine = RemoteEngine(group, Tok())
    engine.sleep(1)
    assert group.calls == [("engine_sleep", 1)] and not engine.weights_discarded
    engine.sleep(2)
    assert group.calls[1:] == [("engine_sleep", 2), ("take_weights_discarded",)]
    assert engine.weights_discarded and engine.replica(1).weights_discarded  # views share it
    engine.replica(0).weights_discarded = False  # what the strategy does when it starts the full sync
    assert not engine.weights_discarded
