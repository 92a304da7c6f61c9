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
from rltrainer.weights.delta import DeltaSync

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
    """``Rollout("hf", placement="split")``: an engine process of its own beside an FSDP2 rank. With
    ``delta`` the second push sends the words that changed: a bf16 engine and a small step (in fp32
    one Adam step changes every word), so its log-probs are the policy's within bf16's rounding
    (atol 1e-2; measured 9.9e-4 on an Intel Xeon. The fp32 engine: within 1e-5, measured 9.5e-7)."""
    engine, lr, atol = (HFEngine(dtype=torch.bfloat16), 2e-6, 1e-2) if delta else (HFEngine(), 1e-2, 1e-5)
    rollout = Rollout(engine, placement="split", delta=DeltaSync(max_share=0.5) if delta else False)
    with TrainingClient(tiny_config, bpe_tokenizer, strategy=FSDP2Strategy(devices=1, gradient_clip_val=None),
                        root=tmp_path, rollout=rollout) as client:
        assert_sampler_is_policy(client, atol=atol)
        train_one_step(client, lr=lr)
        diff = assert_sampler_is_policy(client, atol=atol)
        print(f"split hf ({'bf16, delta' if delta else 'fp32'}) vs the policy: max |log-prob diff| {diff:.3e}; "
              f"sync {client.sync_metrics}")
        if delta:
            assert client.sync_metrics["sync/delta_buckets"] > 0, client.sync_metrics


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("rank", [None, 4], ids=["full", "lora"])
def test_a_vllm_engine_samples_the_trained_policy(rank, bpe_tokenizer, tmp_path, vllm_python, ray_session):
    """vLLM's CPU build (its own Python environment, so split placement: the Rollout refuses it in
    the controller's or a rank's process), fp32: its ``prompt_logprobs`` and sampled log-probs equal
    the policy's within 1e-5, as the vLLM pipelines' tests hold them (oneDNN's matmuls sum in another
    order than torch's; measured on an Intel Xeon: 9.5e-7). With ``rank``: the adapter alone travels
    (``enable_lora``) and vLLM samples with it as a ``LoRARequest``."""
    config = tiny_qwen2_config(len(bpe_tokenizer), hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1)
    lora = {"enable_lora": True, "max_lora_rank": 8} if rank else {}
    rollout = Rollout(VLLMEngine(dtype=torch.float32, python=vllm_python, **lora), placement="split")
    with TrainingClient(config, bpe_tokenizer, strategy=FSDP2Strategy(devices=1, gradient_clip_val=None),
                        root=tmp_path, rollout=rollout, rank=rank) as client:
        before = policy_logprobs(client, PROMPT)
        train_one_step(client, lr=5e-2)
        assert not torch.allclose(policy_logprobs(client, PROMPT), before, atol=1e-3)  # the step moved the policy
        diff = assert_sampler_is_policy(client, atol=1e-5)
        print(f"vLLM CPU ({'LoRA' if rank else 'full'}) vs the policy: max |log-prob diff| {diff:.3e}")


def test_an_engine_without_prompt_scoring_names_the_ones_with_it():
    """``compute_logprobs`` goes through ``RolloutEngine.prompt_log_probs``; an engine that does not
    override it (SGLang's, today) says which engines do."""
    from types import SimpleNamespace

    from rltrainer.rollout.engine import RolloutEngine

    with pytest.raises(NotImplementedError, match="SimpleNamespace does not score prompts .* 'hf', 'vllm'"):
        RolloutEngine.prompt_log_probs(SimpleNamespace(), [1, 2])
