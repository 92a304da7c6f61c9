"""What the trainer needs of a causal LM, checked on the model (rltrainer/models/support.py): the
LM head's output transform found by running the model (identity, Granite's factor, Gemma 2's
soft-cap, with the config setting that switches it off), packing refused where a model's rows
would mix (gpt-oss), and the reasons a strategy gives when it refuses a model."""

from __future__ import annotations

import pytest
import torch

from rltrainer import GRPO
from rltrainer.models import build_causal_lm, response_log_probs
from rltrainer.models.support import HeadOutput, check_causal_lm, fsdp_blocks, head_output, packing_problem
from rltrainer.strategies import SingleDeviceStrategy
from rltrainer.testing import length_reward
from rltrainer.testing.families import tiny_config

VOCAB = 120


def model_of(family, **overrides):
    return build_causal_lm(tiny_config(family, VOCAB, **overrides), seed=0)


@pytest.mark.parametrize("family, expected", [
    ("llama", HeadOutput()),
    ("granite", HeadOutput(scale=0.25, neutral=("logits_scaling", 1.0))),
    ("gemma2", HeadOutput(softcap=5.0, neutral=("final_logit_softcapping", None))),
])
def test_the_heads_output_transform_is_found_by_running_the_model(family, expected):
    model = model_of(family)
    found = head_output(model, model.get_output_embeddings())
    assert found == expected
    ids = torch.randint(0, VOCAB, (1, 5))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        with found.returned_as_is(model):  # the config setting really switches the transform off
            raw = model(input_ids=ids).logits
        torch.testing.assert_close(found.apply(raw.clone()), logits, rtol=1e-5, atol=1e-5)
    assert model.config.to_dict() == tiny_config(family, VOCAB).to_dict()  # the setting is restored


def test_an_unknown_transform_takes_the_full_logits():
    """A model that adds to its logits (no factor, no soft-cap) gets no chunked head, and its
    log-probs still equal its own logits'."""
    model = model_of("llama")
    forward = type(model).forward

    def shifted(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        out.logits = out.logits + torch.arange(out.logits.shape[-1], dtype=out.logits.dtype) / 50
        return out

    model.forward = shifted.__get__(model)
    assert head_output(model, model.get_output_embeddings()) is None
    ids = torch.randint(0, VOCAB, (2, 9))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "responses": ids[:, 4:],
             "position_ids": torch.arange(9).expand(2, 9)}
    log_probs, _ = response_log_probs(model, batch)
    with torch.no_grad():
        expected = model(input_ids=ids).logits[:, 3:-1].log_softmax(-1).gather(-1, ids[:, 4:, None])[..., 0]
    torch.testing.assert_close(log_probs.detach(), expected, rtol=1e-5, atol=1e-5)


def test_gpt_oss_packed_rows_would_mix_and_padding_free_is_refused(bpe_tokenizer):
    assert packing_problem(model_of("llama")) is None
    assert "find_packed_sequence_indices is never reached" in packing_problem(model_of("gpt_oss"))
    module = GRPO(tiny_config("gpt_oss", len(bpe_tokenizer)), bpe_tokenizer, reward_funcs=length_reward,
                  num_generations=2, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"padding_free=True .*GptOssForCausalLM cannot keep packed rows apart.*"
                                         r"Use padding_free=False"):
        SingleDeviceStrategy(device="cpu", padding_free=True).setup(module, seed=0)
    SingleDeviceStrategy(device="cpu").setup(module, seed=0)  # padded rows: accepted


def test_a_layer_that_carries_state_across_positions_refuses_packing():
    model = model_of("llama")
    model.config.layer_types = ["full_attention", "linear_attention"]
    assert "linear_attention (config.layer_types)" in packing_problem(model)


def test_a_model_without_a_transformers_config_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="no transformers config.*build_causal_lm"):
        check_causal_lm(torch.nn.Linear(2, 2), "single")


def test_fsdp2_needs_the_blocks_the_model_names():
    model = model_of("qwen3")
    assert len(fsdp_blocks(model, "policy")) == 2
    model._no_split_modules = ["NoSuchLayer"]
    with pytest.raises(ValueError, match=r"_no_split_modules; policy \(Qwen3ForCausalLM\) names \['NoSuchLayer'\]"):
        fsdp_blocks(model, "policy")
