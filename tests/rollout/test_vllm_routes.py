"""Routed experts from vLLM, without vLLM: the CPU build's recorder (a fake model runner driving its
forward wrapper: requests split across steps, ``n`` samples, decode steps, a preempted request
recomputed), vLLM's own ``CompletionOutput.routed_experts`` padded to the contract, and the
platform's choice of path. The real engine: test_vllm_families.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rltrainer.rollout.vllm import VLLMEngine, VLLMPlatform
from rltrainer.rollout.vllm_routes import RouteRecorder, completion_routes, padded

L, K, E = 3, 2, 8  # layer 0 dense, layers 1 and 2 mixtures of experts
MOE_LAYERS = [1, 2]


def expert(request: str, position: int, layer: int, salt: int = 0) -> list[int]:
    """The experts the fake model routes a token to: a function of where it is."""
    first = (hash(request) % 5 + 3 * position + layer + salt) % E
    return [first, (first + 1) % E]


class FakeRunner:
    """vLLM's V1 model runner as the recorder reads it: ``input_batch.req_ids`` / ``num_reqs``,
    ``query_start_loc.np``, and a ``_model_forward(input_ids=..., positions=...)``."""

    def __init__(self, recorder: RouteRecorder) -> None:
        self.recorder = recorder
        self.input_batch = SimpleNamespace(req_ids=[], num_reqs=0)
        self.query_start_loc = SimpleNamespace(np=np.zeros(16, dtype=np.int32))
        self.salt = 0

    def step(self, scheduled: list[tuple[str, int, int]]) -> None:
        """One forward over ``(request id, first position, tokens)``, as the runner lays it out
        (one padding row at the end, as CUDA graphs pad)."""
        self.input_batch.req_ids = [r for r, _, _ in scheduled] + ["stale"]
        self.input_batch.num_reqs = len(scheduled)
        starts = np.cumsum([0] + [n for _, _, n in scheduled])
        self.query_start_loc.np[: len(starts)] = starts
        positions = torch.tensor([p + i for _, p, n in scheduled for i in range(n)] + [0])

        def forward(input_ids=None, positions=None):
            for layer in MOE_LAYERS:
                ids = [expert(r, p + i, layer, self.salt) for r, p, n in scheduled for i in range(n)] + [[0, 0]]
                self.recorder._capture(layer, torch.tensor(ids, dtype=torch.int64))
            return "hidden"

        assert self.recorder._forward(self, forward, input_ids=None, positions=positions) == "hidden"


class FakeProcessor:
    def __init__(self):
        self.added = []

    def add_request(self, request, prompt, parent_req=None, request_index=0, queue=None):
        self.added.append(request.request_id)


def completion(index: int, tokens: int):
    return SimpleNamespace(index=index, token_ids=list(range(tokens)), routed_experts=None)


def test_the_recorder_maps_every_token_row_to_its_request_and_position():
    recorder = RouteRecorder(L, K)
    recorder.moe_layers = MOE_LAYERS
    runner, processor = FakeRunner(recorder), FakeProcessor()
    recorder.watch_requests(processor)
    recorder.begin()
    # two prompts (5 and 3 tokens), n = 2: vLLM's request ids carry the sample index and a suffix
    ids = {("a", 0): "0_a-x1", ("a", 1): "1_a-x1", ("b", 0): "0_b-y2", ("b", 1): "1_b-y2"}
    for (external, index), request_id in ids.items():
        processor.add_request(SimpleNamespace(request_id=request_id, external_req_id=external), None, None, index)
    a0, a1, b0, b1 = ids.values()
    runner.step([(a0, 0, 5), (a1, 0, 5)])  # a's prompt, twice; b waits for the next step
    runner.step([(a0, 5, 1), (a1, 5, 1), (b0, 0, 3), (b1, 0, 3)])  # decodes beside b's prompt
    runner.step([(b0, 3, 1), (a0, 6, 1), (b1, 3, 1)])  # a1 was preempted
    runner.salt = 1  # recomputed later, in another batch: its rows are overwritten with what its KV now holds
    runner.step([(a1, 0, 7)])
    outputs = [SimpleNamespace(request_id="a", prompt_token_ids=[0] * 5, outputs=[completion(1, 3), completion(0, 3)]),
               SimpleNamespace(request_id="b", prompt_token_ids=[0] * 3, outputs=[completion(0, 2), completion(1, 2)])]
    routes = recorder.take(outputs)
    assert [tuple(r.shape) for r in routes] == [(8, L, K)] * 2 + [(5, L, K)] * 2 and routes[0].dtype == torch.int16
    for row, (request, ran, salt) in enumerate([(a0, 7, 0), (a1, 7, 1), (b0, 4, 0), (b1, 4, 0)]):
        r = routes[row]
        assert (r[:, 0] == -1).all()  # the dense layer
        assert (r[ran:] == -1).all()  # the last sampled token never ran
        for position in range(ran):
            for layer in MOE_LAYERS:
                assert r[position, layer].tolist() == expert(request, position, layer, salt), (row, position, layer)
    assert recorder._tables == {} and not recorder.active


def test_the_recorder_ignores_forwards_outside_a_generate_and_says_when_a_request_went_unseen():
    recorder = RouteRecorder(L, K)
    recorder.moe_layers = MOE_LAYERS
    runner, processor = FakeRunner(recorder), FakeProcessor()
    recorder.watch_requests(processor)
    runner.step([("warm-up", 0, 4)])  # vLLM's profile run: not recording
    assert recorder._tables == {}
    recorder.begin()
    processor.add_request(SimpleNamespace(request_id="0-z", external_req_id="0"), None)
    with pytest.raises(RuntimeError, match="no routes were recorded for vLLM request 0"):
        recorder.take([SimpleNamespace(request_id="0", prompt_token_ids=[1, 2], outputs=[completion(0, 1)])])


def test_vllms_own_routes_are_padded_to_the_contract():
    # vLLM 0.33: [p + t - 1, L, K] uint8, 0 in the dense layer's columns
    rows = np.array([[[0, 0], [3, 4], [5, 6]]] * 6, dtype=np.uint8)
    out = SimpleNamespace(request_id="0", prompt_token_ids=[1, 2, 3, 4],
                          outputs=[SimpleNamespace(index=1, token_ids=[7, 8, 9], routed_experts=rows[:6]),
                                   SimpleNamespace(index=0, token_ids=[7], routed_experts=rows[:4])])
    first, second = completion_routes([out], L, K, MOE_LAYERS)
    assert first.shape == (5, L, K) and second.shape == (7, L, K) and first.dtype == torch.int16
    assert (first[:4, 0] == -1).all() and first[:4, 1:].tolist() == [[[3, 4], [5, 6]]] * 4 and (first[4] == -1).all()
    assert (second[6] == -1).all() and (second[:6, 2] == torch.tensor([5, 6])).all()
    assert padded(None, 2, L, K, MOE_LAYERS).eq(-1).all()
    out.outputs[0].routed_experts = None
    with pytest.raises(RuntimeError, match="returned no routed_experts"):
        completion_routes([out], L, K, MOE_LAYERS)


def test_the_platform_picks_who_records_routes():
    cpu, gpu = VLLMPlatform("cpu", sleep_mode=False), VLLMPlatform("cuda", sleep_mode=True)
    assert cpu.route_capture == "rltrainer" and gpu.route_capture == "vllm"
    engine = VLLMEngine()
    assert "enable_return_routed_experts" not in gpu.llm_kwargs(engine)
    assert "enable_prefix_caching" not in cpu.llm_kwargs(engine)
    engine.return_routed_experts = True
    assert gpu.llm_kwargs(engine)["enable_return_routed_experts"] is True  # prefix caching stays on (vLLM needs it)
    assert "enable_prefix_caching" not in gpu.llm_kwargs(engine)
    cpu_kwargs = cpu.llm_kwargs(engine)
    assert cpu_kwargs["enable_prefix_caching"] is False and "enable_return_routed_experts" not in cpu_kwargs
