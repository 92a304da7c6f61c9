"""``ModelCheckpoint(monitor=..., mode=..., save_top_k=...)`` (issue 44, item 15): a run keeps its best
checkpoints by a validation metric beside its newest, the ranking survives a resume (the scores
travel in each checkpoint's checksummed ``trainer.pt``), and a bad setting is refused where it is
written."""

from __future__ import annotations

import os

import pytest

from rltrainer import GRPO, ModelCheckpoint, Trainer, prompt_dataloader
from rltrainer.checkpoints import read_trainer_state

KEY = "ModelCheckpoint{monitor='val/accuracy', mode='max'}"


def zero_reward(completions, **kwargs):
    return [0.0 for _ in completions]


class Scripted(GRPO):
    """Validation returns the next of ``scores`` (no generation: the test sets what the run scores)."""

    def __init__(self, *args, scores=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.scores = list(scores)

    def validation_step(self, batch, engine):
        return {"val/accuracy": self.scores.pop(0), "val/rows": 1.0}


def fit(config, tokenizer, prompts, root, max_steps, scores, ckpt_path=None, **checkpoint):
    module = Scripted(config, tokenizer, reward_funcs=zero_reward, num_generations=2, max_new_tokens=2, lr=1e-3,
                      scores=scores)
    callback = ModelCheckpoint(**checkpoint)
    trainer = Trainer(max_steps=max_steps, logger=False, enable_progress_bar=False, default_root_dir=root,
                      callbacks=[callback], **({"val_check_interval": 1} if len(scores) > 1 else {}))
    trainer.fit(module, prompt_dataloader(prompts, batch_size=2, shuffle=False),
                prompt_dataloader(prompts.select(range(2)), batch_size=2, shuffle=False), ckpt_path=ckpt_path)
    assert not module.scores, "every scripted validation ran"
    return callback


def names(directory):
    return sorted(p.name for p in directory.iterdir())


def test_the_best_by_a_validation_metric_and_the_newest_are_kept_across_a_resume(tmp_path, tiny_config,
                                                                                   bpe_tokenizer, gsm8k_prompts):
    checkpoints = tmp_path / "checkpoints"
    ranked = {"every_n_steps": 2, "monitor": "val/accuracy", "mode": "max"}
    # step 0 (before the first step: no checkpoint) scores 0.95; step 1 0.2 (the best checkpoint so far: saved), 2 the
    # best (0.9), 3 less (not saved: no every_n step), 4 saved as the newest
    first = fit(tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path, 4, [0.95, 0.2, 0.9, 0.5, 0.3], **ranked)
    assert names(checkpoints) == ["last.ckpt", "step=2.ckpt", "step=4.ckpt"]
    assert os.readlink(checkpoints / "last.ckpt") == "step=4.ckpt"
    assert first.best_model_path == checkpoints / "step=2.ckpt" and first.best_model_score == pytest.approx(0.9)
    assert read_trainer_state(checkpoints / "step=4.ckpt")["callbacks"][KEY]["scores"] == pytest.approx(
        {"step=2.ckpt": 0.9, "step=4.ckpt": 0.3})
    # resumed: step 5 (0.6) is worse than step 2's 0.9, so step 2 stays (a run that forgot the scores deleted it)
    second = fit(tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path, 6, [0.6, 0.4], ckpt_path="last", **ranked)
    assert names(checkpoints) == ["last.ckpt", "step=2.ckpt", "step=6.ckpt"]
    assert second.best_model_path == checkpoints / "step=2.ckpt"
    # mode="min" keeps the lowest; save_top_k=2 the two best
    fit(tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path / "min", 4, [0.0, 0.5, 0.1, 0.3, 0.7], every_n_steps=100,
        monitor="val/accuracy", mode="min", save_top_k=2)
    assert names(tmp_path / "min" / "checkpoints") == ["last.ckpt", "step=2.ckpt", "step=3.ckpt", "step=4.ckpt"]


def test_the_validation_at_the_end_of_fit_scores_the_last_checkpoint(tmp_path, tiny_config, bpe_tokenizer,
                                                                     gsm8k_prompts):
    """Step 2 is saved (every_n_steps) before fit's closing validation scores it: it is saved again, with its score."""
    callback = fit(tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path, 2, [0.75], every_n_steps=2,
                   monitor="val/accuracy", mode="max")
    assert callback.best_model_path == tmp_path / "checkpoints" / "step=2.ckpt"
    assert read_trainer_state(callback.best_model_path)["callbacks"][KEY]["scores"] == {"step=2.ckpt": 0.75}


def test_a_metric_validation_does_not_log_is_named_with_those_it_does(tmp_path, tiny_config, bpe_tokenizer,
                                                                      gsm8k_prompts):
    with pytest.raises(ValueError, match=r"monitor='val/acc'\): validation logged no such metric; it logged "
                                         r"val/accuracy. Monitor one of them"):
        fit(tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path, 2, [0.5, 0.5], monitor="val/acc", mode="max")


@pytest.mark.parametrize("kwargs, message", [
    ({"monitor": "val/accuracy", "mode": "maximum"}, r"mode must be 'min' .* or 'max' .*got 'maximum'"),
    ({"save_top_k": 3}, r"save_top_k=3 keeps the best checkpoints by a metric, but monitor is None"),
    ({"monitor": "val/accuracy", "save_top_k": 0}, r"save_top_k must be an int >= 1"),
    ({"monitor": ""}, r"monitor must be a metric's name"),
])
def test_bad_ranking_settings_are_refused_where_they_are_written(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelCheckpoint(**kwargs)
