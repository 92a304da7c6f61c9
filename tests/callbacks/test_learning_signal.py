"""A run that cannot learn says so within a few steps (LearningSignal), once per cause, and a healthy
run does not warn; GRPO refuses one sample per prompt with a group-baseline estimator."""

from __future__ import annotations

import logging

import pytest

from rltrainer import GRPO, LearningSignal, Trainer, prompt_dataloader
from rltrainer.callbacks.learning_signal import signal_metrics, unknown_ids
from rltrainer.data.batch import RolloutBatch
from rltrainer.testing import tiny_qwen2_config

LOGGER = "rltrainer.callbacks.learning_signal"


def parity_reward(completions, **kwargs):
    return [float(len(c) % 2) for c in completions]


def always_zero(completions, **kwargs):
    return [0.0] * len(completions)


def question_length(completions, question, **kwargs):
    """The same score for every sample of a prompt: no group has signal."""
    return [float(len(q)) for q in question]


def run(config, tokenizer, prompts, reward, steps=3, generations=4):
    module = GRPO(config, tokenizer, reward_funcs=reward, num_generations=generations, max_new_tokens=6, lr=1e-3)
    Trainer(max_steps=steps, logger=False, enable_progress_bar=False, seed=1).fit(
        module, prompt_dataloader(prompts, batch_size=4))


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_identical_rewards_warn_once_after_patience_steps(tiny_config, bpe_tokenizer, gsm8k_prompts, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        run(tiny_config, bpe_tokenizer, gsm8k_prompts, always_zero, steps=2)
        assert warnings_of(caplog) == []  # 2 steps: under the patience of 3
        run(tiny_config, bpe_tokenizer, gsm8k_prompts, always_zero, steps=5)
    messages = warnings_of(caplog)
    assert len(messages) == 1, messages  # once, not every step
    assert "every reward was 0.0 in the last 3 steps (up to step 3)" in messages[0]
    assert "Check the reward function" in messages[0]


def test_groups_without_signal_warn(tiny_config, bpe_tokenizer, gsm8k_prompts, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        run(tiny_config, bpe_tokenizer, gsm8k_prompts, question_length)
    messages = warnings_of(caplog)
    assert len(messages) == 1 and "every group's samples scored alike" in messages[0], messages
    assert "num_generations" in messages[0]


def test_a_healthy_run_does_not_warn(tiny_config, bpe_tokenizer, gsm8k_prompts, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        run(tiny_config, bpe_tokenizer, gsm8k_prompts, parity_reward, steps=4)
    assert warnings_of(caplog) == []


def char_tokenizer():
    """The addition recipe's kind of tokenizer: one token per digit, anything else maps to <pad>."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(["<pad>", "<bos>", "<eos>", *"0123456789"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


def test_prompts_of_unknown_tokens_warn_at_the_first_step(caplog):
    tokenizer = char_tokenizer()
    assert unknown_ids(tokenizer) == {0}
    rows = [{"prompt_ids": tokenizer(f"Reverse the number: {n}")["input_ids"], "question": str(n)}
            for n in range(100, 108)]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        run(tiny_qwen2_config(len(tokenizer)), tokenizer, rows, parity_reward, steps=1)
    messages = warnings_of(caplog)
    assert len(messages) == 1 and "The model cannot read its prompts" in messages[0], messages
    assert "tokens of this step are the tokenizer's unknown token (ids [0]" in messages[0]


def test_empty_responses_warn_from_the_metrics():
    batch = RolloutBatch.from_rows([{"response_text": t} for t in ["", "  ", "\n", ""]])
    assert signal_metrics(batch) == {"response/empty_ratio": 1.0}
    callback, seen = LearningSignal(patience=2), []

    class Module:
        sampling = type("S", (), {"n": 4})()

    class Trainer_:
        global_step = 0

    logger = logging.getLogger(LOGGER)
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        for _ in range(5):
            callback.on_step_end(Trainer_(), Module(), {"response/empty_ratio": 1.0, "critic/score/max": 1.0,
                                                        "critic/score/min": 0.0})
    finally:
        logger.removeHandler(handler)
    assert len(seen) == 1 and "every response was empty in the last 2 steps" in seen[0]
    assert LearningSignal(patience=0).patience == 0
    with pytest.raises(ValueError, match="patience must be an int >= 0"):
        LearningSignal(patience=-1)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce", "opo", "reinforce_plus_plus_baseline"])
def test_one_sample_per_prompt_with_a_group_estimator_is_refused(tiny_config, bpe_tokenizer, estimator):
    with pytest.raises(ValueError, match=rf"num_generations=1 with advantage_estimator='{estimator}'.*"
                                         r"Use num_generations >= 2.*reinforce_plus_plus, remax"):
        GRPO(tiny_config, bpe_tokenizer, reward_funcs=parity_reward, num_generations=1, advantage_estimator=estimator)
    GRPO(tiny_config, bpe_tokenizer, reward_funcs=parity_reward, num_generations=1,
         advantage_estimator="reinforce_plus_plus")  # no group: allowed


def test_the_warning_is_on_a_line_of_its_own_under_the_progress_bar_and_in_the_summary(
        tiny_config, bpe_tokenizer, gsm8k_prompts, capsys):
    """With the bar on (the CLI's default) the warning was written after the bar's last update, inside
    its line; it goes above the bar now, and the CLI's closing summary says it again."""
    import sys

    from rltrainer.cli import summary

    console = logging.StreamHandler(sys.stderr)  # what the CLI's logging.basicConfig sets up
    console.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.root.addHandler(console)
    try:
        module = GRPO(tiny_config, bpe_tokenizer, reward_funcs=always_zero, num_generations=2, max_new_tokens=4)
        trainer = Trainer(max_steps=2, logger=False, seed=1, callbacks=[LearningSignal(patience=1)])
        trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2))
    finally:
        logging.root.removeHandler(console)
    err = capsys.readouterr().err
    lines = err.replace("\r", "\n").split("\n")
    warning = [line for line in lines if "No learning signal" in line]
    assert warning and warning[0].startswith("WARNING rltrainer.callbacks.learning_signal: No learning signal"), err
    assert console not in logging.root.handlers
    assert not any("Tqdm" in type(h).__name__ for h in logging.root.handlers)  # the redirection ended with fit
    text = summary(trainer, 3.0, ["fit"])
    assert text.splitlines()[-1].startswith("  warning:      No learning signal: every reward was 0.0 in the last 1 "
                                            "steps (up to step 1)")
