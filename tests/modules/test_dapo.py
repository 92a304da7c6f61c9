"""DAPO (Yu et al. 2025): the overlong penalty against verl's formula, truncated rows out of the
loss, dynamic sampling through a real Trainer (only mixed groups, a full batch, bounded rounds,
epoch and resume accounting, metrics), the paper's defaults, and the pipelines it refuses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rltrainer import DAPO, ModelCheckpoint, Trainer, prompt_dataloader
from rltrainer.algorithms.dapo import mixed_groups, overlong_penalty
from rltrainer.data.batch import RolloutBatch
from rltrainer.module import Attachment
from rltrainer.pipelines import check_module_pipeline
from rltrainer.rollout.engine import Generation
from rltrainer.rollout.rollout import Rollout
from rltrainer.strategies.fsdp2 import FSDP2Strategy
from rltrainer.testing import tiny_qwen2_config

VOCAB, P, T = 64, 3, 4


def zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def verl_overlong_reward(valid_response_length: int, max_resp_len: int, buffer_len: int, factor: float) -> float:
    """verl/workers/reward_manager/dapo.py:117-121 at b178a3c, line for line."""
    expected_len = max_resp_len - buffer_len
    exceed_len = valid_response_length - expected_len
    return min(-exceed_len / buffer_len * factor, 0)


# -- overlong shaping ---------------------------------------------------------------------------
@pytest.mark.parametrize("max_len, buffer_len, factor", [(20480, 4096, 1.0), (16, 4, 0.5), (8, 8, 2.0), (5, 1, 1.0)])
def test_overlong_penalty_equals_verls_formula(max_len, buffer_len, factor) -> None:
    lengths = torch.arange(0, max_len + 1)
    expected = torch.tensor([verl_overlong_reward(int(n), max_len, buffer_len, factor) for n in lengths])
    torch.testing.assert_close(overlong_penalty(lengths, max_len, buffer_len, factor), expected.float())


def test_overlong_penalty_values() -> None:
    # L_max 16, L_cache 4: no penalty up to 12, then -1/4 per token to -factor at 16 (and beyond)
    got = overlong_penalty(torch.tensor([0, 12, 13, 14, 16, 40]), 16, 4, factor=1.0)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    with pytest.raises(ValueError, match="0 < buffer_length <= max_length"):
        overlong_penalty(torch.tensor([1]), 4, 5)


def test_score_adds_the_penalty_to_the_task_score() -> None:
    module = dapo(max_new_tokens=10, overlong_buffer_len=4, reward_funcs=lambda c, **k: [1.0] * len(c))
    lengths = torch.tensor([3, 6, 8, 10])
    batch = RolloutBatch({"response_mask": (torch.arange(10) < lengths.unsqueeze(-1)).long()},
                         non_tensors={"response_text": ["a"] * 4, "uid": list("aabb")})
    out = module.score(batch)
    torch.testing.assert_close(out["task_scores"], torch.ones(4))
    torch.testing.assert_close(out["overlong_penalty"], torch.tensor([0.0, 0.0, -0.5, -1.0]))
    torch.testing.assert_close(out["scores"], torch.tensor([1.0, 1.0, 0.5, 0.0]))
    off = dapo(max_new_tokens=10, overlong_penalty_factor=0.0, reward_funcs=lambda c, **k: [1.0] * len(c))
    torch.testing.assert_close(off.score(batch.copy())["scores"], torch.ones(4))


# -- defaults and refusals ----------------------------------------------------------------------
def dapo(**kwargs) -> DAPO:
    defaults = {"reward_funcs": zero_reward, "num_generations": 2}
    return DAPO(tiny_qwen2_config(vocab_size=VOCAB), SimpleNamespace(pad_token_id=0), **{**defaults, **kwargs})


def test_the_papers_defaults() -> None:
    module = DAPO(tiny_qwen2_config(vocab_size=VOCAB), SimpleNamespace(pad_token_id=0), zero_reward,
                  max_new_tokens=20480)
    loss, parts = module.parts["loss"], module.parts
    assert loss.policy_loss == "ppo_clip"
    assert loss.params == {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": None}
    assert loss.loss_agg_mode == "token-mean" and parts["kl"].kl_coef == 0.0 and not module.needs_ref()
    group_filter = parts["group_filter"]
    assert module.sampling.n == 16 and group_filter.dynamic_sampling and group_filter.max_gen_rounds == 10
    overlong = parts["overlong"]
    assert overlong.buffer_len(20480) == 4096 and overlong.overlong_penalty_factor == 1.0
    assert parts["truncation"].mask_truncated
    assert overlong.buffer_len(512) == 102 and overlong.buffer_len(3) == 1
    assert module.supported_pipelines == ("sync",) and dapo(dynamic_sampling=False).supported_pipelines is None


@pytest.mark.parametrize("kwargs, message", [
    ({"max_gen_rounds": 0}, "max_gen_rounds must be an int >= 1"),
    ({"overlong_buffer_len": 600}, r"overlong_buffer_len must be an int >= 1 and <= 512 \(L_cache within L_max"),
    ({"overlong_penalty_factor": -1.0}, "overlong_penalty_factor must be a number >= 0"),
])
def test_bad_arguments_are_refused(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        dapo(**kwargs)


@pytest.mark.parametrize("pipeline", ["one_step_off", "async"])
def test_dynamic_sampling_refuses_pipelines_that_queue_prompts_ahead(pipeline, tiny_config, bpe_tokenizer,
                                                                     gsm8k_prompts) -> None:
    module = DAPO(tiny_config, bpe_tokenizer, zero_reward, num_generations=2, max_new_tokens=4)
    trainer = Trainer(strategy=FSDP2Strategy(devices=1), rollout=Rollout(placement="split"), pipeline=pipeline,
                      logger=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match=rf"DAPO runs with pipeline in 'sync', got Trainer\(pipeline='{pipeline}'\)"
                                         r".*dynamic_sampling=False"):
        trainer.fit(module, prompt_dataloader(gsm8k_prompts, 4))
    assert trainer.module is None  # refused before setup: nothing was built
    check_module_pipeline(dapo(dynamic_sampling=False), pipeline)  # without dynamic sampling: any pipeline


# -- truncated rows ------------------------------------------------------------------------------
def hand_batch() -> RolloutBatch:
    """Two groups of two rows; rows 1 and 3 were cut at max_new_tokens."""
    gen = torch.Generator().manual_seed(0)
    N = 4
    response_mask = (torch.arange(T) < torch.tensor([2, 4, 3, 4]).unsqueeze(-1)).long()  # [N, T]
    prompts = torch.randint(1, VOCAB, (N, P), generator=gen)
    responses = torch.randint(1, VOCAB, (N, T), generator=gen) * response_mask
    attention_mask = torch.cat([torch.ones(N, P, dtype=torch.long), response_mask], dim=1)
    return RolloutBatch({"input_ids": torch.cat([prompts, responses], 1), "attention_mask": attention_mask,
                         "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0), "responses": responses,
                         "response_mask": response_mask, "scores": torch.tensor([1.0, 0.0, 0.0, 1.0])},
                        non_tensors={"uid": list("aabb"), "finish_reason": ["stop", "length", "stop", "length"]})


def loss_and_grads(module: DAPO, batch: RolloutBatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    batch.global_tokens, batch.global_rows = max(float(batch["response_mask"].sum()), 1.0), float(len(batch))
    module.policy.zero_grad()
    loss, _ = module.policy_step(batch)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in module.policy.parameters() if p.grad is not None]


@pytest.mark.parametrize("mask_truncated", [True, False])
def test_truncated_rows_get_zero_loss_weight(mask_truncated) -> None:
    module = dapo(max_new_tokens=T, mask_truncated=mask_truncated)
    module.configure_model()
    batch = module.advantage_step(hand_batch())
    kept = batch[[0, 2]]  # the rows that ended with a stop token, alone
    full_loss, full_grads = loss_and_grads(module, batch)
    kept_loss, kept_grads = loss_and_grads(module, kept)
    same = torch.allclose(full_loss, kept_loss) and all(torch.allclose(a, b) for a, b in zip(full_grads, kept_grads))
    if mask_truncated:
        assert batch["response_mask"][[1, 3]].sum() == 0 and batch["advantages"][[1, 3]].abs().sum() == 0
        assert batch["response_mask"][[0, 2]].sum() == 5  # the others untouched
        assert batch.global_tokens == 5.0 and same  # no loss term, no token in the count
        assert module.logged_metrics["overlong/masked_share"] == 0.5
        # the truncated rows' scores still entered their groups: each group is (1, 0) -> +-0.707
        torch.testing.assert_close(batch["advantages"][0, 0], torch.tensor(0.7071), atol=1e-3, rtol=0)
    else:
        assert batch["response_mask"][[1, 3]].sum() == 8 and not same


def test_mask_truncated_needs_finish_reason() -> None:
    batch = hand_batch()
    batch.non_tensors.pop("finish_reason")
    with pytest.raises(KeyError, match="mask_truncated=True needs 'finish_reason'.*mask_truncated=False"):
        dapo().advantage_step(batch)


def test_mixed_groups_keeps_groups_with_unequal_scores() -> None:
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.2])
    assert mixed_groups(scores, list("aabbccdd")) == [[2, 3], [6, 7]]
    assert mixed_groups(torch.zeros(4), list("aabb")) == []


# -- dynamic sampling through a real Trainer -----------------------------------------------------
def mixed_if_flagged(completions, mixed, **kwargs):
    """0/1 inside a group of flagged prompts (rows of a group are adjacent, G = 2), 0 for all others."""
    return [float(i % 2) if flag else 0.0 for i, flag in enumerate(mixed)]


class RecordingDAPO(DAPO):
    def advantage_step(self, batch):
        self.__dict__.setdefault("trained", []).append(batch)
        return super().advantage_step(batch)


def flagged_prompts(gsm8k_prompts, flags: str) -> list[dict]:
    return [{"prompt_ids": gsm8k_prompts[i]["prompt_ids"], "idx": i, "mixed": flag == "1"}
            for i, flag in enumerate(flags)]


def run(tiny_config, bpe_tokenizer, rows, module_kwargs=None, ckpt_path=None, **trainer_kwargs
        ) -> tuple[RecordingDAPO, Trainer]:
    module = RecordingDAPO(tiny_config, bpe_tokenizer, mixed_if_flagged, num_generations=2, max_new_tokens=6,
                           lr=1e-3, **(module_kwargs or {}))
    trainer = Trainer(logger=False, enable_progress_bar=False, seed=3, **trainer_kwargs)
    trainer.fit(module, prompt_dataloader(rows, batch_size=4, shuffle=False), ckpt_path=ckpt_path)
    return module, trainer


# 12 prompts, loader batches of 4: batch 0 has 2 mixed (0, 3), batch 1 has 1 (6), batch 2 has 2 (8, 9)
FLAGS = "100100101100"


def test_dynamic_sampling_trains_a_full_batch_of_mixed_groups(tiny_config, bpe_tokenizer, gsm8k_prompts) -> None:
    module, trainer = run(tiny_config, bpe_tokenizer, flagged_prompts(gsm8k_prompts, FLAGS), max_epochs=1)
    assert trainer.global_step == 1  # three loader batches made one step; the epoch has no prompts left
    (batch,) = module.trained
    assert len(batch) == 8 and list(batch["idx"]) == [0, 0, 3, 3, 6, 6, 8, 8]  # the first 4 mixed groups
    assert all(batch["mixed"]) and sorted(batch["task_scores"].tolist()) == [0.0] * 4 + [1.0] * 4
    assert batch["prompt_position"][:, :2].tolist() == [[0, 0]] * 4 + [[0, 1]] * 2 + [[0, 2]] * 2
    m = trainer.callback_metrics
    assert m["dynamic_sampling/gen_rounds"] == 3 and m["dynamic_sampling/generated_groups"] == 12
    assert m["dynamic_sampling/dropped_group_share"] == pytest.approx(7 / 12)  # all but 0, 3, 6, 8, 9
    assert m["dynamic_sampling/surplus_groups"] == 1 and m["dynamic_sampling/short_groups"] == 0  # prompt 9
    for key in ("overlong/penalty_mean", "overlong/penalized_share", "overlong/masked_share",
                "critic/task_score/mean", "actor/pg_loss", "critic/groups/zero_std_ratio"):
        assert key in m, key
    assert m["critic/groups/zero_std_ratio"] == 0.0 and m["critic/task_score/mean"] == 0.5
    assert trainer.current_epoch == 1 and trainer.batches_seen_in_epoch == 0


def test_without_dynamic_sampling_every_group_is_trained(tiny_config, bpe_tokenizer, gsm8k_prompts) -> None:
    module, trainer = run(tiny_config, bpe_tokenizer, flagged_prompts(gsm8k_prompts, FLAGS),
                          {"dynamic_sampling": False}, max_epochs=1)
    assert trainer.global_step == 3 and [len(b) for b in module.trained] == [8, 8, 8]
    assert "dynamic_sampling/gen_rounds" not in trainer.callback_metrics


def test_the_bound_on_generation_rounds_raises(tiny_config, bpe_tokenizer, gsm8k_prompts) -> None:
    with pytest.raises(RuntimeError, match=r"kept 3 of the 4 groups a step needs after 2 generation rounds "
                                           r"\(max_gen_rounds=2\): 5 of 8 groups had all-equal rewards"):
        run(tiny_config, bpe_tokenizer, flagged_prompts(gsm8k_prompts, FLAGS), {"max_gen_rounds": 2}, max_epochs=1)


@pytest.mark.parametrize("flags, steps, groups", [("100000010000", 1, 2), ("0000" * 3, 0, 0)])
def test_at_the_end_of_the_data_it_trains_what_it_kept(flags, steps, groups, tiny_config, bpe_tokenizer,
                                                       gsm8k_prompts) -> None:
    module, trainer = run(tiny_config, bpe_tokenizer, flagged_prompts(gsm8k_prompts, flags),
                          {"max_gen_rounds": None}, max_epochs=1)
    trained = module.__dict__.get("trained", [])
    assert trainer.global_step == steps and [len(b) // 2 for b in trained] == [groups][:steps]
    if steps:
        assert trainer.callback_metrics["dynamic_sampling/short_groups"] == 4 - groups
    assert trainer.current_epoch == 1


def test_resume_continues_after_the_drawn_batches(tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path) -> None:
    rows = flagged_prompts(gsm8k_prompts, FLAGS)
    _, first = run(tiny_config, bpe_tokenizer, rows, max_steps=1, max_epochs=2, default_root_dir=tmp_path,
                   callbacks=[ModelCheckpoint(every_n_steps=1)])
    assert (first.current_epoch, first.batches_seen_in_epoch) == (0, 3)  # step 1 consumed batches 0, 1 and 2
    resumed, second = run(tiny_config, bpe_tokenizer, rows, max_epochs=2, default_root_dir=tmp_path,
                          ckpt_path="last")
    assert second.global_step == 2 and second.current_epoch == 2
    (batch,) = resumed.trained  # the second epoch's step, from its first batch on
    assert set(batch["prompt_position"][:, 0].tolist()) == {1} and list(batch["idx"]) == [0, 0, 3, 3, 6, 6, 8, 8]


class DrawsAndDiscards(RecordingDAPO):
    """Draws the next loader batch and trains on none of it: the resume position must still pass it."""

    def rollout_step(self, batch, engine):
        out = super().rollout_step(batch, engine)
        self.draw_prompts()
        return out


def test_a_drawn_batch_is_consumed_even_if_none_of_it_is_trained(tiny_config, bpe_tokenizer, gsm8k_prompts) -> None:
    rows = flagged_prompts(gsm8k_prompts, "1" * 12)
    module = DrawsAndDiscards(tiny_config, bpe_tokenizer, mixed_if_flagged, num_generations=2, max_new_tokens=4,
                              dynamic_sampling=False)
    trainer = Trainer(logger=False, enable_progress_bar=False, max_steps=1, max_epochs=1)
    trainer.fit(module, prompt_dataloader(rows, batch_size=4, shuffle=False))
    assert (trainer.current_epoch, trainer.batches_seen_in_epoch) == (0, 2)  # batch 1 was drawn, not trained
    trainer.max_steps = 2
    trainer.fit(module, prompt_dataloader(rows, batch_size=4, shuffle=False))
    assert [sorted(set(b["prompt_position"][:, 1].tolist())) for b in module.trained] == [[0], [2]]


class LengthByIndexEngine:
    """A fake engine: sample j of every prompt has 2 + 2j tokens (of at most 4), all ending with a stop."""

    weight_version = 0

    def generate(self, prompts, sampling):
        rows = len(prompts) * sampling.n
        lengths = torch.tensor([2 + 2 * j for _ in prompts for j in range(sampling.n)])
        mask = (torch.arange(4) < lengths.unsqueeze(-1)).long()
        return Generation(mask.clone(), mask, torch.zeros(rows, 4), ["x"] * rows, ["stop"] * rows)


def test_groups_are_filtered_on_the_task_score_not_the_shaped_one() -> None:
    """Every task score is 1; the overlong penalty (L_max 4, L_cache 2) makes each group's shaped
    scores (1, 0) unequal. The paper filters on accuracy, so every group is dropped."""
    module = dapo(max_new_tokens=4, overlong_buffer_len=2, reward_funcs=lambda c, **k: [1.0] * len(c))
    drawn = []
    module.attach(Attachment())
    module._prompt_source = SimpleNamespace(draw_prompts=lambda: drawn.append(1))  # no more data
    prompts = RolloutBatch.from_rows([{"prompt_ids": [1, 2]}, {"prompt_ids": [3]}])
    out = module.rollout_step(prompts, LengthByIndexEngine())
    assert len(out) == 0 and drawn == [1]
    metrics = module.logged_metrics
    assert metrics["dynamic_sampling/dropped_group_share"] == 1.0 and metrics["dynamic_sampling/gen_rounds"] == 1
    shaped = module.score(module.default_rollout(prompts, LengthByIndexEngine()))["scores"]
    assert shaped.tolist() == [1.0, 0.0, 1.0, 0.0]  # unequal: filtering on these would keep both groups
    module._prompt_source = None  # called by hand: filters the given prompts' groups, draws nothing
    assert len(module.rollout_step(prompts, LengthByIndexEngine())) == 0
