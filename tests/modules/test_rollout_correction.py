"""GRPO with an off-policy rollout correction: the old log-probs are recomputed when rollouts can be
off-policy, the IS weights multiply the per-token loss, rejected tokens contribute nothing, and the
``rollout_corr/*`` metrics are logged."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from rltrainer import GRPO, PPO, Trainer, prompt_dataloader
from rltrainer.data.batch import RolloutBatch
from rltrainer.module import Attachment
from rltrainer.testing import tiny_qwen2_config

VOCAB, P, T, N = 64, 3, 4, 6
TEMPERATURE = 0.7


def zero_reward(completions: list[str], **kwargs: object) -> list[float]:
    return [0.0] * len(completions)


def make_module(cls: type = GRPO, **kwargs: object) -> GRPO:
    module = cls(model=tiny_qwen2_config(vocab_size=VOCAB), tokenizer=SimpleNamespace(pad_token_id=0),
                 reward_funcs=zero_reward, max_new_tokens=5, num_generations=3, **kwargs)
    module.configure_model()
    return module


def policy_log_probs(module: GRPO, batch: RolloutBatch) -> torch.Tensor:
    """``[N, T]`` by hand: full forward, the positions that predict the responses, log-softmax."""
    logits = module.policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           position_ids=batch["position_ids"]).logits[:, P - 1 : P - 1 + T].float() / TEMPERATURE
    return F.log_softmax(logits, dim=-1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)


def make_batch(module: GRPO, rollout_lag: float = 0.5) -> RolloutBatch:
    """Two groups of three, right-padded responses, ``old_log_probs`` a little off the current policy
    (so the PPO ratio is not 1) and ``rollout_log_probs`` ``rollout_lag`` off those."""
    gen = torch.Generator().manual_seed(0)
    prompt_len = torch.tensor([3, 2, 1, 3, 2, 3])
    resp_len = torch.tensor([4, 1, 3, 2, 4, 3])
    prompt_mask = (torch.arange(P) >= P - prompt_len.unsqueeze(-1)).long()  # [N, P]
    response_mask = (torch.arange(T) < resp_len.unsqueeze(-1)).long()  # [N, T]
    prompts = torch.randint(1, VOCAB, (N, P), generator=gen) * prompt_mask
    responses = torch.randint(1, VOCAB, (N, T), generator=gen) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)  # [N, P+T]
    batch = RolloutBatch(
        {"input_ids": torch.cat([prompts, responses], dim=1), "attention_mask": attention_mask,
         "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0), "responses": responses,
         "response_mask": response_mask, "scores": torch.tensor([1.0, 0.0, 2.0, 0.0, 3.0, 1.0])},
        non_tensors={"uid": ["a", "a", "a", "b", "b", "b"]}, temperature=TEMPERATURE,
    )
    with torch.no_grad():
        current = policy_log_probs(module, batch)
    batch["old_log_probs"] = (current + 0.2 * torch.randn(N, T, generator=gen)) * response_mask
    lag = rollout_lag * torch.randn(N, T, generator=gen)
    batch["rollout_log_probs"] = (batch["old_log_probs"] + lag) * response_mask
    return batch


def prepared(module: GRPO, batch: RolloutBatch) -> RolloutBatch:
    """What the loop does before the update: advantages, then the counts of the (corrected) batch."""
    batch = module.advantage_step(batch)
    batch.global_tokens, batch.global_rows = float(batch["response_mask"].sum()), float(len(batch))
    return batch


def test_old_log_prob_stage_runs_when_the_update_cannot_supply_them() -> None:
    """A pass of its own when the policy moves within a batch or a correction rejects tokens; with
    one optimizer step and weights only, the update's own forward gives the same values."""
    module = make_module()
    assert module.compute_stages() == []  # on-policy, one optimizer step: old = current, detached
    module.attach(Attachment(off_policy=False))
    assert module.compute_stages() == [] and not module.corrects_rollouts()
    module.attach(Attachment(off_policy=True))  # async pipeline / engine numerics
    assert module.compute_stages() == [] and module.corrects_rollouts()
    assert make_module(rollout_correction="token_tis").compute_stages() == []
    assert make_module(rollout_correction="seq_tis").compute_stages() == []
    for rejecting in ["token_rs", "seq_rs", "geo_rs", "token_mis", "seq_mis", "geo_rs_token_tis", "icepop"]:
        assert make_module(rollout_correction=rejecting).compute_stages() == ["old_log_prob"], rejecting
    assert make_module(rollout_correction="token_tis", update_epochs=2).compute_stages() == ["old_log_prob"]
    assert make_module(update_epochs=2).compute_stages() == ["old_log_prob"]
    assert make_module(kl_coef=0.1, mini_batch_size=2).compute_stages() == ["old_log_prob", "ref"]
    ppo = PPO(tiny_qwen2_config(vocab_size=VOCAB), SimpleNamespace(pad_token_id=0), zero_reward)
    assert ppo.compute_stages() == ["values"]
    ppo.attach(Attachment(off_policy=True))
    assert ppo.compute_stages() == ["values"]
    ppo.update_epochs = 2
    assert ppo.compute_stages() == ["old_log_prob", "values"]


def micro_batch_update(module: GRPO, batch: RolloutBatch, bounds: list[int]
                       ) -> tuple[list[torch.Tensor], dict[str, float]]:
    """What a strategy does for one optimizer step: ``policy_step`` + backward per micro-batch (rows
    ``bounds[i]:bounds[i+1]``); returns the gradients and the combined metrics."""
    from rltrainer.strategies.strategy import combine_metrics

    module.policy.zero_grad()
    parts = []
    for lo, hi in zip(bounds, bounds[1:]):
        loss, metrics = module.policy_step(batch[lo:hi])
        loss.backward()
        parts.append(metrics)
    grads = [p.grad.clone() for p in module.policy.parameters() if p.grad is not None]
    return grads, {k: float(v) for k, v in combine_metrics(parts).items()}


@pytest.mark.parametrize("name", ["token_tis", "seq_tis", None])
def test_correction_inside_the_update_equals_the_separate_pass(name: str | None) -> None:
    """One optimizer step: correcting inside the update (old log-probs from its own forward) gives
    the gradients and ``rollout_corr/*`` metrics of the separate ``old_log_prob`` pass."""
    kwargs = {"rollout_correction": name, "rollout_correction_kwargs": {"threshold": 1.3}} if name else {}
    separate, inside = make_module(**kwargs), make_module(**kwargs)
    off_policy = Attachment(off_policy=True)
    separate.attach(off_policy), inside.attach(Attachment(off_policy=True))
    assert inside.compute_stages() == []
    full = make_batch(separate)
    raw = full.select(*[k for k in full.keys() if k != "old_log_probs"])
    with torch.no_grad():  # the old_log_prob stage: the policy before the update
        raw["rollout_log_probs"] = (policy_log_probs(separate, raw) + 0.4 * torch.randn(N, T)) * raw["response_mask"]
    with_old = raw[:]
    with torch.no_grad():
        with_old["old_log_probs"] = policy_log_probs(separate, raw)

    batch_s = prepared(separate, with_old)
    batch_i = prepared(inside, raw[:])
    assert batch_i.correct_in_update and "rollout_is_weights" not in batch_i
    expected = {k: v for k, v in off_policy.metrics.current.items() if k.startswith("rollout_corr/")}
    assert expected and ("rollout_corr/rollout_is_max" in expected) == (name is not None)
    grads_s, _ = micro_batch_update(separate, batch_s, [0, 2, 6])
    for bounds in ([0, N], [0, 2, 6]):  # one micro-batch, two of different sizes
        grads_i, metrics = micro_batch_update(inside, batch_i, bounds)
        for g_s, g_i in zip(grads_s, grads_i, strict=True):
            torch.testing.assert_close(g_i, g_s, rtol=1e-4, atol=1e-6)
        for key, value in expected.items():
            approximate = len(bounds) > 2 and (key.endswith("eff_sample_size") or (
                name == "seq_tis" and "fraction" in key))  # token-weighted over micro-batches
            if not approximate:
                assert metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (key, bounds)
        assert set(expected) <= set(metrics)


def test_policy_loss_is_weighted_by_the_truncated_ratios() -> None:
    module = make_module(rollout_correction="token_tis", rollout_correction_kwargs={"threshold": 1.2},
                         clip_ratio_c=3.0)
    batch = prepared(module, make_batch(module))
    weights, mask = batch["rollout_is_weights"], batch["response_mask"]
    rho = (batch["old_log_probs"] - batch["rollout_log_probs"]).exp() * mask
    torch.testing.assert_close(weights, rho.clamp(max=1.2))
    assert (rho > 1.2).any() and ((rho < 1.2) & (mask > 0)).any()  # both truncated and untouched weights

    loss, _ = module.policy_step(batch)
    with torch.no_grad():
        ratio = (policy_log_probs(module, batch) - batch["old_log_probs"]).exp()
    A = batch["advantages"]
    per_token = torch.maximum(-A * ratio, -A * ratio.clamp(0.8, 1.2))
    per_token = torch.where(A < 0, torch.minimum(per_token, -A * 3.0), per_token)
    expected = (per_token * weights * mask).sum() / mask.sum()
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)
    unweighted = (per_token * mask).sum() / mask.sum()
    assert not torch.allclose(expected, unweighted, rtol=1e-3)  # the weights change the loss

    m = module.logged_metrics
    torch.testing.assert_close(m["rollout_corr/rollout_is_max"], rho[mask.bool()].max().item())
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(((rho > 1.2) & (mask > 0)).sum().item()
                                                                             / mask.sum().item())
    assert 0 < m["rollout_corr/rollout_is_eff_sample_size"] < 1


@pytest.mark.parametrize(("name", "kwargs"), [("token_rs", {"low": 0.8, "high": 1.25}),
                                              ("seq_rs", {"low": 0.5, "high": 2.0}),
                                              ("token_mis", {"threshold": 1.25, "low": 0.8, "high": 1.25})])
def test_rejected_tokens_contribute_nothing(name: str, kwargs: dict) -> None:
    module = make_module(rollout_correction=name, rollout_correction_kwargs=kwargs)
    original_mask = make_batch(module)["response_mask"]
    batch = prepared(module, make_batch(module))
    kept = batch["response_mask"]
    rejected = (original_mask > 0) & (kept == 0)
    assert rejected.any() and kept.any()
    assert batch.global_tokens == kept.sum().item()  # the denominator counts kept tokens only
    assert module.logged_metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(
        rejected.sum().item() / original_mask.sum().item())

    def loss_and_grads(b: RolloutBatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
        module.policy.zero_grad()
        loss, _ = module.policy_step(b)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in module.policy.parameters() if p.grad is not None]

    loss, grads = loss_and_grads(batch)
    for field, junk in [("advantages", 1e4), ("old_log_probs", -30.0)]:  # garbage where rejected: no effect
        perturbed = batch[:]
        perturbed[field] = torch.where(rejected, junk, batch[field])
        loss2, grads2 = loss_and_grads(perturbed)
        assert torch.equal(loss, loss2), field
        for g, g2 in zip(grads, grads2, strict=True):
            assert torch.equal(g, g2), field


def test_identical_log_probs_give_zero_kl_and_full_sample_size() -> None:
    module = make_module(rollout_correction="seq_mis")
    batch = make_batch(module)
    batch["rollout_log_probs"] = batch["old_log_probs"].clone()
    batch = prepared(module, batch)
    m = module.logged_metrics
    assert m["rollout_corr/kl"] == 0.0 and m["rollout_corr/k3_kl"] == 0.0
    assert m["rollout_corr/chi2_token"] == pytest.approx(0.0, abs=1e-6)
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(1.0, abs=1e-6)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-6)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    assert torch.equal(batch["rollout_is_weights"], batch["response_mask"].float())


def test_metrics_without_a_correction() -> None:
    """Off-policy without a correction: the mismatch is logged; nothing is weighted or rejected."""
    module = make_module()
    batch = make_batch(module)
    mask = batch["response_mask"].clone()
    batch = module.advantage_step(batch)
    m = module.logged_metrics
    diff = ((batch["rollout_log_probs"] - batch["old_log_probs"]) * mask).sum() / mask.sum()
    assert m["rollout_corr/kl"] == pytest.approx(diff.item(), rel=1e-5)
    assert m["rollout_corr/k3_kl"] > 0
    assert not any(k.startswith("rollout_corr/rollout_is") for k in m)
    assert "rollout_is_weights" not in batch and torch.equal(batch["response_mask"], mask)
    module.logged_metrics.clear()
    without_old = make_batch(module).select("response_mask", "scores", "responses", "rollout_log_probs", "uid")
    module.advantage_step(without_old)
    assert not any(k.startswith("rollout_corr/") for k in module.logged_metrics)  # no old_log_probs: no metrics


def test_bad_configuration_raises_at_construction() -> None:
    with pytest.raises(ValueError, match="Unknown rollout correction 'tis'.*token_tis"):
        make_module(rollout_correction="tis")
    with pytest.raises(ValueError, match=r"has no parameter\(s\) cap"):
        make_module(rollout_correction="token_tis", rollout_correction_kwargs={"cap": 2.0})
    with pytest.raises(ValueError, match="0 < low < high"):
        make_module(rollout_correction="geo_rs", rollout_correction_kwargs={"low": 1.1, "high": 1.0})
    with pytest.raises(ValueError, match="without rollout_correction"):
        make_module(rollout_correction_kwargs={"threshold": 2.0})
    module = make_module(rollout_correction="token_tis")
    batch = make_batch(module).select("response_mask", "scores", "old_log_probs")
    with pytest.raises(KeyError, match="rollout_log_probs"):
        module.advantage_step(batch)


def test_ppo_with_a_correction() -> None:
    """PPO applies the correction too: the reward stays on the last generated token, GAE runs over the
    kept tokens, and the weights reach the actor loss."""
    module = make_module(PPO, rollout_correction="token_mis",
                         rollout_correction_kwargs={"threshold": 1.5, "low": 0.8, "high": 1.25})
    batch = make_batch(module)
    batch["values"] = torch.zeros(N, T)
    batch = prepared(module, batch)
    assert "rollout_is_weights" in batch and (batch["response_mask"] == 0).sum() > (batch["responses"] == 0).sum()
    loss, metrics = module.policy_step(batch)
    assert math.isfinite(loss.item()) and "critic/vf_loss" in metrics


@pytest.mark.parametrize("name", ["token_tis", "token_mis"])
def test_fit_with_a_correction(tiny_config, bpe_tokenizer, gsm8k_prompts, name: str) -> None:
    """End to end: the HF engine computes log-probs with the trainer's weights in fp32, so the
    mismatch is ~0 and every IS weight ~1. A weighting correction runs inside the update (no
    ``old_log_prob`` pass), a rejecting one after that pass."""
    module = GRPO(tiny_config, bpe_tokenizer, reward_funcs=zero_reward, num_generations=2, max_new_tokens=6,
                  rollout_correction=name)
    trainer = Trainer(max_steps=1, logger=False, enable_progress_bar=False)
    trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2))
    m = trainer.callback_metrics
    assert ("timing_s/old_log_prob" in m) == (name == "token_mis")
    assert abs(m["rollout_corr/kl"]) < 1e-4 and m["rollout_corr/k3_kl"] < 1e-6
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(1.0, abs=1e-4)
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(1.0, abs=1e-3)
