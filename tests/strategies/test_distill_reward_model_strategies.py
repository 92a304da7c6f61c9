"""A teacher and a reward model are placed like the reference model: FSDP2 shards them (built on
the meta device, each rank loading its rows) and their stages equal single-device; megatron
converts a teacher of a supported family and refuses a reward model, saying what to use."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from rltrainer import GRPO, RewardModel, Teacher
from rltrainer.data.batch import RolloutBatch
from rltrainer.strategies import FSDP2Strategy, SingleDeviceStrategy
from rltrainer.testing import length_reward, prepared_batch, tiny_qwen2_config, tiny_qwen3_config

pytestmark = pytest.mark.usefixtures("warm_ranks")  # ranks reuse warm processes (tests/conftest.py)
needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                    reason="megatron-core is not installed (dev extra: pip install -e '.[dev]')")


def make(config, tokenizer, **kwargs):
    defaults = dict(reward_funcs=length_reward, num_generations=4, max_new_tokens=8, lr=1e-3)
    return GRPO(config, tokenizer, **{**defaults, **kwargs})


def single_batch(module, gsm8k_prompts):
    prompts = RolloutBatch.from_rows([gsm8k_prompts[i] for i in range(3)])
    single = SingleDeviceStrategy(device="cpu", micro_batch_size=8)
    single.setup(module, seed=7)
    torch.manual_seed(0)
    return prepared_batch(module, single, prompts)  # 12 rows


def test_fsdp2_teacher_stage_matches_one_device(tiny_config, bpe_tokenizer, gsm8k_prompts, ray_session):
    def module():  # a Qwen3 teacher of another size, for a Qwen2 policy: the family need not match
        teacher = tiny_qwen3_config(len(bpe_tokenizer), hidden_size=32, num_layers=1)
        return make(tiny_config, bpe_tokenizer, teacher=Teacher(teacher, coef=0.5, seed=11))

    batch = single_batch(module(), gsm8k_prompts)
    fsdp = FSDP2Strategy(devices=2, micro_batch_size=5)
    try:
        fsdp.setup(module(), seed=7)
        report = fsdp.group.execute_all("load_report")[1]["teacher"]
        assert report["source"] == "random init on rank 0" and report["shard_bytes"] < 0.6 * report["full_bytes"]
        out = fsdp.compute(batch, "teacher")["teacher_log_probs"]
        torch.testing.assert_close(out, batch["teacher_log_probs"], rtol=0, atol=1e-5)
        assert (out - batch["old_log_probs"]).abs().max() > 0.1  # another model than the policy
    finally:
        fsdp.teardown()


def test_fsdp2_reward_model_from_a_checkpoint_matches_one_device(tiny_config, bpe_tokenizer, gsm8k_prompts,
                                                                 ray_session, tmp_path):
    from transformers import AutoModelForSequenceClassification

    config = tiny_qwen2_config(len(bpe_tokenizer), hidden_size=32, num_layers=1, num_labels=1,
                               pad_token_id=bpe_tokenizer.pad_token_id)
    torch.manual_seed(3)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path / "rm")

    def module():
        return make(tiny_config, bpe_tokenizer, reward_funcs=[length_reward, RewardModel(str(tmp_path / "rm"))],
                    reward_weights=[1.0, 0.5])

    batch = single_batch(module(), gsm8k_prompts)
    assert batch["rm_scores"].std() > 0
    fsdp = FSDP2Strategy(devices=2, micro_batch_size=5)
    try:
        fsdp.setup(module(), seed=7)
        report = fsdp.group.execute_all("load_report")[1]["reward_model"]
        assert report["source"].startswith("safetensors files in")  # built on meta, each rank read its rows
        assert report["loaded_bytes"] == report["shard_bytes"] < 0.6 * report["full_bytes"]
        torch.testing.assert_close(fsdp.compute(batch, "reward_model")["rm_scores"], batch["rm_scores"],
                                   rtol=0, atol=1e-5)
    finally:
        fsdp.teardown()


@needs_megatron
def test_megatron_teacher_and_reward_model_match_one_device(tiny_config, bpe_tokenizer, gsm8k_prompts,
                                                                          ray_session):
    from rltrainer.controller.worker_group import WorkerError
    from rltrainer.strategies import MegatronStrategy

    def module():
        teacher = tiny_qwen2_config(len(bpe_tokenizer), hidden_size=64, num_layers=1)  # larger than the policy
        return make(tiny_config, bpe_tokenizer, teacher=Teacher(teacher, seed=11))

    batch = single_batch(module(), gsm8k_prompts)
    strategy = MegatronStrategy(devices=2, tensor_model_parallel_size=2, micro_batch_size=5)
    try:
        strategy.setup(module(), seed=7)
        torch.testing.assert_close(strategy.compute(batch, "teacher")["teacher_log_probs"], batch["teacher_log_probs"],
                                   rtol=0, atol=1e-5)
    finally:
        strategy.teardown()
    def rm_module():  # a reward model of its own size, mixed with a rule reward
        rm_config = tiny_qwen2_config(len(bpe_tokenizer), hidden_size=48, num_layers=1)
        return make(tiny_config, bpe_tokenizer, reward_funcs=[length_reward, RewardModel(rm_config, seed=5)],
                    reward_weights=[1.0, 0.5])

    from rltrainer.rewards.model import sequence_scores

    single_module = rm_module()
    batch = single_batch(single_module, gsm8k_prompts)
    pad = bpe_tokenizer.pad_token_id
    for row, cut in ((0, 3), (5, 6)):  # right padding inside the responses: the score is taken before it
        batch["input_ids"][row, -cut:], batch["attention_mask"][row, -cut:] = pad, 0
    expected = sequence_scores(single_module.reward_model, batch)  # transformers' own pooling
    assert expected.std() > 0 and not torch.allclose(expected[[0, 5]], batch["rm_scores"][[0, 5]])
    strategy = MegatronStrategy(devices=2, tensor_model_parallel_size=2, micro_batch_size=5)
    try:  # tensor-parallel trunk, replicated norm and score head, pooled at the last non-pad token
        strategy.setup(rm_module(), seed=7)
        torch.testing.assert_close(strategy.compute(batch, "reward_model")["rm_scores"], expected, rtol=0, atol=1e-5)
    finally:
        strategy.teardown()
    strategy = MegatronStrategy(devices=2, pipeline_model_parallel_size=2)
    try:
        with pytest.raises(WorkerError, match="pipeline_model_parallel_size=2 .*reward_model .*a reward model"):
            strategy.setup(rm_module(), seed=0)
    finally:
        strategy.teardown()
    strategy = MegatronStrategy(devices=2, pipeline_model_parallel_size=2)  # a teacher of another hidden size
    try:
        with pytest.raises(WorkerError, match="pipeline_model_parallel_size=2: .*hidden_size=64"):
            strategy.setup(module(), seed=0)
    finally:
        strategy.teardown()
