"""rltrainer's GRPO loss and gradients against TRL's ``GRPOTrainer`` (trl 1.16, the ``dev``
extra), fed the same model weights, prompts, completions, rewards, old and reference log-probs.

Mapping of TRL's ``loss_type`` onto rltrainer's ``loss_agg_mode`` (one micro-batch, one process):

============  ==============================  =================================================
TRL           rltrainer                       normaliser
============  ==============================  =================================================
``grpo``      ``seq-mean-token-mean``         mean over rows of each row's token mean
``bnpo``      ``token-mean`` (local count)    tokens of the micro-batch
``dr_grpo``   ``seq-mean-token-sum-norm``     rows x ``max_completion_length`` (= ``max_new_tokens``)
``dapo``      ``token-mean`` (global count)   tokens of the whole generation batch
============  ==============================  =================================================

The policy-loss entries TRL also has (``dapo`` = ``ppo_clip`` with clip-higher, GSPO through
``importance_sampling_level="sequence"``, CISPO, SAPO) are compared on the same per-token log-probs
(TRL's log-prob forward stubbed out) to 1e-6 in ``test_policy_loss_entries_match_trl``.

Differences on purpose, checked here rather than hidden:

- Entropy bonus: TRL always averages it over tokens; rltrainer aggregates it with the loss's own
  mode (verl's convention). Equal for ``bnpo``/``dapo``; for ``grpo``/``dr_grpo`` the two losses
  differ by exactly ``entropy_coef x (token-mean - mode-mean)`` of the entropy.
- rltrainer adds verl's dual clip (``clip_ratio_c=3``) for negative advantages; TRL has none. The
  ratios here stay below 3, where the two agree.
- TRL 1.16 weights the KL term by the importance ratio ``pi / pi_old`` by default
  (``use_bias_correction_kl=True``); rltrainer, like verl, does not. Both are the same on-policy
  (ratio 1); off-policy, as here, the test sets ``use_bias_correction_kl=False``.
- Position ids: rltrainer derives them from the attention mask; TRL leaves them to the model,
  which shifts the positions of left-padded prompts. The prompts here have equal length (no
  left padding), where the two agree.
"""

from __future__ import annotations

import copy

import pytest
import torch

trl = pytest.importorskip("trl", reason="trl is part of the dev extra: pip install -e '.[dev]'")

from rltrainer import GRPO  # noqa: E402
from rltrainer.algorithms.advantages import grpo_advantages  # noqa: E402
from rltrainer.algorithms.aggregation import aggregate  # noqa: E402
from rltrainer.data.batch import RolloutBatch  # noqa: E402
from rltrainer.models import build_causal_lm, response_log_probs  # noqa: E402

B, G, P, T = 2, 4, 6, 10
N = B * G
BETA, CLIP = 0.04, 0.2
LOSS_TYPES = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dr_grpo": "seq-mean-token-sum-norm",
              "dapo": "token-mean"}


def zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


@pytest.fixture(scope="module")
def rollout(bpe_tokenizer, tmp_path_factory):
    """Completions with varied lengths, rewards, and old/ref log-probs off the current policy."""
    from rltrainer.testing import tiny_qwen2_config

    config = tiny_qwen2_config(len(bpe_tokenizer), hidden_size=32, num_layers=2)
    model = build_causal_lm(config, seed=0)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, len(bpe_tokenizer), (B, P), generator=gen).repeat_interleave(G, 0)  # [N, P]
    lengths = torch.tensor([T, 3, 7, 10, 1, 5, 9, 4])
    mask = (torch.arange(T)[None] < lengths[:, None]).long()  # [N, T]
    responses = torch.randint(10, len(bpe_tokenizer), (N, T), generator=gen) * mask + bpe_tokenizer.pad_token_id * (1 - mask)
    input_ids = torch.cat([prompts, responses], 1)
    attention = torch.cat([torch.ones_like(prompts), mask], 1)
    batch = RolloutBatch({"prompts": prompts, "responses": responses, "response_mask": mask, "input_ids": input_ids,
                          "attention_mask": attention, "position_ids": (attention.cumsum(-1) - 1).clamp(min=0)},
                         {"uid": [f"p{i // G}" for i in range(N)]})
    with torch.no_grad():
        current, _ = response_log_probs(model, batch)
    batch["old_log_probs"] = (current + 0.3 * torch.randn(N, T, generator=gen)) * mask  # ratios in ~[0.5, 2]
    batch["ref_log_probs"] = (current + 0.5 * torch.randn(N, T, generator=gen)) * mask
    scores = torch.tensor([1.0, 0.0, 0.5, 0.0, 2.0, 1.0, 1.0, 0.0])
    path = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(path)  # TRL loads the policy (and, with beta > 0, its reference) from a path
    return model, batch, scores, str(path)


def test_group_advantages_match_trl(rollout):
    from trl.trainer.utils import nanstd

    _, batch, scores, _ = rollout
    ours, _ = grpo_advantages(scores, batch["response_mask"], list(batch["uid"]), epsilon=1e-4)
    grouped = scores.view(-1, G)
    theirs = (grouped - grouped.mean(1, keepdim=True)) / (nanstd(grouped, dim=1).unsqueeze(1) + 1e-4)
    torch.testing.assert_close(ours[:, 0], theirs.reshape(-1), rtol=0, atol=1e-6)


def trl_loss_and_grads(model, batch, loss_type, entropy_coef, tokenizer, tmp_path):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", loss_type=loss_type,
                      beta=BETA, epsilon=CLIP, num_generations=G, per_device_train_batch_size=N,
                      max_completion_length=T, entropy_coef=entropy_coef, temperature=1.0,
                      use_bias_correction_kl=False)  # see the module docstring
    trainer = GRPOTrainer(model=model, reward_funcs=zero_reward, args=args, processing_class=tokenizer,
                          train_dataset=Dataset.from_dict({"prompt": ["x"] * N}))
    trainer.current_gradient_accumulation_steps = 1  # set by transformers' training loop, which is not run here
    inputs = {"prompt_ids": batch["prompts"], "prompt_mask": torch.ones_like(batch["prompts"]),
              "completion_ids": batch["responses"], "completion_mask": batch["response_mask"],
              "advantages": batch["advantages"][:, 0], "old_per_token_logps": batch["old_log_probs"],
              "ref_per_token_logps": batch["ref_log_probs"], "num_items_in_batch": batch["response_mask"].sum()}
    trainer.model.train()
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {n.removeprefix("module."): p.grad.clone() for n, p in trainer.model.named_parameters()}
    return loss.detach(), grads


def ours_loss_and_grads(model, batch, loss_type, entropy_coef, tokenizer):
    module = GRPO(lambda: copy.deepcopy(model), tokenizer, reward_funcs=zero_reward, num_generations=G,
                  max_new_tokens=T, kl_coef=BETA, kl_estimator="k3", entropy_coef=entropy_coef,
                  clip_ratio_low=CLIP, clip_ratio_high=CLIP, loss_agg_mode=LOSS_TYPES[loss_type])
    module.configure_model()
    module.policy.train()
    mb = batch.copy()
    mb.global_tokens, mb.global_rows, mb.temperature = float(batch["response_mask"].sum()), float(N), 1.0
    loss, _ = module.policy_step(mb)
    loss.backward()
    with torch.no_grad():
        _, entropy = response_log_probs(module.policy, mb, with_entropy=True)
    return loss.detach(), {n: p.grad.clone() for n, p in module.policy.named_parameters()}, entropy


@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
@pytest.mark.parametrize("loss_type", list(LOSS_TYPES))
def test_loss_and_gradients_match_trl(loss_type, entropy_coef, rollout, bpe_tokenizer, tmp_path):
    model, batch, scores, path = rollout
    batch = batch.copy()
    batch["advantages"], _ = grpo_advantages(scores, batch["response_mask"], list(batch["uid"]), epsilon=1e-4)
    assert batch["advantages"].abs().sum() > 0
    trl_loss, trl_grads = trl_loss_and_grads(path, batch, loss_type, entropy_coef, bpe_tokenizer, tmp_path)
    loss, grads, entropy = ours_loss_and_grads(model, batch, loss_type, entropy_coef, bpe_tokenizer)

    mask, mode = batch["response_mask"], LOSS_TYPES[loss_type]
    counts = dict(global_tokens=float(mask.sum()), global_rows=float(N), max_response_length=T)
    # the documented entropy difference: TRL's bonus is a token mean, ours uses the loss's own mode
    gap = entropy_coef * (aggregate(entropy, mask, "token-mean", **counts) - aggregate(entropy, mask, mode, **counts))
    torch.testing.assert_close(loss, trl_loss + gap, rtol=0, atol=1e-5)
    if entropy_coef and mode != "token-mean":
        return  # the losses differ by the documented gap (checked above), so do their gradients
    assert float(gap) == 0.0
    for name, grad in grads.items():
        torch.testing.assert_close(grad, trl_grads[name], rtol=1e-5, atol=1e-5, msg=name)


# -- every TRL loss_type rltrainer has, as a registry entry ------------------------------------------
# (our policy_loss, its kwargs or GRPO shorthands, our loss_agg_mode, TRL's GRPOConfig arguments)
TRL_LOSSES = {
    "dapo": ("ppo_clip", {"clip_ratio_high": 0.28, "clip_ratio_c": None}, "token-mean",
             {"loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28}),
    "gspo": ("gspo", {"policy_loss_kwargs": {"clip_ratio_low": 0.05, "clip_ratio_high": 0.05}}, "seq-mean-token-mean",
             {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 0.05}),
    "gspo_token_mean": ("gspo", {"policy_loss_kwargs": {"clip_ratio_low": 0.05, "clip_ratio_high": 0.05}},
                        "token-mean",
                        {"loss_type": "dapo", "importance_sampling_level": "sequence", "epsilon": 0.05}),
    "cispo": ("cispo", {"policy_loss_kwargs": {"clip_ratio_high": 0.25}}, "token-mean",
              {"loss_type": "cispo", "epsilon_high": 1.25}),
    "sapo": ("sapo", {}, "seq-mean-token-mean", {"loss_type": "sapo"}),
}


@pytest.mark.parametrize("case", list(TRL_LOSSES))
def test_policy_loss_entries_match_trl(case, rollout, bpe_tokenizer, tmp_path):
    """TRL's ``GRPOTrainer._compute_loss`` (grpo_trainer.py:3083-3174) fed the same per-token
    log-probs as the entry (its log-prob forward stubbed out), no KL: loss and gradient with respect
    to the log-probs to 1e-6. The entry and its parameters come from a ``GRPO`` built as a user would."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rltrainer.algorithms import POLICY_LOSSES, LossContext

    name, grpo_kwargs, mode, trl_kwargs = TRL_LOSSES[case]
    _, batch, scores, path = rollout
    mask = batch["response_mask"]
    advantages, _ = grpo_advantages(scores, mask, list(batch["uid"]), epsilon=1e-4)
    gen = torch.Generator().manual_seed(1)
    log_probs = (-3.0 * torch.rand(N, T, generator=gen)) * mask
    old = (log_probs + 0.4 * torch.randn(N, T, generator=gen)) * mask  # ratios ~0.5..2: clipping happens

    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", beta=0.0,
                      num_generations=G, per_device_train_batch_size=N, max_completion_length=T, **trl_kwargs)
    trainer = GRPOTrainer(model=path, reward_funcs=zero_reward, args=args, processing_class=bpe_tokenizer,
                          train_dataset=Dataset.from_dict({"prompt": ["x"] * N}))
    trainer.current_gradient_accumulation_steps = 1
    theirs_lp = log_probs.clone().requires_grad_(True)
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (theirs_lp, torch.zeros(N, T), None)
    inputs = {"prompt_ids": batch["prompts"], "prompt_mask": torch.ones_like(batch["prompts"]),
              "completion_ids": batch["responses"], "completion_mask": mask, "advantages": advantages[:, 0],
              "old_per_token_logps": old, "num_items_in_batch": mask.sum()}
    trl_loss = trainer._compute_loss(trainer.model, inputs)
    trl_loss.backward()

    module = GRPO(path, bpe_tokenizer, reward_funcs=zero_reward, num_generations=G, max_new_tokens=T,
                  loss_agg_mode=mode, policy_loss=name, **grpo_kwargs)
    ours_lp = log_probs.clone().requires_grad_(True)
    ctx = LossContext(mode, global_tokens=float(mask.sum()), global_rows=float(N), max_response_length=T)
    loss, metrics = POLICY_LOSSES.get(module.parts["loss"].policy_loss)(ours_lp, old, advantages, mask, ctx,
                                                          **module.parts["loss"].params)
    loss.backward()
    torch.testing.assert_close(loss.detach(), trl_loss.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours_lp.grad, theirs_lp.grad, rtol=0, atol=1e-6)
    assert ours_lp.grad.abs().sum() > 0
    if "actor/pg_clipfrac" in metrics:
        assert 0 < metrics["actor/pg_clipfrac"] < 1, "the example should clip some tokens, not all"
