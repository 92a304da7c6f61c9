"""Adapters: a Gymnasium-style text environment and reasoning-gym tasks as environments."""

from __future__ import annotations

import pytest

from rltrainer.data.batch import RolloutBatch
from rltrainer.envs import GymText, MultiTurn, ReasoningGym
from rltrainer.rollout.engine import SamplingParams
from rltrainer.testing import load_tokenizer

from .test_multiturn import ScriptedEngine


class CountDown:
    """Gymnasium's API with text: say the number one below the last; terminated at 0."""

    def reset(self, *, seed=None, options=None):
        self.n = 3 + (seed or 0)
        self.closed = False
        return f"{self.n}", {}

    def step(self, action):
        right = action.strip() == str(self.n - 1)
        self.n -= 1
        return f"{self.n}", float(right), self.n == 0, False, {"right": right}

    def close(self):
        self.closed = True


def script_for(tokenizer, answer):
    def script(prompt):
        ids = tokenizer(answer(tokenizer.decode(prompt)), add_special_tokens=False).input_ids
        return ids + [tokenizer.eos_token_id]
    return script


def test_gym_text_environment_runs_episodes():
    tokenizer = load_tokenizer("qwen2.5-instruct")

    def count(text):  # the last number the environment said, minus one
        last = text.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0]
        return str(int(last) - 1)

    engine = ScriptedEngine(tokenizer, script_for(tokenizer, count))
    rows = RolloutBatch.from_rows([{"prompt_ids": [1], "seed": s} for s in (0, 1)])
    out = MultiTurn(GymText(CountDown), max_turns=8).rollout(rows, engine, SamplingParams(n=1, max_new_tokens=8),
                                                            tokenizer)
    assert out["env_turns"].tolist() == [3, 4] and out["env_reward"].tolist() == [3.0, 4.0]
    assert out["env_finish"].tolist() == ["done", "done"]
    if not _has("gymnasium"):
        with pytest.raises(ImportError, match="pip install gymnasium"):
            GymText("NoSuchEnv-v0")()


def _has(module):
    import importlib.util

    return importlib.util.find_spec(module) is not None


class TinyTask:
    """reasoning-gym's dataset interface: questions, answers, and score_answer."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {"question": f"What is {i} + {i}?", "answer": str(2 * i), "metadata": {}}

    def score_answer(self, answer, entry):
        return 1.0 if answer == entry["answer"] else 0.0


def test_reasoning_gym_task_retries_and_rewards():
    task = ReasoningGym(dataset=TinyTask())
    assert task.reward(["<answer>4</answer>", "5"], rg_index=[2, 2]) == [1.0, 0.0]
    tokenizer = load_tokenizer("qwen2.5-instruct")
    wrong_first = script_for(tokenizer, lambda text: "<answer>7</answer>" if "Try again" not in text
                             else f"<answer>{2 * int(text.split('What is ')[1].split(' ')[0])}</answer>")
    engine = ScriptedEngine(tokenizer, wrong_first)
    out = MultiTurn(task, max_turns=3).rollout(RolloutBatch.from_rows(task.rows()[:2]), engine,
                                               SamplingParams(n=1, max_new_tokens=16), tokenizer)
    assert out["env_turns"].tolist() == [2, 2] and out["env_reward"].tolist() == [1.0, 1.0]
    assert "That is not right. Try again." in tokenizer.decode(out["responses"][0])


def test_reasoning_gym_package():
    """The real package, where it is installed (``pip install reasoning-gym==0.1.25``): offline tasks."""
    pytest.importorskip("reasoning_gym")
    task = ReasoningGym("basic_arithmetic", size=5, seed=0)
    rows = task.rows()
    entry = task.dataset[0]
    assert len(rows) == 5 and rows[0]["question"] == entry["question"]
    assert task.reward([f"<answer>{entry['answer']}</answer>", "<answer>nope</answer>"], rg_index=[0, 0]) == [1.0, 0.0]
