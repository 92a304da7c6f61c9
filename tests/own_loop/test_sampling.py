"""Issue 46, point 1: the sampling client on each engine and placement the Trainer offers
(``TrainingClient(rollout=...)``): after a push it samples, and its ``compute_logprobs`` (the
engine's own scoring call) equal the trained policy's log-probs; LoRA and delta syncs included.
A client whose weights a later push replaced raises instead of sampling other weights."""

from __future__ import annotations

import pytest
import torch

from rltrainer import VLLMEngine
from rltrainer.own_loop import AdamParams, Datum, SamplingParams, StaleSamplerError, TrainingClient
from rltrainer.rollout.hf import HFEngine
from rltrainer.rollout.rollout import Rollout
from rltrainer.strategies import FSDP2Strategy
from rltrainer.testing import tiny_qwen2_config

PROMPT = [5, 9, 13, 22, 40, 7]


def train_one_step(client: TrainingClient, lr: float = 1e-2) -> None:
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(5, 400, (9,), generator=g)
    datum = Datum(seq[:-1], {"target_tokens": seq[1:], "logprobs": -torch.rand(8, generator=g) * 6,
                             "advantages": torch.randn(8, generator=g)})
    client.forward_backward([datum], "importance_sampling").result()
    client.optim_step(AdamParams(learning_rate=lr)).result()


def policy_logprobs(client: TrainingClient, tokens: list[int]) -> torch.Tensor:
    """The trained policy's log-prob of each token after the first (its ``forward``)."""
    datum = Datum(tokens[:-1], {"target_tokens": tokens[1:]})
    return client.forward([datum]).result().loss_fn_outputs[0]["logprobs"]


def assert_sampler_is_policy(client: TrainingClient, atol: float) -> float:
    """Push, sample, and compare the engine's log-probs (of a prompt, and of what it sampled) with
    the policy's; returns the largest difference."""
    sampler = client.save_weights_and_get_sampling_client().result()
    scored = sampler.compute_logprobs(PROMPT).result()
    assert scored[0] is None and len(scored) == len(PROMPT)
    expected = policy_logprobs(client, PROMPT)
    diff = float((torch.tensor(scored[1:]) - expected).abs().max())
    out = sampler.sample(PROMPT, 2, SamplingParams(max_tokens=4, seed=0, stop=[])).result()
    assert [len(s.tokens) for s in out.sequences] == [4, 4]
    for s in out.sequences:  # temperature 1, no top-k/p: full-softmax log-probs, as the policy's
        sampled = policy_logprobs(client, PROMPT + s.tokens)[-len(s.tokens):]
        diff = max(diff, float((torch.tensor(s.logprobs) - sampled).abs().max()))
    assert diff <= atol, diff
    return diff


def test_a_sampler_of_replaced_weights_raises(tiny_config, bpe_tokenizer, tmp_path):
    client = TrainingClient(tiny_config, bpe_tokenizer, strategy="single", device="cpu", root=tmp_path)
    old = client.save_weights_and_get_sampling_client().result()
    old.sample(PROMPT, 1, SamplingParams(max_tokens=2)).result()
    train_one_step(client)
    old.sample(PROMPT, 1, SamplingParams(max_tokens=2)).result()  # not pushed yet: the engine holds its weights
    new = client.save_weights_and_get_sampling_client().result()
    for call in (lambda: old.sample(PROMPT, 1, SamplingParams(max_tokens=2)), lambda: old.compute_logprobs(PROMPT)):
        with pytest.raises(StaleSamplerError, match="made for the weights after 0 optimizer steps, but the engine "
                                                    "now holds those after 1"):
            call().result()
    assert new.version == 1 and len(new.sample(PROMPT, 1, SamplingParams(max_tokens=2)).result().sequences) == 1


def test_a_sampler_on_an_engine_bound_to_the_policy_raises_after_a_step(tiny_config, bpe_tokenizer, tmp_path):
    """``HFEngine(share_weights=True)`` samples the policy's own parameters: an optimizer step moves
    them under the client, so the client is stale from that step on."""
    client = TrainingClient(tiny_config, bpe_tokenizer, strategy="single", device="cpu", root=tmp_path,
                            rollout=HFEngine(share_weights=True))
    sampler = client.save_weights_and_get_sampling_client().result()
    assert_sampler_is_policy(client, atol=1e-5)
    train_one_step(client)
    with pytest.raises(StaleSamplerError):
        sampler.compute_logprobs(PROMPT).result()


def test_a_lora_client_pushes_into_the_engine(tiny_config, bpe_tokenizer, tmp_path):
    client = TrainingClient(tiny_config, bpe_tokenizer, strategy="single", device="cpu", root=tmp_path, rank=4)
    before = policy_logprobs(client, PROMPT)
    train_one_step(client, lr=5e-2)
    assert not torch.allclose(policy_logprobs(client, PROMPT), before, atol=1e-3)  # the adapter moved
    assert_sampler_is_policy(client, atol=1e-5)


@pytest.mark.usefixtures("warm_ranks")
@pytest.mark.parametrize("delta", [False, True], ids=["full", "delta"])
def test_a_split_hf_engine_samples_the_trained_policy(delta, tiny_config, bpe_tokenizer, tmp_path, ray_session):
    """``Rollout("hf", placement="split")``: an engine process of its own beside an FSDP2 rank; with
    ``delta=True`` the later pushes send the words that changed (fp32: exact, as a full sync)."""
    rollout = Rollout(HFEngine(), placement="split", delta=delta)
    with TrainingClient(tiny_config, bpe_tokenizer, strategy=FSDP2Strategy(devices=1, gradient_clip_val=None),
                        root=tmp_path, rollout=rollout) as client:
        assert_sampler_is_policy(client, atol=1e-5)
        train_one_step(client, lr=1e-5 if delta else 1e-2)  # delta: few words change, so they travel as deltas
        assert_sampler_is_policy(client, atol=1e-5)


@pytest.mark.vllm
@pytest.mark.slow
def test_a_vllm_engine_samples_the_trained_policy(bpe_tokenizer, tmp_path, vllm_python, ray_session):
    """vLLM's CPU build (its own Python environment, so split placement: the Rollout refuses it in
    the controller's or a rank's process), fp32: its ``prompt_logprobs`` and sampled log-probs equal
    the policy's within 1e-4 (oneDNN's matmuls sum in another order than torch's)."""
    config = tiny_qwen2_config(len(bpe_tokenizer), hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1)
    rollout = Rollout(VLLMEngine(dtype=torch.float32, python=vllm_python), placement="split")
    with TrainingClient(config, bpe_tokenizer, strategy=FSDP2Strategy(devices=1, gradient_clip_val=None),
                        root=tmp_path, rollout=rollout) as client:
        train_one_step(client)
        diff = assert_sampler_is_policy(client, atol=1e-4)
        print(f"vLLM CPU vs the policy: max |log-prob diff| {diff:.3e}")
