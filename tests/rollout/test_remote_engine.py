"""RemoteEngine: prompts split across replicas in order; a replica that spans several processes
(vLLM's tensor-parallel ranks under ``external_launcher``) gets the same prompts and seed on each
of them, and only its first rank's output is used."""

from __future__ import annotations

import pytest
import torch

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
    assert group.calls[2] == group.calls[3] == ([[3]], 11)  # replica 1: ranks 2 and 3
    assert gen.text == ["0"] * 4 + ["2"] * 2  # first rank of each replica, prompts in order
    assert gen.metrics["gen_tokens"] == 12.0  # counted once per replica


def test_one_process_per_replica_splits_prompts_over_every_rank():
    group = RecordingGroup(world_size=2)
    gen = RemoteEngine(group, Tok()).generate([[1], [2], [3]], SamplingParams(n=1, max_new_tokens=2, seed=0))
    assert group.calls == {0: ([[1], [2]], 0), 1: ([[3]], 1)}
    assert gen.text == ["0", "0", "1"]


def test_replica_span_must_tile_the_group():
    with pytest.raises(ValueError, match="spanning 2 processes does not tile the 3 processes"):
        RemoteEngine(RecordingGroup(world_size=3), Tok(), ranks_per_replica=2)


def test_vllm_replica_spans_its_tensor_parallel_ranks():
    assert VLLMEngine(tensor_parallel_size=2).ranks_per_replica == 2  # no vLLM import needed to ask
    assert VLLMEngine().ranks_per_replica == 1
