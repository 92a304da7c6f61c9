"""PPO runs on the same Trainer, Strategy and engine as GRPO: a critic trained alongside the
policy, GAE advantages, a clipped value loss."""

import math

import torch

from rltrainer import PPO, Trainer, prompt_dataloader


def length_reward(completions, **kwargs):
    return [min(len(c), 20) / 20 for c in completions]


def test_ppo_trains_policy_and_critic(tiny_config, bpe_tokenizer, gsm8k_prompts):
    module = PPO(tiny_config, bpe_tokenizer, reward_funcs=length_reward, max_new_tokens=8, lr=1e-3, critic_lr=1e-3,
                 kl_in_reward_coef=0.05, update_epochs=2, mini_batch_size=2)
    trainer = Trainer(max_steps=2, logger=False, enable_progress_bar=False)
    trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=4))
    critic_before = PPO(tiny_config, bpe_tokenizer, reward_funcs=length_reward)
    critic_before.configure_model()
    m = trainer.callback_metrics
    for key in ["timing_s/values", "timing_s/ref", "timing_s/old_log_prob", "critic/vf_loss", "critic/vf_clipfrac",
                "actor/pg_loss", "actor/ppo_kl", "critic/values/mean", "critic/kl_in_reward"]:
        assert key in m and math.isfinite(m[key]), key
    # both models moved: the critic's parameters differ from a fresh one built with the same seed
    assert any(not torch.equal(a, b) for a, b in zip(module.critic.parameters(), critic_before.critic.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(module.policy.parameters(), critic_before.policy.parameters()))
    assert len(trainer.strategy.optimizers) == 2


def test_ppo_critic_from_a_checkpoint_path(tiny_config, bpe_tokenizer, tmp_path):
    """A critic from a model directory: the backbone's weights loaded, one output, no dropout (transformers 5
    passes from_pretrained's unknown keyword arguments to the model's __init__, which refused
    ``classifier_dropout``)."""
    from transformers import AutoModelForCausalLM

    from rltrainer.modules.ppo import build_value_model

    AutoModelForCausalLM.from_config(tiny_config).save_pretrained(tmp_path)
    critic = build_value_model(str(tmp_path))
    policy = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert critic.config.num_labels == 1 and critic.score.out_features == 1
    assert critic.dropout.p == 0.0
    assert torch.equal(critic.model.embed_tokens.weight, policy.model.embed_tokens.weight)
