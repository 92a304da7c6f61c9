"""Issue 46, point 4: one GRPO step written with the primitives equals the same step through
``Trainer.fit`` on the ``single`` strategy: same data, loss, gradients and weights."""

from __future__ import annotations

import torch

from rltrainer import GRPO, Trainer, prompt_dataloader
from rltrainer.algorithms.losses import POLICY_LOSSES, LossContext
from rltrainer.own_loop import AdamParams, Datum, TrainingClient


def length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def trainer_step(tiny_config, tokenizer, prompts, tmp_path):
    """One ``Trainer.fit`` step; the update's batch, metrics, and the weights and gradients around it."""
    module = GRPO(tiny_config, tokenizer, reward_funcs=length_reward, num_generations=4, max_new_tokens=6, lr=1e-2)
    trainer = Trainer(strategy="single", max_steps=1, logger=False, enable_progress_bar=False,
                      default_root_dir=tmp_path, callbacks=[])
    seen = {}
    original = trainer.strategy.train_step

    def train_step(mini_batch):
        policy = trainer.strategy.module.policy
        seen["before"] = {n: p.detach().clone() for n, p in policy.named_parameters()}
        seen["batch"], seen["metrics"] = mini_batch, original(mini_batch)
        seen["grads"] = {n: p.grad.clone() for n, p in policy.named_parameters()}
        seen["after"] = {n: p.detach().clone() for n, p in policy.named_parameters()}
        return seen["metrics"]

    trainer.strategy.train_step = train_step
    trainer.fit(module, prompt_dataloader(prompts, batch_size=1))
    return module, seen


def test_a_grpo_step_with_the_primitives_equals_trainer_fit_on_single(tiny_config, bpe_tokenizer, gsm8k_prompts,
                                                                      tmp_path):
    module, seen = trainer_step(tiny_config, bpe_tokenizer, gsm8k_prompts.select(range(1)), tmp_path / "fit")
    batch = seen["batch"]
    assert batch["advantages"].abs().sum() > 0  # the rows' lengths differ: a gradient to compare

    client = TrainingClient(tiny_config, bpe_tokenizer, strategy="single", device="cpu", root=tmp_path / "own")
    with torch.no_grad():  # the same start (it is already: both seed 0; this keeps the test about the step)
        for name, p in client.strategy.module.policy.named_parameters():
            p.copy_(seen["before"][name])
    # the batch as datums: each row's prompt and response, one sequence; where its response starts
    prompt_mask = batch["attention_mask"][:, : batch["prompts"].shape[1]].bool()
    datums, starts = [], []
    for i in range(len(batch)):
        prompt = batch["prompts"][i][prompt_mask[i]].tolist()
        response = batch["responses"][i][batch["response_mask"][i].bool()].tolist()
        full = prompt + response
        datums.append(Datum(full[:-1], {"target_tokens": torch.tensor(full[1:])}))
        starts.append(len(prompt) - 1)
    T = batch["responses"].shape[1]
    counts = {"global_tokens": batch.global_tokens, "global_rows": batch.global_rows,
              "max_response_length": module.sampling.max_new_tokens}

    def grpo_loss(data, logprobs):
        """GRPO's own loss (rltrainer's ppo_clip entry, token-mean) over the responses' log-probs."""
        rows = [torch.nn.functional.pad(lp[s: s + int(n)], (0, T - int(n)))
                for lp, s, n in zip(logprobs, starts, batch["response_mask"].sum(1))]
        lp = torch.stack(rows)  # [n, T]
        loss, _ = POLICY_LOSSES.get("ppo_clip")(lp, lp.detach(), batch["advantages"], batch["response_mask"],
                                                LossContext("token-mean", **counts), **POLICY_LOSSES.defaults("ppo_clip"))
        return loss, {}

    out = client.forward_backward(datums, grpo_loss).result()
    # GRPO's optimizer: torch AdamW defaults, weight decay 0.01, the Trainer's clip at 1.0
    client.optim_step(AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                                 grad_clip_norm=1.0)).result()

    assert out.metrics["loss:sum"] == float(seen["metrics"]["actor/pg_loss"])
    policy = client.strategy.module.policy
    for name, p in policy.named_parameters():
        assert torch.equal(p.grad, seen["grads"][name]), name
        assert torch.equal(p.detach(), seen["after"][name]), name
