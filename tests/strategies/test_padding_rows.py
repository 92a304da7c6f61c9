"""A rank short of rows runs padding micro-batches; a user's loss that ignores ``response_mask``
must get no gradient (and no metrics) from them."""

from __future__ import annotations

import contextlib

import pytest
import torch

from rltrainer import GRPO
from rltrainer.data.batch import RolloutBatch
from rltrainer.models import response_log_probs
from rltrainer.strategies import FSDP2Strategy, SingleDeviceStrategy
from rltrainer.strategies.dispatch import partition_for_ranks
from rltrainer.strategies.strategy import run_train_step
from rltrainer.testing import length_reward, prepared_batch


class MaskIgnoringGRPO(GRPO):
    """A REINFORCE loss that forgets the mask: every position of every row it sees counts."""

    def policy_step(self, micro_batch):
        log_probs, _ = response_log_probs(self.policy, micro_batch)  # [n, T]
        weight = 1.0 + micro_batch["responses"].float() * 0.0  # ones, padding included
        loss = -(micro_batch["advantages"].abs() + 1.0).mul(log_probs * weight).sum() / micro_batch.global_rows
        return loss, {"user/rows_seen": float(len(micro_batch))}


def make_module(config, tokenizer, **kwargs):
    defaults = dict(reward_funcs=length_reward, num_generations=3, max_new_tokens=6, lr=1e-3)
    return MaskIgnoringGRPO(config, tokenizer, **{**defaults, **kwargs})


def test_padding_micro_batch_adds_no_gradient_and_no_metrics(tiny_config, bpe_tokenizer, gsm8k_prompts):
    module = make_module(tiny_config, bpe_tokenizer)
    strategy = SingleDeviceStrategy(device="cpu")
    strategy.setup(module, seed=3)
    torch.manual_seed(0)
    batch = prepared_batch(module, strategy, RolloutBatch.from_rows([gsm8k_prompts[i] for i in range(2)]))
    parts, _ = partition_for_ranks(batch[[0, 1, 2]], 2, micro_batch_size=1, max_tokens=None)
    pad = [mb for mb in parts[1] if mb.padding]
    assert len(pad) == 1 and pad[0]["response_mask"].sum() == 0 and pad[0]["advantages"].abs().sum() == 0

    def grads(micro_batches):
        opt = torch.optim.SGD(module.policy.parameters(), lr=0.0)
        metrics, _ = run_train_step(module, micro_batches, [module.policy], [opt], [], None, contextlib.nullcontext)
        return metrics, [p.grad.clone() for p in module.policy.parameters()]

    real = parts[1][:-1]
    plain_metrics, plain = grads(real)
    padded_metrics, padded = grads(real + pad)
    assert plain_metrics["user/rows_seen"] == padded_metrics["user/rows_seen"] == 1.0  # the pad's metrics dropped
    for a, b in zip(plain, padded):
        assert torch.equal(a, b)


@pytest.mark.usefixtures("warm_ranks")  # ranks reuse warm processes (tests/conftest.py)
def test_two_fsdp2_ranks_with_a_mask_ignoring_loss_match_one_device(tiny_config, bpe_tokenizer, gsm8k_prompts,
                                                                    ray_session):
    prompts = RolloutBatch.from_rows([gsm8k_prompts[i] for i in range(3)])
    single_module = make_module(tiny_config, bpe_tokenizer)
    single = SingleDeviceStrategy(device="cpu", micro_batch_size=16)
    single.setup(single_module, seed=7)
    torch.manual_seed(0)
    batch = prepared_batch(single_module, single, prompts)  # 9 rows: 5 and 4 per rank
    fsdp = FSDP2Strategy(devices=2, micro_batch_size=2)  # 3 micro-batches on one rank, 2 + a padding one on the other
    parts, _ = partition_for_ranks(batch, 2, micro_batch_size=2, max_tokens=None)
    assert sum(mb.padding for p in parts for mb in p) == 1
    try:
        fsdp.setup(make_module(tiny_config, bpe_tokenizer), seed=7)
        m_single = single.train_step(batch)
        m_fsdp = fsdp.train_step(batch)
        assert m_fsdp["user/rows_seen"] == m_single["user/rows_seen"] == 9.0
        assert m_fsdp["actor/grad_norm"] == pytest.approx(m_single["actor/grad_norm"], rel=1e-4)
        after = dict(fsdp.export_weights())
        for name, p in single_module.policy.named_parameters():
            torch.testing.assert_close(after[name], p.detach(), rtol=0, atol=1e-5, msg=name)
    finally:
        fsdp.teardown()
