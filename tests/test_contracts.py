"""Every hook's result is checked where it comes back: a broken contract raises naming the hook, the
field, what was expected and what came back (rltrainer/contracts.py), on the controller and on the
training ranks; the docs page's table is the declared contract."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from rltrainer import GRPO, Trainer, prompt_dataloader
from rltrainer.contracts import CONTRACTS, HookContractError, markdown_table
from rltrainer.rollout.rollout import Rollout
from rltrainer.strategies import FSDP2Strategy

PAGE = Path(__file__).resolve().parents[1] / ".ci" / "docs" / "pages" / "hooks.md"


def parity_reward(completions, **kwargs):
    return [float(len(c) % 2) for c in completions]


class Forgets(GRPO):
    """reward_step without ``return batch``."""

    def reward_step(self, batch):
        super().reward_step(batch)


class RowAdvantages(GRPO):
    """advantages [N] instead of [N, T]."""

    def advantage_step(self, batch):
        batch = super().advantage_step(batch)
        batch["advantages"] = batch["advantages"][:, 0]
        return batch


class OnlyLoss(GRPO):
    """policy_step returning the loss alone."""

    def policy_step(self, micro_batch):
        return super().policy_step(micro_batch)[0]


class ListScores(GRPO):
    def reward_step(self, batch):
        batch = super().reward_step(batch)
        batch["scores"] = batch["scores"].tolist()
        return batch


class NumpyScores(GRPO):
    def reward_step(self, batch):
        batch = super().reward_step(batch)
        batch["scores"] = batch["scores"].numpy()
        return batch


class DetachedLoss(GRPO):
    def policy_step(self, micro_batch):
        loss, metrics = super().policy_step(micro_batch)
        return loss.detach(), metrics


class NoneCompute(GRPO):
    def compute_step(self, micro_batch, stage):
        super().compute_step(micro_batch, stage)


class ShortLogProbs(GRPO):
    def compute_step(self, micro_batch, stage):
        out = super().compute_step(micro_batch, stage)
        return {k: v[:, :-1] for k, v in out.items()}


class NoRollout(GRPO):
    def rollout_step(self, batch, engine):
        super().rollout_step(batch, engine)


class FloatValidation(GRPO):
    def validation_step(self, batch, engine):
        return super().validation_step(batch, engine)["val/score"]


def fit(cls, config, tokenizer, prompts, pipeline="sync", val=False, strategy="single", rollout="hf", **kwargs):
    module = cls(config, tokenizer, reward_funcs=parity_reward, num_generations=2, max_new_tokens=4, lr=1e-3,
                 **kwargs)
    trainer = Trainer(strategy=strategy, rollout=rollout, max_steps=2, logger=False, enable_progress_bar=False,
                      pipeline=pipeline)
    loader = prompt_dataloader(prompts, batch_size=4)
    trainer.fit(module, loader, val_dataloaders=prompt_dataloader(prompts, 2, shuffle=False) if val else None)
    return trainer


# (module, the words the message must hold: hook, field, expected, received)
BROKEN = [
    (Forgets, ["Forgets.reward_step", "returned None", "return batch", "scores [N] float"]),
    (RowAdvantages, ["RowAdvantages.advantage_step", "'advantages'", "shape [8]", "advantages [N, T] float = [8, 4]"]),
    (OnlyLoss, ["OnlyLoss.policy_step", "only a tensor of shape []", "(loss, metrics)"]),
    (ListScores, ["ListScores.reward_step", "'scores'", "non-tensor", "list", "a tensor scores [N] float"]),
    (NumpyScores, ["NumpyScores.reward_step", "'scores'", "non-tensor", "ndarray", "a tensor scores [N] float"]),
    (DetachedLoss, ["DetachedLoss.policy_step", "does not require grad", "0-d float tensor"]),
    (NoneCompute, ["NoneCompute.compute_step(stage='old_log_prob')", "returned None", "old_log_probs [N, T] float"]),
    (ShortLogProbs, ["ShortLogProbs.compute_step(stage='old_log_prob')", "'old_log_probs'", "shape [8, 3]",
                     "[8, 4]"]),
    (NoRollout, ["NoRollout.rollout_step", "returned None", "responses [N, T] int", "return batch"]),
]


@pytest.mark.parametrize("cls, words", BROKEN, ids=[c.__name__ for c, _ in BROKEN])
def test_a_broken_contract_names_the_hook_field_expected_and_received(cls, words, tiny_config, bpe_tokenizer,
                                                                      gsm8k_prompts):
    # OldLogProbs stages run only when something needs them: two mini-batches make the policy move
    kwargs = {"mini_batch_size": 4} if "Compute" in cls.__name__ or "LogProbs" in cls.__name__ else {}
    with pytest.raises(HookContractError) as caught:
        fit(cls, tiny_config, bpe_tokenizer, gsm8k_prompts, **kwargs)
    for word in words:
        assert word in str(caught.value), (word, str(caught.value))
    assert isinstance(caught.value, TypeError) and isinstance(caught.value, ValueError)  # older handlers still catch it


def test_validation_step_returning_a_number_is_refused(tiny_config, bpe_tokenizer, gsm8k_prompts):
    with pytest.raises(HookContractError, match=r"FloatValidation.validation_step returned a float as the "
                                                r"validation metrics; expected a dict of numbers"):
        fit(FloatValidation, tiny_config, bpe_tokenizer, gsm8k_prompts, val=True)


@pytest.mark.usefixtures("warm_ranks")  # the split replica reuses a warm process (tests/conftest.py)
def test_rollout_step_is_checked_in_a_pipeline_thread(tiny_config, bpe_tokenizer, gsm8k_prompts, ray_session):
    strategy = FSDP2Strategy(devices=1, micro_batch_size=4)
    with pytest.raises(HookContractError, match=r"NoRollout.rollout_step returned None.*return batch"):
        fit(NoRollout, tiny_config, bpe_tokenizer, gsm8k_prompts, pipeline="one_step_off", strategy=strategy,
            rollout=Rollout(placement="split"))


def test_healthy_hooks_pass_and_results_come_back_unchanged(tiny_config, bpe_tokenizer, gsm8k_prompts):
    trainer = fit(GRPO, tiny_config, bpe_tokenizer, gsm8k_prompts, mini_batch_size=4, kl_coef=0.1)
    assert trainer.global_step == 2 and "critic/advantages/mean" in trainer.callback_metrics
    assert "val/score" in trainer.validate(dataloaders=prompt_dataloader(gsm8k_prompts, 2, shuffle=False))


@pytest.mark.usefixtures("warm_ranks")  # ranks reuse warm processes (tests/conftest.py)
def test_policy_step_is_checked_on_the_ranks_of_a_multi_process_strategy(tiny_config, bpe_tokenizer,
                                                                           gsm8k_prompts, ray_session):
    module = OnlyLoss(tiny_config, bpe_tokenizer, reward_funcs=parity_reward, num_generations=2, max_new_tokens=4)
    trainer = Trainer(strategy=FSDP2Strategy(devices=2), max_steps=1, logger=False, enable_progress_bar=False)
    with pytest.raises(Exception) as caught:
        trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=4))
    text = str(caught.value)
    assert "OnlyLoss.policy_step returned only a tensor of shape []" in text and "(loss, metrics)" in text


def test_the_docs_page_holds_the_declared_contract():
    page = PAGE.read_text()
    assert markdown_table() in page, "regenerate the table in .ci/docs/pages/hooks.md from contracts.markdown_table()"
    for hook in CONTRACTS:
        assert f"## `{hook}`" in page, f"hooks.md has no section for {hook}"


def test_field_checks_read_shapes_and_dtypes_not_rows():
    from rltrainer.contracts import Field, check_field
    from rltrainer.data.batch import RolloutBatch

    batch = RolloutBatch({"responses": torch.zeros(3, 5, dtype=torch.long), "scores": torch.zeros(3, dtype=torch.long)})
    with pytest.raises(HookContractError, match=r"'scores' of dtype int64; expected float"):
        check_field("M.reward_step", batch, Field("scores", "N", "float"), {"N": 3, "T": 5})
    batch["mask"] = np.array([1, 0, 1])
    with pytest.raises(HookContractError, match=r"'mask' as a Python list or numpy array \(a non-tensor field: .*\); expected a tensor mask \[N, T\] int or bool\.$"):
        check_field("M.hook", batch, Field("mask", "N, T", "mask"), {"N": 3, "T": 5})
