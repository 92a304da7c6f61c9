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
    for cls, wrong in ((recipe.GuessDigit, "7"), (recipe.GuessHigherLower, "+"), (recipe.NoFeedback, ".")):
        env = cls()
        assert env.reset({"secret": 7}) == "?"
        assert env.step("3").messages == wrong and not env.step("3").done
        assert env.step("x").messages == "!"
        right = env.step("7")
        assert right.done and right.reward == 1.0
    assert recipe.environment(False, "hint") is recipe.NoFeedback
    with pytest.raises(ValueError, match="hint"):
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
@pytest.mark.skip(reason="the recipe does not learn yet (its docstring has the runs): the target of issue 15, item 6")
def test_feedback_is_learned_and_the_control_learns_less(recipe):
    """A short run of each: with the replies the greedy success must rise well above what the
    control (replies withheld) reaches. The control cannot beat 20 % by construction."""
    with_feedback = recipe.run(recipe.Config(steps=60, print_every=20))
    control = recipe.run(recipe.Config(steps=60, print_every=20, feedback=False))
    assert control["after"] <= 0.2 + 1e-9, control
    assert with_feedback["after"] >= control["after"] + 0.3, (with_feedback, control)
