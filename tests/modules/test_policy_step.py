"""GRPO.policy_step: gradients independent of micro-batching, and the loss composed as
``pg_loss + kl_coef * kl_loss - entropy_coef * entropy`` from the algorithm functions."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from rltrainer.algorithms import LossContext, aggregate, kl_penalty, ppo_clip_loss
from rltrainer.data.batch import RolloutBatch
from rltrainer.modules.grpo import GRPO
from rltrainer.testing import tiny_qwen2_config

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
VOCAB, P, T, N = 64, 3, 4, 6
MAX_NEW_TOKENS = 5
TEMPERATURE = 0.7


def zero_reward(completions: list[str], **kwargs: object) -> list[float]:
    return [0.0] * len(completions)


def make_module(loss_agg_mode: str = "token-mean", kl_coef: float = 0.1, entropy_coef: float = 0.01,
                policy_loss: str = "ppo_clip", policy_loss_kwargs: dict | None = None) -> GRPO:
    module = GRPO(model=tiny_qwen2_config(vocab_size=VOCAB), tokenizer=SimpleNamespace(pad_token_id=0),
                  reward_funcs=zero_reward, kl_coef=kl_coef, entropy_coef=entropy_coef,
                  loss_agg_mode=loss_agg_mode, max_new_tokens=MAX_NEW_TOKENS, num_generations=2,
                  policy_loss=policy_loss, policy_loss_kwargs=policy_loss_kwargs)
    module.configure_model()
    return module


def manual_log_probs(model: torch.nn.Module, batch: RolloutBatch, temperature: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-sequence forward, slice the positions that predict the responses, log-softmax."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"]).logits  # [n, P+T, V]
    logits = logits[:, P - 1 : P - 1 + T].float() / temperature  # position P-1+t predicts token t
    logp_all = F.log_softmax(logits, dim=-1)
    log_probs = logp_all.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)  # [n, T]
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # [n, T]
    return log_probs, entropy


def make_batch(module: GRPO) -> RolloutBatch:
    gen = torch.Generator().manual_seed(0)
    prompt_len = torch.tensor([3, 2, 1, 3, 2, 3])  # left-padded prompts
    resp_len = torch.tensor([4, 1, 3, 2, 4, 3])  # right-padded responses
    prompt_mask = (torch.arange(P) >= P - prompt_len.unsqueeze(-1)).long()  # [N, P]
    response_mask = (torch.arange(T) < resp_len.unsqueeze(-1)).long()  # [N, T]
    prompts = torch.randint(1, VOCAB, (N, P), generator=gen) * prompt_mask
    responses = torch.randint(1, VOCAB, (N, T), generator=gen) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)  # [N, P+T]
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    batch = RolloutBatch(
        {"input_ids": torch.cat([prompts, responses], dim=1), "attention_mask": attention_mask,
         "position_ids": position_ids, "responses": responses, "response_mask": response_mask},
        global_tokens=float(response_mask.sum()), global_rows=float(N), temperature=TEMPERATURE,
    )
    with torch.no_grad():
        current, _ = manual_log_probs(module.policy, batch, TEMPERATURE)
    # old log-probs off by up to +-0.6 so that some tokens are clipped (ratios ~0.55..1.8)
    batch["old_log_probs"] = (current + (torch.rand(N, T, generator=gen) - 0.5) * 1.2) * response_mask
    batch["ref_log_probs"] = (current + (torch.rand(N, T, generator=gen) - 0.5)) * response_mask
    adv = torch.tensor([1.5, -1.0, 0.5, -2.0, 1.0, -0.5]).unsqueeze(-1) * response_mask
    batch["advantages"] = adv.float()
    return batch


def grads(module: GRPO) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in module.policy.parameters()]


@pytest.mark.parametrize("mode", MODES)
def test_micro_batch_gradients_equal_whole_batch(mode: str) -> None:
    module = make_module(mode)
    batch = make_batch(module)

    module.policy.zero_grad()
    loss_whole, metrics_whole = module.policy_step(batch)
    loss_whole.backward()
    whole = grads(module)

    module.policy.zero_grad()
    loss_parts = torch.zeros(())
    clipfrac = torch.zeros(())
    for micro in batch.split(2):  # meta (the whole batch's counts) travels with every slice
        loss, metrics = module.policy_step(micro)
        loss.backward()
        loss_parts = loss_parts + loss.detach()
        clipfrac = clipfrac + metrics["actor/pg_clipfrac"]
    parts = grads(module)

    # summation order differs: 17 tokens, each term at most max|A| * max ratio (about 2 * 1.8), so the
    # fp32 error is under 17 * u * 3.6 = 3.7e-6 (u = 2**-24)
    torch.testing.assert_close(loss_parts, loss_whole.detach(), rtol=0, atol=4e-6)
    torch.testing.assert_close(clipfrac, metrics_whole["actor/pg_clipfrac"], rtol=0, atol=1e-6)
    assert metrics_whole["actor/pg_clipfrac"] > 0  # the example exercises clipping
    assert any(g.abs().sum() > 0 for g in whole)
    # different matmul shapes: each gradient entry sums ~170 products (17 tokens x hidden 64 / heads,
    # and the vocabulary), so its error is under 170 * u * the largest gradient: 1e-5 * max|g|
    scale = max(g.abs().max().item() for g in whole)
    for g_whole, g_parts in zip(whole, parts, strict=True):
        torch.testing.assert_close(g_parts, g_whole, rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum-norm"])
def test_loss_is_pg_plus_kl_minus_entropy(mode: str) -> None:
    module = make_module(mode, kl_coef=0.1, entropy_coef=0.01)
    batch = make_batch(module)
    loss, metrics = module.policy_step(batch)

    with torch.no_grad():
        log_probs, entropy = manual_log_probs(module.policy, batch, TEMPERATURE)
    mask = batch["response_mask"]
    counts = {"global_tokens": batch.global_tokens, "global_rows": batch.global_rows,
              "max_response_length": MAX_NEW_TOKENS}
    pg, _ = ppo_clip_loss(log_probs, batch["old_log_probs"], batch["advantages"], mask, LossContext(mode, **counts),
                          clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)
    kl = aggregate(kl_penalty(log_probs, batch["ref_log_probs"], "k3"), mask, mode, **counts)
    ent = aggregate(entropy, mask, mode, **counts)
    expected = pg + 0.1 * kl - 0.01 * ent

    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(metrics["actor/pg_loss"], pg, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(metrics["actor/kl_loss"], kl, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(metrics["actor/entropy"], (entropy * mask).sum() / mask.sum(), rtol=1e-5, atol=1e-6)
    assert kl > 0 and ent > 0  # both terms actually contribute


def test_without_old_log_probs_ratio_is_one() -> None:
    """One optimizer step per batch: old = current (detached), so pg_loss = -token-mean(A)."""
    module = make_module("token-mean", kl_coef=0.0, entropy_coef=0.0)
    assert module.ref_policy is None and module.compute_stages() == []
    batch = make_batch(module).select("input_ids", "attention_mask", "position_ids", "responses",
                                      "response_mask", "advantages")
    loss, metrics = module.policy_step(batch)
    # advantages [1.5, -1, 0.5, -2, 1, -0.5] over 4, 1, 3, 2, 4, 3 tokens; 17 tokens in all
    expected = -(1.5 * 4 - 1.0 * 1 + 0.5 * 3 - 2.0 * 2 + 1.0 * 4 - 0.5 * 3) / 17
    torch.testing.assert_close(loss.detach(), torch.tensor(expected))
    assert metrics["actor/pg_clipfrac"].item() == 0.0
    assert "actor/kl_loss" not in metrics
    loss.backward()  # still differentiable through the unclipped ratio exp(lp - lp.detach())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in module.policy.parameters())


# Parameters that make each loss's own mechanism act on this small example (ratios ~0.55..1.8,
# probabilities ~1/64): clipping, masking, cut-off tokens.
LOSS_PARAMS = {
    "ppo_clip": {},
    "gspo": {"clip_ratio_low": 0.05, "clip_ratio_high": 0.05},
    "cispo": {"clip_ratio_high": 0.2},
    "sapo": {},
    "dppo_tv": {"clip_ratio_low": 0.004, "clip_ratio_high": 0.004, "clip_ratio_c": 1.5},
    "dppo_kl": {"clip_ratio_low": 1e-4, "clip_ratio_high": 1e-4, "clip_ratio_c": 1.5},
    "clip_cov": {"clip_cov_ratio": 0.3, "clip_cov_lb": 0.0, "clip_cov_ub": 10.0},
    "kl_cov": {"kl_cov_ratio": 0.2, "ppo_kl_coef": 0.5},
}


def prepare_like_advantage_step(module: GRPO, batch: RolloutBatch) -> None:
    """What ``advantage_step`` does for a loss with a batch-level ``prepare`` (Clip-Cov, KL-Cov)."""
    prepare = module.parts["loss"].prepare
    if prepare is not None:
        extras = prepare(batch["old_log_probs"], batch["advantages"], batch["response_mask"],
                         **module.parts["loss"].params)
        for name, value in extras.items():
            batch[name] = value
        batch.loss_extras = sorted(extras)


def test_every_policy_loss_is_parametrised_here() -> None:
    from rltrainer.algorithms import POLICY_LOSSES

    assert set(POLICY_LOSSES.names()) <= set(LOSS_PARAMS), "a new policy loss needs a micro-batch test here"


@pytest.mark.parametrize("split", ["rows", "tokens"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("name", list(LOSS_PARAMS))
def test_every_policy_loss_is_exact_under_micro_batching(name: str, mode: str, split: str) -> None:
    """Loss, gradients and metrics summed over micro-batches equal one pass over the mini-batch, for
    every entry: sequence-level ratios (GSPO) see whole rows, since micro-batches split by rows
    (``split``: ``batch.split`` or the Strategy's ``split_by_tokens``), and batch-level selections
    (Clip-Cov, KL-Cov) are made once, before the split."""
    module = make_module(mode, kl_coef=0.0, entropy_coef=0.0, policy_loss=name, policy_loss_kwargs=LOSS_PARAMS[name])
    batch = make_batch(module)
    prepare_like_advantage_step(module, batch)
    micro = batch.split(2) if split == "rows" else batch.split_by_tokens(2 * (P + T))
    assert len(micro) > 1 and sum(len(m) for m in micro) == len(batch)

    module.policy.zero_grad()
    loss_whole, metrics_whole = module.policy_step(batch)
    loss_whole.backward()
    whole = grads(module)
    module.policy.zero_grad()
    loss_parts, metric_parts = torch.zeros(()), {k: torch.zeros(()) for k in metrics_whole}
    for part in micro:
        loss, metrics = module.policy_step(part)
        loss.backward()
        loss_parts = loss_parts + loss.detach()
        metric_parts = {k: v + metrics[k] for k, v in metric_parts.items()}
    parts = grads(module)

    torch.testing.assert_close(loss_parts, loss_whole.detach(), rtol=0, atol=4e-6)
    for k in ("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"):
        if k in metrics_whole:
            torch.testing.assert_close(metric_parts[k], metrics_whole[k], rtol=0, atol=1e-6, msg=k)
    if "actor/pg_clipfrac" in metrics_whole and name != "ppo_clip":
        assert 0 < metrics_whole["actor/pg_clipfrac"] < 1, "the example should exercise the loss's mechanism"
    scale = max(g.abs().max().item() for g in whole)
    assert scale > 0
    for g_whole, g_parts in zip(whole, parts, strict=True):
        torch.testing.assert_close(g_parts, g_whole, rtol=0, atol=1e-5 * scale)


def test_a_users_registered_loss_runs_in_policy_step() -> None:
    """Register a loss with its own parameter (the README's five lines), choose it by name: policy_step
    calls it with the shared context (global counts: exact under micro-batching) and its parameter."""
    from rltrainer.algorithms import POLICY_LOSSES

    @POLICY_LOSSES.register("scaled_reinforce", scale=1.0)
    def scaled_reinforce(log_probs, old_log_probs, advantages, response_mask, ctx, *, scale):
        return ctx.finish(-scale * advantages * log_probs, response_mask.to(log_probs.dtype)), {}

    try:
        module = make_module("token-mean", kl_coef=0.0, entropy_coef=0.0, policy_loss="scaled_reinforce",
                             policy_loss_kwargs={"scale": 3.0})
        batch = make_batch(module)
        loss, _ = module.policy_step(batch)
        with torch.no_grad():
            log_probs, _ = manual_log_probs(module.policy, batch, TEMPERATURE)
        mask = batch["response_mask"]
        expected = -(3.0 * batch["advantages"] * log_probs * mask).sum() / mask.sum()
        torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)
        parts = sum(module.policy_step(part)[0].detach() for part in batch.split(2))
        torch.testing.assert_close(parts, loss.detach(), rtol=0, atol=4e-6)
    finally:
        POLICY_LOSSES._entries.pop("scaled_reinforce")
        POLICY_LOSSES._descriptions.pop("scaled_reinforce")
    # a training rank where the registration never ran (a Ray worker) gets the loss with the module
    from ray import cloudpickle

    shipped = cloudpickle.loads(cloudpickle.dumps(module))
    torch.testing.assert_close(shipped.policy_step(batch)[0].detach(), loss.detach())
