"""What an engine's log-probs mean for a request, and what it can sample, checked when ``fit``
starts (issue 30, item 11): with top-k / top-p, vLLM's ``processed_logprobs`` are renormalised over
the kept tokens, SGLang's and the ``hf`` engine's are the full softmax at the temperature (the
trainer's), so a rollout correction's IS ratios would change with the engine; and vLLM raises
temperatures below 0.01 to 0.01 and refuses those above 2 (test_api_surface.py reads both in the wheel)."""

from __future__ import annotations

import pytest

from rltrainer import GRPO, Trainer, prompt_dataloader
from rltrainer.rollout import ENGINES, SamplingParams
from rltrainer.rollout.engine import check_engine_sampling
from rltrainer.testing import length_reward

FILTERED = [SamplingParams(top_p=0.9), SamplingParams(top_k=20), SamplingParams(top_p=0.95, top_k=50)]


@pytest.mark.parametrize("sampling", FILTERED + [SamplingParams(), SamplingParams(temperature=0.0, top_p=0.9)])
def test_which_engines_report_the_full_tempered_softmax(sampling):
    filtered = sampling.temperature > 0 and (sampling.top_p < 1 or sampling.top_k > 0)
    assert ENGINES.build("vllm").full_softmax_log_probs(sampling) is not filtered  # greedy: raw logits, as ours
    assert ENGINES.build("sglang").full_softmax_log_probs(sampling)
    assert ENGINES.build("hf").full_softmax_log_probs(sampling)


@pytest.mark.parametrize("sampling", FILTERED)
def test_a_correction_over_renormalised_log_probs_is_refused(sampling):
    vllm = ENGINES.build("vllm")
    settings = f"top_p={sampling.top_p}, top_k={sampling.top_k}"
    with pytest.raises(ValueError, match=rf"GRPO\(rollout_correction='token_tis'\) .* VLLMEngine's log-probs with "
                                         rf"{settings} are renormalised .* Turn the filters off \(top_p=1.0, top_k=0\), "
                                         r"or the correction off \(rollout_correction=None\)"):
        check_engine_sampling(vllm, sampling, "token_tis", "GRPO")
    for name in ("hf", "sglang"):  # the trainer's definition: nothing to refuse
        check_engine_sampling(ENGINES.build(name), sampling, "token_tis", "GRPO")
    check_engine_sampling(vllm, SamplingParams(), "token_tis", "GRPO")  # no filter: vLLM's are the trainer's too


def test_without_a_correction_renormalised_log_probs_only_warn(caplog):
    with caplog.at_level("WARNING", logger="rltrainer.rollout.engine"):
        check_engine_sampling(ENGINES.build("vllm"), SamplingParams(top_p=0.9), None, "GRPO")
        check_engine_sampling(ENGINES.build("sglang"), SamplingParams(top_p=0.9), None, "GRPO")
        check_engine_sampling(ENGINES.build("vllm"), SamplingParams(), None, "GRPO")
    assert [r.message.count("VLLMEngine's log-probs with top_p=0.9, top_k=0 are renormalised") for r in caplog.records
            ] == [1]


@pytest.mark.parametrize("temperature", [0.005, 1e-6, 2.5])
def test_vllm_refuses_temperatures_it_would_change_or_reject(temperature):
    with pytest.raises(ValueError, match=rf"rollout='vllm' got temperature={temperature}; vLLM samples with 0 "
                                         r"\(greedy\) or a temperature in \[0.01, 2.0\]"):
        check_engine_sampling(ENGINES.build("vllm"), SamplingParams(temperature=temperature), None, "GRPO")
    check_engine_sampling(ENGINES.build("sglang"), SamplingParams(temperature=temperature), None, "GRPO")


@pytest.mark.parametrize("temperature", [0.0, 0.01, 0.7, 2.0])
def test_vllm_accepts_its_temperature_range(temperature):
    check_engine_sampling(ENGINES.build("vllm"), SamplingParams(temperature=temperature), None, "GRPO")


@pytest.mark.parametrize("settings, match", [
    ({"top_p": 0.9, "rollout_correction": "token_tis"}, r"GRPO\(rollout_correction='token_tis'\) .* VLLMEngine's"),
    ({"temperature": 2.5}, r"rollout='vllm' got temperature=2.5"),
    ({"temperature": 0.001}, r"rollout='vllm' got temperature=0.001"),
])
def test_fit_refuses_before_any_model_is_built(settings, match, tiny_config, bpe_tokenizer, gsm8k_prompts):
    """``Trainer.fit`` sees the module's sampling and correction and the engine together first:
    it refuses there, before the policy is built or vLLM is imported (none is installed here)."""
    module = GRPO(tiny_config, bpe_tokenizer, reward_funcs=length_reward, num_generations=2, max_new_tokens=4,
                  **settings)
    trainer = Trainer(rollout="vllm", max_steps=1, logger=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match=match):
        trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2))
    assert not hasattr(module, "policy") and trainer.module is None  # configure_model never ran
