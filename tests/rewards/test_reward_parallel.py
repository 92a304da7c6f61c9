"""Slow rewards in parallel: async functions awaited concurrently, synchronous ones in a process
pool, a per-sample timeout counted as a reward error; per-token rewards as a list per completion."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

import pytest
import torch

from rltrainer.rewards import RewardManager


async def judge(completions, delay, **kwargs):
    await asyncio.sleep(delay[0])
    return [float(len(completions[0]))]


def slow_cpu(completions, delay, **kwargs):
    time.sleep(delay[0])
    return [float(len(completions[0]))]


def worker_pid(completions, **kwargs):
    time.sleep(0.3)
    return [float(os.getpid())]


def per_token(completions, completion_ids, **kwargs):
    return [[0.5] * len(ids) for ids in completion_ids]


def test_async_rewards_run_concurrently_and_time_out_per_sample():
    manager = RewardManager([judge], timeout=1.0, max_concurrency=16)
    completions = ["a" * i for i in range(1, 9)]
    delays = [0.3] * 7 + [30.0]  # the last sample hangs
    start = time.perf_counter()
    result = manager(completions, {"delay": delays})
    elapsed = time.perf_counter() - start
    assert result.per_func["judge"].tolist() == [1, 2, 3, 4, 5, 6, 7, 0]
    assert result.errors == 1 and result.errors_per_func == {"judge": 1}
    assert elapsed < 8 * 0.3 + 1.0  # one after another would take 2.4 s plus the timeout


def test_process_pool_scores_in_other_processes_and_times_out(caplog):
    manager = RewardManager([slow_cpu, worker_pid], num_workers=2, timeout=2.0)
    try:
        result = manager(["ab", "abc", "abcd", "x"], {"delay": [0.0, 0.0, 0.0, 60.0]})
        assert result.per_func["slow_cpu"].tolist() == [2, 3, 4, 0]  # the hanging sample scored 0
        assert result.errors_per_func == {"slow_cpu": 1, "worker_pid": 0}
        pids = set(result.per_func["worker_pid"].tolist())
        assert os.getpid() not in pids and len(pids) >= 1
        assert "timed out" in caplog.text
        again = manager(["ab"], {"delay": [0.0]})  # the pool still works
        assert again.per_func["slow_cpu"].tolist() == [2.0] and again.errors == 0
    finally:
        manager.close()


def test_timeout_needs_a_pool_for_synchronous_functions():
    with pytest.raises(ValueError, match=r"timeout=1.0 needs num_workers > 0 for the synchronous reward functions "
                                         r"\['slow_cpu'\]"):
        RewardManager([slow_cpu, judge], timeout=1.0)
    with pytest.raises(ValueError, match="num_workers must be an int >= 0"):
        RewardManager([slow_cpu], num_workers=-1)


def test_per_token_rewards_sum_into_scores_and_lay_out_on_the_tokens():
    def outcome(completions, **kwargs):
        return [1.0] * len(completions)

    manager = RewardManager([per_token, outcome], weights=[2.0, 1.0])
    result = manager(["abc", "de"], {"completion_ids": [[5, 6, 7], [8, 9]]})
    assert result.token_scores == [[1.0, 1.0, 1.0], [1.0, 1.0]]
    assert result.scores.tolist() == [3.0 * 2 * 0.5 + 1.0, 2.0 * 2 * 0.5 + 1.0]
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    tokens = result.token_level_scores(mask)
    assert tokens.tolist() == [[1.0, 1.0, 2.0, 0.0], [1.0, 2.0, 0.0, 0.0]]  # the outcome on the last token
    torch.testing.assert_close(tokens.sum(-1), result.scores)
    with pytest.raises(ValueError, match=r"returned a list for completion 0 with 3 value\(s\), \[1.0, 1.0, 1.0\], "
                                         r"but its response has 2 tokens"):
        result.token_level_scores(torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0]]))


def test_grpo_passes_completion_ids_and_uses_per_token_rewards(tiny_config, bpe_tokenizer, gsm8k_prompts):
    from rltrainer import GRPO, Trainer, prompt_dataloader

    seen = {}

    def first_token_bonus(completions, completion_ids, **kwargs):
        seen["ids"] = completion_ids
        return [[1.0] + [0.0] * (len(ids) - 1) if ids else [] for ids in completion_ids]

    module = GRPO(tiny_config, bpe_tokenizer, reward_funcs=first_token_bonus, num_generations=2, max_new_tokens=5,
                  advantage_estimator="reinforce_plus_plus")
    captured = {}
    original = module.advantage_step
    module.advantage_step = lambda batch: (captured.setdefault("batch", batch), original(batch))[1]
    Trainer(max_steps=1, logger=False, enable_progress_bar=False).fit(module, prompt_dataloader(gsm8k_prompts, 2))
    batch = captured["batch"]
    mask = batch["response_mask"]
    assert [len(ids) for ids in seen["ids"]] == mask.sum(-1).tolist()
    assert torch.equal(batch["token_level_scores"][:, 0], torch.ones(len(batch)))
    torch.testing.assert_close(batch["token_level_scores"].sum(-1), batch["scores"])


def test_token_rewards_keep_what_the_scores_gained_since_on_the_last_token():
    from rltrainer.algorithms.advantages import AdvantageContext, outcome_token_rewards

    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    tokens = torch.tensor([[0.5, 0.0, 0.5, 0.0]])
    scores = torch.tensor([1.0 - 0.25])  # an overlong penalty added after the reward step
    rewards = outcome_token_rewards(scores, mask, AdvantageContext(token_level_scores=tokens), 0.0, "k1", "test")
    assert rewards.tolist() == [[0.5, 0.0, 0.25, 0.0]]


def test_pool_workers_leave_ctrl_c_to_the_controller():
    """A Ctrl-C in a terminal reaches the whole process group: the reward workers ignore it, so the
    controller can finish the step with them and save a checkpoint (rltrainer.interrupt)."""
    import signal

    from rltrainer.rewards.parallel import RewardPool

    pool = RewardPool(num_workers=1, timeout=None)
    try:
        assert pool._executor().submit(signal.getsignal, signal.SIGINT).result(timeout=120) == signal.SIG_IGN
    finally:
        pool.close()


UNGUARDED_SCRIPT = '''
# A training script as the README writes them: no `if __name__ == "__main__":` guard.
import os, sys, time

from rltrainer import GRPO, Trainer
from rltrainer.data import load_rows, prepare_gsm8k, prompt_dataloader
from rltrainer.testing import data_path, load_tokenizer, tiny_qwen2_config

PIDS = sys.argv[1]
print("script body ran", os.getpid(), file=sys.stderr, flush=True)  # once, in the controller
tokenizer = load_tokenizer("gsm8k-bpe4k")
rows = prepare_gsm8k(load_rows(str(data_path("gsm8k", "train.jsonl"))).select(range(4)), tokenizer,
                     max_prompt_length=160)


class Score(float):  # a class of the script's own, returned by the workers
    pass


def length_reward(completions, **kwargs):
    with open(PIDS, "a") as out:
        out.write(f"{os.getpid()}\\n")
    return [Score(len(c) / 100) for c in completions]


module = GRPO(tiny_qwen2_config(len(tokenizer), hidden_size=32, num_layers=2), tokenizer, reward_funcs=length_reward,
              num_generations=2, max_new_tokens=4, reward_num_workers=2)
Trainer(max_steps=2, logger=False, enable_progress_bar=False).fit(module, prompt_dataloader(rows, batch_size=2))
workers = {int(line) for line in open(PIDS)}
deadline = time.monotonic() + 5
while time.monotonic() < deadline and any(os.path.exists(f"/proc/{pid}") for pid in workers):
    time.sleep(0.1)
print("workers", sorted(workers), "alive after fit", [p for p in workers if os.path.exists(f"/proc/{p}")],
      file=sys.stderr)
'''


def test_a_script_without_main_guard_runs_with_a_pool_and_leaves_no_worker(tmp_path):
    """The README's scripts have no ``if __name__ == "__main__":``; spawned reward workers must not
    run them again (each would import and train; multiprocessing's bootstrapping error), and the pool
    ends with fit."""
    import subprocess
    import sys

    script, pids = tmp_path / "train.py", tmp_path / "pids.txt"
    script.write_text(UNGUARDED_SCRIPT)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(script), str(pids)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    elapsed = time.perf_counter() - start
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("script body ran") == 1, done.stderr[-3000:]
    assert "bootstrapping phase" not in done.stderr and "Traceback" not in done.stderr
    workers = {int(line) for line in pids.read_text().split()}
    assert workers and os.getpid() not in workers and len(workers) <= 2
    assert "alive after fit []" in done.stderr, done.stderr[-2000:]
    assert elapsed < 300  # it was a BrokenProcessPool (or 54-120 s of workers re-running the script)


def test_the_pool_closes_at_the_end_of_fit_and_when_it_fails(tiny_config, bpe_tokenizer, gsm8k_prompts):
    from rltrainer import GRPO, Callback, Trainer, prompt_dataloader

    class Fails(Callback):
        def on_step_end(self, trainer, module, metrics):
            raise RuntimeError("a callback failed")

    def gone(pid: int) -> bool:
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.05)
        return not os.path.exists(f"/proc/{pid}")

    for callbacks in ([], [Fails()]):
        module = GRPO(tiny_config, bpe_tokenizer, reward_funcs=worker_pid, num_generations=2, max_new_tokens=4,
                      reward_num_workers=1)
        trainer = Trainer(max_steps=1, logger=False, enable_progress_bar=False, callbacks=callbacks)
        with pytest.raises(RuntimeError, match="a callback failed") if callbacks else contextlib.nullcontext():
            trainer.fit(module, prompt_dataloader(gsm8k_prompts, 2))
        pid = int(trainer.callback_metrics["reward/worker_pid/mean"])  # one worker scored every sample
        assert pid != os.getpid() and module.rewards.pool._pool is None
        assert gone(pid), f"reward worker {pid} outlived fit (callbacks={callbacks})"
