"""The Trainer's contract: hook order, argument and input errors, end-to-end GRPO, resume."""

from __future__ import annotations

import csv
import math

import pytest
import torch

from rltrainer import GRPO, Callback, ModelCheckpoint, RLModule, RolloutBatch, Trainer, prompt_dataloader
from rltrainer.models import response_log_probs


def zero_reward(completions, **kwargs):
    return [float(len(c) % 2) for c in completions]


def make_module(config, tokenizer, **kwargs):
    defaults = dict(reward_funcs=zero_reward, num_generations=2, max_new_tokens=8, lr=1e-3)
    return GRPO(config, tokenizer, **{**defaults, **kwargs})


class Recorder(Callback):
    def __init__(self, calls):
        self.calls = calls

    def __getattribute__(self, name):
        if name.startswith("on_"):
            return lambda trainer, module, *a: object.__getattribute__(self, "calls").append("cb:" + name)
        return object.__getattribute__(self, name)


MODULE_HOOKS = ["configure_model", "configure_optimizers", "rollout_step", "reward_step", "compute_step",
                "advantage_step", "policy_step", "validation_step", "on_fit_start", "on_fit_end", "on_step_start",
                "on_step_end", "on_validation_start", "on_validation_end"]


def recording_module(config, tokenizer, calls, **kwargs):
    class RecordingGRPO(GRPO):
        pass

    for name in MODULE_HOOKS:
        def hook(self, *args, __name=name, **kw):
            calls.append(__name if __name != "compute_step" else f"compute_step:{args[1]}")
            return getattr(GRPO, __name)(self, *args, **kw)
        setattr(RecordingGRPO, name, hook)
    return RecordingGRPO(config, tokenizer, **{**dict(reward_funcs=zero_reward, num_generations=2,
                                                      max_new_tokens=4), **kwargs})


def test_hook_order(tiny_config, bpe_tokenizer, gsm8k_prompts):
    calls: list[str] = []
    module = recording_module(tiny_config, bpe_tokenizer, calls, kl_coef=0.1, mini_batch_size=4)
    trainer = Trainer(max_steps=2, val_check_interval=2, limit_val_batches=1, logger=False,
                      enable_progress_bar=False, callbacks=[Recorder(calls)])
    loader = prompt_dataloader(gsm8k_prompts, batch_size=4)
    trainer.fit(module, loader, val_dataloaders=prompt_dataloader(gsm8k_prompts, 2, shuffle=False))
    # 4 prompts x 2 samples = 8 rows; micro_batch_size 8 -> one compute micro-batch; mini-batches of 4 -> 2 updates
    step = ["on_step_start", "cb:on_step_start", "rollout_step", "reward_step", "compute_step:old_log_prob",
            "compute_step:ref", "advantage_step", "policy_step", "policy_step"]
    validation = ["on_validation_start", "cb:on_validation_start", "validation_step", "reward_step",
                  "on_validation_end", "cb:on_validation_end"]
    expected = (["configure_model", "configure_optimizers", "on_fit_start", "cb:on_fit_start"]
                + validation  # before the first step (step 0)
                + step + ["on_step_end", "cb:on_step_end"]
                + step + validation + ["on_step_end", "cb:on_step_end"]
                + ["on_fit_end", "cb:on_fit_end"])
    assert calls == expected


def test_a_callback_stops_fit_with_should_stop(tiny_config, bpe_tokenizer, gsm8k_prompts):
    """As in Lightning: ``trainer.should_stop = True`` in a callback ends fit() after that step, and
    the next fit() starts with it cleared."""
    class StopAtTwo(Callback):
        def on_step_end(self, trainer, module, metrics):
            if trainer.global_step == 2:
                trainer.should_stop = True

    trainer = Trainer(max_steps=5, logger=False, enable_progress_bar=False, callbacks=[StopAtTwo()])
    module = make_module(tiny_config, bpe_tokenizer)
    trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2))
    assert trainer.global_step == 2 and trainer.should_stop
    trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2))
    assert trainer.global_step == 5 and not trainer.should_stop
    trainer.teardown()


def test_grpo_end_to_end_metrics_and_sync(tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path):
    module = make_module(tiny_config, bpe_tokenizer, kl_coef=0.05, entropy_coef=0.01, num_generations=4)
    trainer = Trainer(max_steps=3, logger="csv", default_root_dir=tmp_path, enable_progress_bar=False, seed=1)
    trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=4))
    m = trainer.callback_metrics
    for key in ["timing_s/gen", "timing_s/reward", "timing_s/ref", "timing_s/adv", "timing_s/update_actor",
                "timing_s/update_weights", "timing_s/step", "perf/throughput", "actor/pg_loss", "actor/pg_clipfrac",
                "actor/ppo_kl", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/lr", "critic/score/mean",
                "response_length/mean", "response_length/max", "response_length/clip_ratio",
                "critic/groups/zero_std_ratio", "critic/groups/solve_none_ratio", "critic/groups/solve_all_ratio",
                "response/distinct_ratio"]:
        assert key in m and math.isfinite(m[key]), key
    assert 0 <= m["critic/groups/zero_std_ratio"] <= 1 and 0 < m["response/distinct_ratio"] <= 1
    assert m["actor/grad_norm"] > 0 and m["actor/kl_loss"] > 0  # the policy moved away from the reference
    assert trainer.global_step == 3
    assert (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").exists()
    # after the sync the engine's logits equal the policy's; in one process the hf engine's parameters
    # are the policy's storage (HFEngine(share_weights=True), the default): the model is held once and a
    # sync copies nothing, while the engine keeps its own modules (eval mode, no grad)
    ids = torch.tensor([gsm8k_prompts[0]["prompt_ids"]])
    engine_model = trainer.engine.model
    with torch.no_grad():
        assert torch.equal(engine_model(ids).logits, module.policy(ids).logits)
    engine_ptrs = {p.data_ptr() for p in engine_model.parameters()}
    assert engine_ptrs == {p.data_ptr() for p in module.policy.parameters()}
    assert not any(p.requires_grad for p in engine_model.parameters())
    assert all(p.requires_grad for p in module.policy.parameters()) and module.policy.training
    assert not engine_model.training
    assert m["sync/bytes"] == 0 and m["sync/shared"] > 0


def test_engine_copy_of_its_own_when_not_sharing(tiny_config, bpe_tokenizer, gsm8k_prompts):
    """HFEngine(share_weights=False) keeps a copy: separate memory, equal outputs after each sync."""
    from rltrainer.rollout.hf import HFEngine

    module = make_module(tiny_config, bpe_tokenizer, num_generations=2)
    trainer = Trainer(max_steps=2, logger=False, enable_progress_bar=False, rollout=HFEngine(share_weights=False))
    trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2))
    ids = torch.tensor([gsm8k_prompts[0]["prompt_ids"]])
    with torch.no_grad():
        assert torch.equal(trainer.engine.model(ids).logits, module.policy(ids).logits)
    engine_ptrs = {p.data_ptr() for p in trainer.engine.model.parameters()}
    assert not engine_ptrs & {p.data_ptr() for p in module.policy.parameters()}
    assert trainer.callback_metrics["sync/bytes"] > 0 and "sync/shared" not in trainer.callback_metrics


def test_engine_log_probs_match_policy(tiny_config, bpe_tokenizer, gsm8k_prompts):
    """The log-probs the engine reports are those the policy computes for the same tokens."""
    module = make_module(tiny_config, bpe_tokenizer, temperature=0.8, num_generations=3, max_new_tokens=12)
    trainer = Trainer(max_steps=1, logger=False, enable_progress_bar=False)
    trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2))
    prompts = RolloutBatch.from_loader([gsm8k_prompts[i] for i in range(3)])
    rollouts = module.rollout_step(prompts, trainer.engine)
    with torch.no_grad():
        policy_lp, _ = response_log_probs(module.policy, rollouts, temperature=0.8)
    mask = rollouts["response_mask"].bool()
    torch.testing.assert_close(policy_lp[mask], rollouts["rollout_log_probs"][mask], atol=1e-4, rtol=0)


def test_fit_is_reproducible(tiny_config, bpe_tokenizer, gsm8k_prompts):
    def run():
        module = make_module(tiny_config, bpe_tokenizer)
        Trainer(max_steps=2, logger=False, enable_progress_bar=False, seed=3).fit(
            module, prompt_dataloader(gsm8k_prompts, batch_size=2, seed=3))
        return [p.detach().clone() for p in module.policy.parameters()]

    for a, b in zip(run(), run()):
        assert torch.equal(a, b)


def test_checkpoint_resume(tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path):
    loader = lambda: prompt_dataloader(gsm8k_prompts, batch_size=2, seed=0)  # noqa: E731
    full = make_module(tiny_config, bpe_tokenizer)
    Trainer(max_steps=4, logger=False, enable_progress_bar=False).fit(full, loader())

    first = make_module(tiny_config, bpe_tokenizer)
    Trainer(max_steps=2, logger=False, enable_progress_bar=False, default_root_dir=tmp_path,
            callbacks=[ModelCheckpoint(every_n_steps=2)]).fit(first, loader())
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()
    resumed = make_module(tiny_config, bpe_tokenizer)
    trainer = Trainer(max_steps=4, logger=False, enable_progress_bar=False, default_root_dir=tmp_path)
    trainer.fit(resumed, loader(), ckpt_path="last")
    assert trainer.global_step == 4
    # the RNG state is restored too, so the resumed run ends with the uninterrupted run's weights
    for p, q in zip(full.policy.parameters(), resumed.policy.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


def test_validate_before_fit(tiny_config, bpe_tokenizer, gsm8k_prompts):
    module = make_module(tiny_config, bpe_tokenizer)
    trainer = Trainer(logger=False, enable_progress_bar=False)
    metrics = trainer.validate(module, prompt_dataloader(gsm8k_prompts, 6, shuffle=False))
    assert set(metrics) == {"val/score", "val/full_credit", "val/accuracy"} and 0 <= metrics["val/accuracy"] <= 1
    assert metrics["val/accuracy"] == metrics["val/full_credit"]  # zero_reward declares no correctness


def test_validation_runs_before_the_first_step_too_logged_as_step_0_but_not_on_a_resume(tiny_config, bpe_tokenizer,
                                                                                        gsm8k_prompts, tmp_path):
    """Issue 44, item 14: with val_check_interval, the log holds the starting point (step 0) and the end."""
    class Validations(Callback):
        def __init__(self):
            self.steps = []

        def on_validation_end(self, trainer, module, metrics):
            self.steps.append((trainer.global_step, sorted(metrics)))

    def fit(max_steps, ckpt_path=None, **kwargs):
        seen = Validations()
        trainer = Trainer(max_steps=max_steps, enable_progress_bar=False, default_root_dir=tmp_path,
                          callbacks=[seen, ModelCheckpoint(every_n_steps=1)], **kwargs)
        trainer.fit(make_module(tiny_config, bpe_tokenizer, max_new_tokens=2), prompt_dataloader(gsm8k_prompts, 2),
                    prompt_dataloader(gsm8k_prompts.select(range(2)), 2, shuffle=False), ckpt_path=ckpt_path)
        return [s for s, _ in seen.steps], trainer

    steps, trainer = fit(3, val_check_interval=2)
    assert steps == [0, 2, 3]  # before the first step, every 2 steps, and at the end
    with open(f"{trainer.loggers[0].log_dir}/metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("val/accuracy")]
    assert [int(r["step"]) for r in rows] == [0, 2, 3]
    assert fit(4, ckpt_path="last", val_check_interval=2)[0] == [4]  # a resume does not measure the start again
    assert fit(1, logger=False)[0] == [1]  # without val_check_interval: only at the end


# -- bad input ------------------------------------------------------------------------------------
def test_unknown_strategy_and_engine_list_available():
    with pytest.raises(ValueError, match=r"Unknown strategy 'nope'.*single"):
        Trainer(strategy="nope")
    with pytest.raises(ValueError, match=r"Unknown rollout engine 'nope'.*hf"):
        Trainer(rollout="nope")
    with pytest.raises(ValueError, match="Unknown precision"):
        Trainer(precision="fp8")
    with pytest.raises(ValueError, match="one device"):
        Trainer(devices=4)
    with pytest.raises(ValueError, match="max_steps"):
        Trainer(max_steps=0)


def test_missing_hooks_are_named(gsm8k_prompts):
    class Half(RLModule):
        def configure_model(self):
            pass

    with pytest.raises(NotImplementedError, match="configure_optimizers, reward_step, advantage_step, policy_step"):
        Trainer(logger=False).fit(Half(), prompt_dataloader(gsm8k_prompts, 2))


def test_bad_algorithm_names(tiny_config, bpe_tokenizer):
    with pytest.raises(ValueError, match="Unknown loss aggregation mode 'mean'.*token-mean"):
        make_module(tiny_config, bpe_tokenizer, loss_agg_mode="mean")
    with pytest.raises(ValueError, match="Unknown KL estimator 'k4'.*k3"):
        make_module(tiny_config, bpe_tokenizer, kl_estimator="k4")
    with pytest.raises(ValueError, match="Unknown advantage estimator"):
        make_module(tiny_config, bpe_tokenizer, advantage_estimator="ppo")
    with pytest.raises(ValueError, match="Unknown reward 'gsm9k'"):
        make_module(tiny_config, bpe_tokenizer, reward_funcs="gsm9k")


def test_raising_reward_scores_zero_and_run_goes_on(tiny_config, bpe_tokenizer, gsm8k_prompts, caplog):
    bad_question = gsm8k_prompts[0]["question"]

    def flaky(completions, question, **kwargs):
        return [1 / 0 if q == bad_question else 1.0 for q in question]

    module = make_module(tiny_config, bpe_tokenizer, reward_funcs=[flaky])
    trainer = Trainer(max_steps=1, logger=False, enable_progress_bar=False)
    with caplog.at_level("WARNING"):
        trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2, shuffle=False))
    assert trainer.global_step == 1
    assert trainer.callback_metrics["reward/errors"] == 2  # 2 prompts x 2 samples; the first prompt's raised
    assert trainer.callback_metrics["critic/score/mean"] == 0.5
    assert sum("ZeroDivisionError" in r.getMessage() for r in caplog.records) == 1  # logged once


def test_bad_dataloader_batch(tiny_config, bpe_tokenizer):
    trainer = Trainer(max_steps=1, logger=False, enable_progress_bar=False)
    with pytest.raises(TypeError, match="dataloader batch must be"):
        trainer.fit(make_module(tiny_config, bpe_tokenizer), [torch.zeros(3)])
    with pytest.raises(KeyError, match="prompt_ids"):
        trainer.fit(make_module(tiny_config, bpe_tokenizer), [[{"question": "hi"}]])


def test_datamodule_fast_dev_run_and_bf16(tiny_config, bpe_tokenizer, gsm8k_prompts):
    class DataModule:
        def train_dataloader(self):
            return prompt_dataloader(gsm8k_prompts, batch_size=2)

        def val_dataloader(self):
            return prompt_dataloader(gsm8k_prompts, batch_size=2, shuffle=False)

    module = make_module(tiny_config, bpe_tokenizer)
    trainer = Trainer(fast_dev_run=True, precision="bf16-mixed", enable_progress_bar=False)
    trainer.fit(module, datamodule=DataModule())
    assert trainer.global_step == 1 and trainer.loggers == []
    assert math.isfinite(trainer.callback_metrics["actor/grad_norm"])
    with pytest.raises(ValueError, match="either dataloaders or a datamodule"):
        trainer.fit(module, [], datamodule=DataModule())


def test_logger_names():
    from rltrainer.loggers import build_loggers

    assert build_loggers(False, ".") == [] and build_loggers(None, ".") == []
    with pytest.raises(ValueError, match=r"Unknown logger 'neptune'.*csv, mlflow, tensorboard, wandb"):
        build_loggers("neptune", ".")
    with pytest.raises(TypeError, match="log_metrics"):
        build_loggers(object(), ".")


def test_nan_reward_is_caught_where_it_enters(tiny_config, bpe_tokenizer, gsm8k_prompts, caplog):
    bad_question = gsm8k_prompts[0]["question"]

    def sometimes_nan(completions, question, **kwargs):
        return [float("nan") if q == bad_question else 1.0 for q in question]

    module = make_module(tiny_config, bpe_tokenizer, reward_funcs=[sometimes_nan])
    trainer = Trainer(max_steps=1, logger=False, enable_progress_bar=False)
    with caplog.at_level("WARNING"):
        trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2, shuffle=False))
    metrics = trainer.callback_metrics
    assert metrics["reward/errors"] == 2 and metrics["reward/non_finite_share"] == 0.5  # rows 0, 1: the first prompt
    assert all(math.isfinite(metrics[k]) for k in ("reward/mean", "critic/advantages/mean", "actor/grad_norm"))
    assert metrics["training/skipped_optimizer_steps"] == 0
    message = next(r.getMessage() for r in caplog.records if "non-finite" in r.getMessage())
    assert "'sometimes_nan'" in message and "rows [0, 1]" in message


def test_nan_rewards_only_stop_the_run(tiny_config, bpe_tokenizer, gsm8k_prompts):
    def always_nan(completions, **kwargs):
        return [float("nan")] * len(completions)

    trainer = Trainer(max_steps=10, max_epochs=100, logger=False, enable_progress_bar=False)
    with pytest.raises(RuntimeError, match=r"last 3 training steps \(up to step 3\) trained nothing.*NaN") as error:
        trainer.fit(make_module(tiny_config, bpe_tokenizer, reward_funcs=[always_nan]),
                    prompt_dataloader(gsm8k_prompts, batch_size=2))
    assert trainer.global_step == 3
    assert "reward/always_nan/non_finite_share=1" in str(error.value)  # the reward, not the gradient norm
    assert "grad_norm" not in str(error.value)


def test_every_optimizer_step_skipped_stops_with_an_error():
    from rltrainer.loop import check_skipped_steps

    skipped = {"training/optimizer_steps": 2.0, "training/skipped_optimizer_steps": 2.0, "actor/grad_norm": math.nan}
    partly = {**skipped, "training/skipped_optimizer_steps": 1.0}
    history: list[bool] = []
    check_skipped_steps(history, skipped, 1, last=False)
    check_skipped_steps(history, partly, 2, last=False)  # one optimizer step went through: the run trains
    check_skipped_steps(history, skipped, 3, last=False)
    check_skipped_steps(history, skipped, 4, last=False)
    with pytest.raises(RuntimeError, match=r"last 3 training steps \(up to step 5\).*grad_norm=nan"):
        check_skipped_steps(history, skipped, 5, last=False)
    with pytest.raises(RuntimeError, match=r"last 1 training steps"):  # a run too short for 3: at its end
        check_skipped_steps([], skipped, 1, last=True)


def test_out_of_vocabulary_prompt_id_is_named_before_generation(tiny_config, bpe_tokenizer):
    rows = [{"prompt_ids": [1, 2, 3]}, {"prompt_ids": [4, len(bpe_tokenizer) + 7, 5]}]
    trainer = Trainer(max_steps=1, logger=False, enable_progress_bar=False)
    vocab = tiny_config.vocab_size
    with pytest.raises(ValueError, match=rf"Prompt row 1 .*token id {vocab + 7}, outside the model's vocabulary of "
                                         rf"{vocab} ids"):
        trainer.fit(make_module(tiny_config, bpe_tokenizer), prompt_dataloader(rows, batch_size=2, shuffle=False))


def test_run_plan_is_checked_before_any_model_is_built(tiny_config, bpe_tokenizer, gsm8k_prompts):
    built = []

    class Watched(GRPO):
        def configure_model(self):
            built.append(True)
            super().configure_model()

    loader = prompt_dataloader(gsm8k_prompts, batch_size=3)  # 3 prompts x 2 samples = 6 rows
    for mini, message in ((4, r"mini_batch_size=4 rows does not divide the 6 rows of a step \(3 prompts x 2"),
                          (12, r"mini_batch_size=12 rows is larger than the batch: 3 prompts x 2 samples = 6")):
        module = Watched(tiny_config, bpe_tokenizer, reward_funcs=zero_reward, num_generations=2,
                         max_new_tokens=4, mini_batch_size=mini)
        with pytest.raises(ValueError, match=message):
            Trainer(max_steps=1, logger=False, enable_progress_bar=False).fit(module, loader)
    assert built == []


def test_run_plan_is_logged_and_sent_to_the_loggers(tiny_config, bpe_tokenizer, gsm8k_prompts, caplog):
    class Hparams:
        def __init__(self):
            self.hparams = {}

        def log_metrics(self, metrics, step):
            pass

        def log_hyperparams(self, params):
            self.hparams.update(params)

        def save(self):
            pass

    logger = Hparams()
    module = make_module(tiny_config, bpe_tokenizer, mini_batch_size=4, update_epochs=2)
    trainer = Trainer(max_steps=2, max_epochs=100, logger=logger, enable_progress_bar=False)
    with caplog.at_level("INFO", logger="rltrainer.plan"):
        trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=4))
    assert logger.hparams["plan/rows_per_step"] == 8 and logger.hparams["plan/optimizer_steps_per_training_step"] == 4
    assert logger.hparams["plan/total_samples"] == 16 and logger.hparams["plan/max_generated_tokens_per_step"] == 64
    assert logger.hparams["plan/micro_batch"] == "8 rows" and logger.hparams["plan/engine_replicas"] == 1
    table = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Run plan"))
    assert "rows per step (N = B*G)" in table and "optimizer steps per training step" in table
