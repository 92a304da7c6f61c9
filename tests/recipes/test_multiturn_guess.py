"""The multi-turn learning proof: ``recipes/multiturn_guess.py``. Fast tests check the game and its
tokenizer; the slow one runs a short version with the feedback and without it (the control)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "multiturn_guess.py"


@pytest.fixture(scope="module")
def recipe():
    spec = importlib.util.spec_from_file_location("recipes_multiturn_guess", RECIPE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_game_replies(recipe):
    for cls, wrong in ((recipe.GuessCode, "h"), (recipe.GuessDigit, "7"), (recipe.GuessHigherLower, "+"),
                       (recipe.NoFeedback, ".")):
        env = cls()
        assert env.reset({"secret": 7}) == "?"
        assert env.step("3").messages == wrong and not env.step("3").done
        assert env.step("x").messages == "!"
        right = env.step("7")
        assert right.done and right.reward == 1.0
    assert recipe.environment(False, "hint") is recipe.NoFeedback
    assert recipe.environment(True, "code") is recipe.GuessCode
    with pytest.raises(ValueError, match="code"):
        recipe.environment(True, "warmer")


def test_chat_format_of_the_game(recipe):
    from rltrainer.envs import ChatFormat

    tokenizer = recipe.build_tokenizer()
    chat = ChatFormat(tokenizer)
    tokens = tokenizer.convert_ids_to_tokens
    assert tokens(chat.prompt([{"role": "user", "content": "?"}])) == ["<|user|>", "?", "<|end|>", "<|assistant|>"]
    assert tokens(chat.observation([{"role": "user", "content": "7"}], stopped=True)) == [
        "<|user|>", "7", "<|end|>", "<|assistant|>"]


@pytest.mark.slow
def test_feedback_is_learned_and_the_control_learns_less(recipe):
    """With the coded replies the greedy success must rise well above what the control (replies
    withheld) reaches; the control cannot beat 20 % by construction. The feedback run stops once its
    sampling success reaches 0.9 (typically 500-1,000 of its 1,500 steps on one thread)."""
    with_feedback = recipe.run(recipe.Config(stop_at=0.9))
    control = recipe.run(recipe.Config(steps=200, feedback=False))
    assert with_feedback["before"] <= 0.2 + 1e-9, with_feedback
    assert control["after"] <= 0.2 + 1e-9, control
    assert with_feedback["after"] >= control["after"] + 0.3, (with_feedback, control)


def test_episodes_of_the_game_are_scored_on_the_model_tokens_only(recipe):
    """The game's rows through the hf engine: the trainer's teacher-forced log-probs equal the
    engine's on the model tokens (1e-4), the replies are masked out, and the score sits on the last
    model token of each row (what a collapse of the hint runs was first suspected to break)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rltrainer.algorithms.advantages import outcome_token_rewards
    from rltrainer.data.batch import RolloutBatch
    from rltrainer.envs import MultiTurn
    from rltrainer.models import response_log_probs
    from rltrainer.rollout.engine import SamplingParams
    from rltrainer.rollout.hf import HFEngine
    from rltrainer.testing import tiny_qwen2_config

    tokenizer = recipe.build_tokenizer()
    config = tiny_qwen2_config(len(tokenizer), hidden_size=32, num_layers=2, max_positions=128)
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(config).eval()
    engine = HFEngine()
    engine.setup(config, tokenizer)
    engine.update_weights(policy.state_dict().items())
    out = MultiTurn(recipe.GuessDigit, max_turns=2, max_episode_tokens=64, max_workers=0).rollout(
        RolloutBatch.from_rows(recipe.rows([3, 7])), engine, SamplingParams(n=8, max_new_tokens=2, seed=0), tokenizer)
    with torch.no_grad():
        trainer_lp, _ = response_log_probs(policy, out)
    mask = out["response_mask"].bool()
    assert torch.allclose(trainer_lp[mask], out["rollout_log_probs"][mask], atol=1e-4)
    tokens = tokenizer.convert_ids_to_tokens
    two_turns = 0
    for i in range(len(out)):
        T = int(out["attention_mask"][i, out["prompts"].shape[1]:].sum())
        response, model = tokens(out["responses"][i, :T].tolist()), mask[i, :T].tolist()
        replies = [t for t, m in zip(response, model) if not m]
        if out["env_turns"][i] == 1:
            assert replies == [] and out["env_finish"][i] in ("done", "max_tokens")
            continue
        two_turns += 1
        first = response[: model.index(0)]  # the first turn, as sampled (its <|end|> included if it stopped)
        guess = "".join(t for t in first if t != "<|end|>")
        reply = str(out["secret"][i]) if len(guess) == 1 and guess.isdigit() else "!"
        head = [] if first[-1] == "<|end|>" else ["<|end|>"]  # a turn cut at the limit gets its end here
        assert replies == head + ["<|user|>", reply, "<|end|>", "<|assistant|>"], (response, model)
    assert two_turns > 0
    scores = torch.tensor([float(r) for r in out["env_reward"]])
    rewards = outcome_token_rewards(scores, out["response_mask"], None, 0.0, "k1", "grpo")
    last = (out["response_mask"] * torch.arange(1, mask.shape[1] + 1)).argmax(-1)
    assert torch.equal(rewards[torch.arange(len(out)), last], scores) and torch.equal(rewards.sum(-1), scores)
