"""Multi-turn rollouts: exact tokens across turns, tool calls through the Qwen templates, limits,
error isolation and concurrency (``rltrainer.envs``)."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from rltrainer.data.batch import RolloutBatch
from rltrainer.envs import Environment, MultiTurn, StepResult, tool_methods, tool_schemas
from rltrainer.envs.rollout import SetupError
from rltrainer.rollout.engine import Generation, RolloutEngine, SamplingParams
from rltrainer.testing import load_tokenizer, tiny_qwen2_config


class ScriptedEngine(RolloutEngine):
    """Answers each prompt with the token ids ``script(prompt_ids)`` returns (log-probs -1), and
    records every request (its contexts and when it was made)."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.requests = tokenizer, script, []
        self.weight_version = 3

    def setup(self, model_config, tokenizer, device=None):
        pass

    def update_weights(self, weights):
        return {}

    def generate(self, prompts, sampling):
        self.requests.append((time.perf_counter(), [list(p) for p in prompts], sampling.max_new_tokens))
        rows = [self.script(list(p))[: sampling.max_new_tokens] for p in prompts]
        T = max(len(r) for r in rows)
        ids = torch.full((len(rows), T), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), T), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
        eos = self.tokenizer.eos_token_id
        return Generation(ids, mask, -mask.float(), self.tokenizer.batch_decode(rows),
                          ["stop" if r[-1] == eos else "length" for r in rows])


def prompt_rows(n: int) -> RolloutBatch:
    return RolloutBatch.from_rows([{"prompt_ids": [1], "secret": i} for i in range(n)])


class Echo(Environment):
    """Replies 'again' after every turn; never done."""

    def reset(self, row):
        return [{"role": "user", "content": f"Say something ({row['secret']})."}]

    def step(self, text):
        return StepResult("again", reward=0.5)


def test_exact_tokens_across_turns_match_trainer_log_probs():
    """The engine's sampled tokens are the row's model tokens, unchanged; the trainer's teacher-forced
    log-probs on them equal the engine's (1e-4); environment tokens are masked out. Re-encoding the
    decoded turns would have changed the tokens (checked on the same rows), so the test can fail."""
    from transformers import AutoModelForCausalLM

    from rltrainer.models import response_log_probs
    from rltrainer.rollout.hf import HFEngine

    tokenizer = load_tokenizer("qwen2.5-instruct")
    config = tiny_qwen2_config(len(tokenizer), hidden_size=32, num_layers=2)
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(config).eval()
    engine = HFEngine()
    engine.setup(config, tokenizer)
    engine.update_weights(policy.state_dict().items())
    sampling = SamplingParams(n=2, max_new_tokens=12, temperature=1.0, seed=0)
    out = MultiTurn(Echo, max_turns=3, max_episode_tokens=200).rollout(prompt_rows(3), engine, sampling, tokenizer)

    with torch.no_grad():
        trainer_lp, _ = response_log_probs(policy, out)
    mask = out["response_mask"].bool()
    assert mask.sum() > 0 and (~mask & out["attention_mask"][:, -mask.shape[1]:].bool()).any()  # env tokens exist
    assert torch.allclose(trainer_lp[mask], out["rollout_log_probs"][mask], atol=1e-4)
    assert (out["rollout_log_probs"][~mask] == 0).all()

    changed = 0
    for i in range(len(out)):
        T = int(out["attention_mask"][i, -mask.shape[1]:].sum())
        tokens, model = out["responses"][i, :T].tolist(), mask[i, :T].tolist()
        turns, current = [], []
        for token, is_model in zip(tokens, model):  # the model's turns: maximal runs of model tokens
            if is_model:
                current.append(token)
            elif current:
                turns.append(current)
                current = []
        turns += [current] if current else []
        assert len(turns) == out["env_turns"][i] == 3
        for turn in turns:
            changed += tokenizer(tokenizer.decode(turn), add_special_tokens=False).input_ids != turn
        # the observations between turns are the template's text for the environment's message
        env_text = tokenizer.decode([t for t, m in zip(tokens, model) if not m])
        assert env_text.count("<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n") == 2
    assert changed >= 1, "every sampled turn re-encoded to itself: the test would not catch re-tokenization"
    assert out["env_reward"].tolist() == [1.5] * 6 and out["env_finish"].tolist() == ["max_turns"] * 6


class Calculator(Environment):
    """One tool; the final answer (a turn without a tool call) is rewarded 1 if it says 42."""

    def reset(self, row):
        return "What is 6 times 7? Use the tool."

    def multiply(self, a: int, b: int) -> str:
        """Multiply two integers.

        Args:
            a: the first factor
            b: the second factor
        """
        return str(a * b)

    def step(self, text):
        return StepResult(reward=float("42" in text), done=True)


@pytest.mark.parametrize("name", ["qwen2.5-instruct", "qwen3"])
def test_tool_calls_through_the_chat_template(name):
    """A well-formed call runs the method and its result comes back inside <tool_response>; a malformed
    one (bad JSON, unknown tool, wrong arguments) is an error the model sees, and a metric."""
    tokenizer = load_tokenizer(name)
    eos = tokenizer.eos_token_id
    calls = ['<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>',
             '<tool_call>\n{"name": "multiply", "arguments": {"a": 6,}\n</tool_call>',
             '<tool_call>\n{"name": "divide", "arguments": {"a": 6, "b": 7}}\n</tool_call>',
             '<tool_call>\n{"name": "multiply", "arguments": {"x": 1}}\n</tool_call>']

    def script(prompt):
        turn = (prompt.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) - 3) // 2  # 2 per turn after 3
        text = calls[turn] if turn < len(calls) else "The answer is 42."
        return tokenizer(text, add_special_tokens=False).input_ids + [eos]

    engine = ScriptedEngine(tokenizer, script)
    spec = MultiTurn(Calculator, max_turns=6, max_episode_tokens=2000)
    out = spec.rollout(prompt_rows(1), engine, SamplingParams(n=1, max_new_tokens=64), tokenizer)
    prompt = tokenizer.decode(out["prompts"][0])
    assert '"name": "multiply"' in prompt and "<tools>" in prompt  # the schema reached the template
    text = tokenizer.decode(out["responses"][0])
    assert "<tool_response>\n42\n</tool_response>" in text
    assert text.count("Error:") == 3 and "not valid JSON" in text and "no tool 'divide'" in text
    assert out["env_reward"].tolist() == [1.0] and out["env_finish"].tolist() == ["done"]
    assert out["env_turns"].tolist() == [5]
    metrics = out.env_metrics
    assert metrics["env/tool_calls"] == 4 and metrics["env/tool_errors"] == 3


def test_tool_schema_from_type_hints_and_docstring():
    schemas = tool_schemas(tool_methods(Calculator()))
    assert [s["function"]["name"] for s in schemas] == ["multiply"]
    assert schemas[0]["function"]["parameters"]["required"] == ["a", "b"]

    class NoDoc(Calculator):
        def lookup(self, key):
            return key

    with pytest.raises(ValueError, match="'lookup'.*type hints"):
        tool_schemas(tool_methods(NoDoc()))
    tokenizer = load_tokenizer("qwen2.5-instruct")
    engine = ScriptedEngine(tokenizer, lambda p: [tokenizer.eos_token_id])
    with pytest.raises(SetupError, match="'lookup'"):  # a setup error raises: it is not an episode's failure
        MultiTurn(NoDoc).rollout(prompt_rows(1), engine, SamplingParams(n=1, max_new_tokens=4), tokenizer)


class Flaky(Echo):
    def step(self, text):
        if self.secret % 2:
            raise RuntimeError("the sandbox died")
        return StepResult("again", reward=1.0, done=True)

    def reset(self, row):
        self.secret = row["secret"]
        if row["secret"] == 2:
            raise ConnectionError("no sandbox")
        return super().reset(row)


def test_an_environment_that_raises_ends_its_episode_only(caplog):
    tokenizer = load_tokenizer("gsm8k-bpe4k")
    engine = ScriptedEngine(tokenizer, lambda p: [5, 6, tokenizer.eos_token_id])
    with caplog.at_level(logging.WARNING, logger="rltrainer.envs.rollout"):
        out = MultiTurn(Flaky).rollout(prompt_rows(6), engine, SamplingParams(n=1, max_new_tokens=8), tokenizer)
    assert out["env_finish"].tolist() == ["done", "error", "error", "error", "done", "error"]
    assert out["env_reward"].tolist() == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert out["response_mask"][[1, 2, 3, 5]].sum() == 0 and out["response_mask"][[0, 4]].sum() == 6
    assert "RuntimeError: the sandbox died" in out["env_error"][1]
    assert out.env_metrics["env/errors"] == 4
    logged = [r for r in caplog.records if "raised in" in r.getMessage()]
    assert len(logged) <= 2  # once per (class, phase, error type): step/RuntimeError, reset/ConnectionError


def test_turn_and_token_limits():
    tokenizer = load_tokenizer("gsm8k-bpe4k")
    eos = tokenizer.eos_token_id
    engine = ScriptedEngine(tokenizer, lambda p: [7] * 10 + [eos])
    out = MultiTurn(Echo, max_turns=2).rollout(prompt_rows(1), engine, SamplingParams(n=1, max_new_tokens=64),
                                               tokenizer)
    assert out["env_turns"].tolist() == [2] and out["env_finish"].tolist() == ["max_turns"]
    assert out["finish_reason"].tolist() == ["length"]
    engine = ScriptedEngine(tokenizer, lambda p: [7] * 10 + [eos])
    out = MultiTurn(Echo, max_turns=10, max_episode_tokens=30).rollout(
        prompt_rows(1), engine, SamplingParams(n=1, max_new_tokens=64), tokenizer)
    assert out["env_finish"].tolist() == ["max_tokens"]
    assert int(out["attention_mask"][0, out["prompts"].shape[1]:].sum()) <= 30
    assert max(limit for _, _, limit in engine.requests) <= 30
    with pytest.raises(ValueError, match="max_turns must be an int >= 1, got 0"):
        MultiTurn(Echo, max_turns=0)
    with pytest.raises(TypeError, match="reset"):
        MultiTurn(int)

def test_requests_keep_the_batch_order():
    """Every request lists its episodes in the batch's order (samples of a prompt adjacent), not in a
    set's order of finished futures (memory addresses): an engine drawing from a seeded generator
    then gives each episode the same draws in every run, so a seed gives one run."""
    tokenizer = load_tokenizer("gsm8k-bpe4k")
    engine = ScriptedEngine(tokenizer, lambda p: [5, tokenizer.eos_token_id])
    out = MultiTurn(Echo, max_turns=3, max_workers=0).rollout(prompt_rows(16), engine,
                                                                SamplingParams(n=2, max_new_tokens=4), tokenizer)
    assert out["env_turns"].tolist() == [3] * 32 and len(engine.requests) == 3
    first_prompts = [tokenizer.decode(p) for p in engine.requests[0][1]]
    for _, prompts, _ in engine.requests:
        assert [tokenizer.decode(p[: len(engine.requests[0][1][0])]) for p in prompts] == first_prompts
    assert [p.split("(")[1].split(")")[0] for p in first_prompts] == [str(i) for i in range(16) for _ in range(2)]



class SlowFirst(Echo):
    """Episode 0's steps take 0.6 s; the others' are instant."""

    def reset(self, row):
        self.slow = row["secret"] == 0
        return super().reset(row)

    def step(self, text):
        if self.slow:
            time.sleep(0.6)
        return StepResult("again", reward=0.0)


def test_a_slow_episode_does_not_hold_the_others():
    tokenizer = load_tokenizer("gsm8k-bpe4k")
    engine = ScriptedEngine(tokenizer, lambda p: [5, tokenizer.eos_token_id])
    start = time.perf_counter()
    out = MultiTurn(SlowFirst, max_turns=4, batch_wait_s=0.01).rollout(
        prompt_rows(4), engine, SamplingParams(n=1, max_new_tokens=4), tokenizer)
    assert out["env_turns"].tolist() == [4] * 4
    # the three fast episodes' 4 turns were all requested before the slow one's first step returned
    fast_done = [t - start for t, prompts, _ in engine.requests if len(prompts) == 3]
    assert len(fast_done) >= 3 and max(fast_done) < 0.5, engine.requests
    assert out.env_metrics["env/requests"] >= 6


def test_grpo_trains_on_an_environment():
    """GRPO(environment=...) through the Trainer: rows are episodes, scored by env_reward."""
    import rltrainer
    from rltrainer.strategies import SingleDeviceStrategy

    tokenizer = load_tokenizer("gsm8k-bpe4k")

    class OneShot(Echo):
        def step(self, text):
            return StepResult(reward=float(len(text) % 2), done=True)

    module = rltrainer.GRPO(tiny_qwen2_config(len(tokenizer), hidden_size=32), tokenizer, None, num_generations=4,
                            max_new_tokens=6, environment=MultiTurn(OneShot, max_turns=2))
    rows = [{"prompt_ids": [1], "secret": i} for i in range(4)]
    trainer = rltrainer.Trainer(strategy=SingleDeviceStrategy(), rollout="hf", max_steps=2, logger=False,
                                enable_progress_bar=False)
    seen = []

    class Record(rltrainer.Callback):
        def on_step_end(self, trainer, module, metrics):
            seen.append(metrics)

    trainer.callbacks.append(Record())
    trainer.fit(module, rltrainer.prompt_dataloader(rows, batch_size=2))
    assert trainer.global_step == 2 and len(seen) == 2
    assert seen[0]["env/turns_mean"] == 1 and 0 <= seen[0]["critic/score/mean"] <= 1
    with pytest.raises(ValueError, match="remax"):
        rltrainer.GRPO(tiny_qwen2_config(len(tokenizer)), tokenizer, None, environment=OneShot,
                       advantage_estimator="remax")


def test_episodes_run_concurrently_in_threads():
    seen: set[int] = set()

    class Recorder(Echo):
        def step(self, text):
            seen.add(threading.get_ident())
            time.sleep(0.05)
            return StepResult("again", done=True)

    tokenizer = load_tokenizer("gsm8k-bpe4k")
    engine = ScriptedEngine(tokenizer, lambda p: [5, tokenizer.eos_token_id])
    start = time.perf_counter()
    MultiTurn(Recorder, max_workers=8).rollout(prompt_rows(8), engine, SamplingParams(n=1, max_new_tokens=4),
                                               tokenizer)
    assert len(seen) > 1 and time.perf_counter() - start < 0.35  # 8 x 0.05 s one after another is 0.4 s


class Countdown(Environment):
    """Two turns, then done; reward 1 on the second turn."""

    def reset(self, row):
        self.turn = 0
        return "Count."

    def step(self, text):
        self.turn += 1
        return StepResult("Again.", reward=float(self.turn == 2), done=self.turn == 2)


@pytest.mark.parametrize("pipeline", ["sync", "one_step_off"])
def test_episodes_on_split_engines_and_pipelines(pipeline, ray_session):
    """The same episodes through a RemoteEngine (an ``hf`` replica in a Ray process of its own), in
    sync and one_step_off: the rows are whole episodes, on-policy log-probs match the trainer's."""
    import rltrainer
    from rltrainer.strategies import FSDP2Strategy

    tokenizer = load_tokenizer("gsm8k-bpe4k")
    module = rltrainer.GRPO(tiny_qwen2_config(len(tokenizer), hidden_size=32), tokenizer, None, num_generations=2,
                            max_new_tokens=4, environment=MultiTurn(Countdown, max_turns=3))
    seen = []

    class Record(rltrainer.Callback):
        def on_step_end(self, trainer, module, metrics):
            seen.append(metrics)

    strategy = FSDP2Strategy(devices=1, micro_batch_size=4)
    rows = [{"prompt_ids": [1], "k": i} for i in range(6)]
    with rltrainer.Trainer(strategy=strategy, rollout=rltrainer.Rollout("hf", placement="split", replicas=1),
                           pipeline=pipeline, max_steps=3, logger=False,
                           enable_progress_bar=False, callbacks=[Record()]) as trainer:
        trainer.fit(module, rltrainer.prompt_dataloader(rows, batch_size=2))
    assert len(seen) == 3
    assert all(m["env/turns_mean"] == 2 and m["env/finish_done"] == 4 and m["critic/score/mean"] == 1 for m in seen)


def test_an_environment_call_past_its_timeout_ends_the_episode():
    class Hangs(SlowFirst):
        def step(self, text):
            time.sleep(1.0 if self.slow else 0.0)
            return StepResult("again", done=True)

    tokenizer = load_tokenizer("gsm8k-bpe4k")
    engine = ScriptedEngine(tokenizer, lambda p: [5, tokenizer.eos_token_id])
    start = time.perf_counter()
    out = MultiTurn(Hangs, env_timeout_s=0.3).rollout(prompt_rows(3), engine, SamplingParams(n=1, max_new_tokens=4),
                                                      tokenizer)
    assert time.perf_counter() - start < 0.9
    assert out["env_finish"].tolist() == ["error", "done", "done"] and "TimeoutError" in out["env_error"][0]
