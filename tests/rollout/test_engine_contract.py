"""The contract every rollout engine keeps, run against each registered engine: ``hf`` always;
``vllm`` and ``sglang`` where they are installed and a GPU is present (they skip, saying why,
elsewhere; the real vLLM engine runs on CPU in tests/rollout/test_vllm_engine.py). An engine that passes looks identical to the trainer."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from rltrainer.data.batch import RolloutBatch
from rltrainer.models import build_causal_lm, response_log_probs
from rltrainer.rollout import ENGINES, SamplingParams

# engine name -> (constructor kwargs, device, log-prob tolerance)
ENGINE_CASES = {
    "hf": ({}, "cpu", 1e-4),
    "vllm": ({"gpu_memory_utilization": 0.3, "enforce_eager": True, "dtype": torch.float32}, "cuda", 2e-2),
    "sglang": ({"mem_fraction_static": 0.3, "dtype": torch.float32}, "cuda", 2e-2),
}


def engine_unavailable(name: str) -> str | None:
    if name == "hf":
        return None
    if importlib.util.find_spec(name) is None:
        more = " (the real vLLM on CPU runs in its own environment: test_vllm_engine.py)" if name == "vllm" else ""
        return f"{name} is not installed in this environment (an optional extra: pip install -e '.[{name}]'){more}"
    if not torch.cuda.is_available():
        return f"this suite runs {name} on a CUDA GPU; none here"
    return None


@pytest.fixture(params=list(ENGINE_CASES), scope="module")
def setup(request, bpe_tokenizer):
    name = request.param
    reason = engine_unavailable(name)
    if reason:
        pytest.skip(reason)
    kwargs, device, tol = ENGINE_CASES[name]
    from rltrainer.testing import tiny_qwen2_config

    config = tiny_qwen2_config(len(bpe_tokenizer), hidden_size=32, num_layers=2)
    model = build_causal_lm(config, seed=0).to(device).eval()
    engine = ENGINES.build(name, **kwargs)
    engine.setup(config, bpe_tokenizer, device=device)
    engine.update_weights(model.named_parameters())
    yield engine, model, tol
    engine.teardown()


def prompts(tokenizer):
    texts = ["Natalia sold clips to 48 of her friends.", "A robe takes 2 bolts", "What is 3 + 4?"]
    return [tokenizer(t)["input_ids"] for t in texts]


def teacher_forced(model, prompt_ids, gen, row_prompt, temperature):
    """Log-probs of the engine's tokens under ``model`` (one prompt's rows, no padding)."""
    ids = gen.response_ids[row_prompt[0]:row_prompt[1]]
    mask = gen.response_mask[row_prompt[0]:row_prompt[1]]
    prompt = torch.tensor(prompt_ids).repeat(len(ids), 1)
    input_ids = torch.cat([prompt, ids], 1)
    attention = torch.cat([torch.ones_like(prompt), mask], 1)
    batch = RolloutBatch({"input_ids": input_ids, "attention_mask": attention, "responses": ids,
                          "position_ids": (attention.cumsum(-1) - 1).clamp(min=0)})
    device = next(model.parameters()).device
    with torch.no_grad():
        log_probs, _ = response_log_probs(model, batch.to(device), temperature)
    return log_probs.cpu() * mask


def test_shapes_and_n_samples_per_prompt(setup, bpe_tokenizer):
    engine, _, _ = setup
    ps = prompts(bpe_tokenizer)
    gen = engine.generate(ps, SamplingParams(n=4, max_new_tokens=12, temperature=1.0, seed=0))
    R = len(ps) * 4
    assert gen.response_ids.shape == gen.response_mask.shape == gen.log_probs.shape
    assert gen.response_ids.shape[0] == R and gen.response_ids.shape[1] <= 12
    assert len(gen.text) == len(gen.finish_reason) == R
    assert set(gen.finish_reason) <= {"stop", "length"}
    greedy = engine.generate(ps, SamplingParams(n=3, max_new_tokens=8, temperature=0.0))
    for i in range(len(ps)):  # the n greedy samples of one prompt are one and the same
        rows = greedy.response_ids[i * 3:(i + 1) * 3]
        assert (rows == rows[0]).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_match_a_forward_pass(setup, bpe_tokenizer, temperature):
    engine, model, tol = setup
    ps = prompts(bpe_tokenizer)
    gen = engine.generate(ps, SamplingParams(n=2, max_new_tokens=10, temperature=temperature, seed=1))
    for i, p in enumerate(ps):
        expected = teacher_forced(model, p, gen, (i * 2, i * 2 + 2), temperature)
        got = gen.log_probs[i * 2:i * 2 + 2] * gen.response_mask[i * 2:i * 2 + 2]
        torch.testing.assert_close(got, expected, rtol=0, atol=tol)


def test_stops_at_a_stop_token_and_keeps_it(setup, bpe_tokenizer):
    engine, _, _ = setup
    ps = prompts(bpe_tokenizer)[:1]
    free = engine.generate(ps, SamplingParams(n=1, max_new_tokens=12, temperature=0.0, stop_token_ids=[]))
    stop = int(free.response_ids[0, 3])
    first = int((free.response_ids[0] == stop).nonzero()[0])
    gen = engine.generate(ps, SamplingParams(n=1, max_new_tokens=12, temperature=0.0, stop_token_ids=[stop]))
    assert gen.finish_reason == ["stop"]
    assert int(gen.response_mask[0].sum()) == first + 1 and int(gen.response_ids[0, first]) == stop
    assert free.finish_reason == ["length"] and int(free.response_mask[0].sum()) == 12


def test_update_weights_changes_the_outputs(setup, bpe_tokenizer):
    engine, model, _ = setup
    ps = prompts(bpe_tokenizer)
    greedy = SamplingParams(n=1, max_new_tokens=10, temperature=0.0, stop_token_ids=[])
    before = engine.generate(ps, greedy)
    with torch.no_grad():
        shifted = [(n, p + 0.5 * torch.randn_like(p)) for n, p in model.named_parameters()]
    stats = engine.update_weights(shifted)
    assert stats["tensors"] == len(shifted)
    after = engine.generate(ps, greedy)
    assert not torch.equal(after.log_probs, before.log_probs)
    engine.update_weights(model.named_parameters())  # and back
    again = engine.generate(ps, greedy)
    assert torch.equal(again.response_ids, before.response_ids)
