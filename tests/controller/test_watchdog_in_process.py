"""Every wait of the controller is watched: with ``stage_timeout_s`` set, a reward function, a
``single`` strategy stage, an engine call in this process, a weight push and the wait for rollout
threads that never return raise :class:`StageTimeout` in the controller, naming what hung and
showing its thread's stack, within seconds of the timeout."""

import multiprocessing
import os
import threading
import time

import pytest

from rltrainer import GRPO, AsyncPipeline, Trainer, prompt_dataloader
from rltrainer.controller.watchdog import StageTimeout, Watchdog, doing
from rltrainer.rollout.hf import HFEngine
from rltrainer.rollout.rollout import Rollout
from rltrainer.testing import length_reward
from rltrainer.weights.transports import InProcessTransport

TIMEOUT_S = 2.0
SLACK_S = 10.0  # thread start, the stack, a busy 2-core machine
RELEASE = threading.Event()  # set after each test: the threads left behind return
STARTED: list[float] = []  # when the hang started (time.monotonic)


@pytest.fixture(autouse=True)
def release_hung_threads():
    RELEASE.clear()
    STARTED.clear()
    yield
    RELEASE.set()


def hang(*args, **kwargs):
    STARTED.append(time.monotonic())
    RELEASE.wait(120)
    raise RuntimeError("released")


def hang_on_call(n: int, original):
    """A stand-in for ``original`` that hangs from its ``n``-th call on."""
    calls = []

    def stand_in(*args, **kwargs):
        calls.append(1)
        return hang() if len(calls) >= n else original(*args, **kwargs)
    return stand_in


def hanging_reward(completions, **kwargs):
    return hang()


def sleeping_reward(completions, **kwargs):  # in a pool process: write when it starts, then never return
    with open(os.environ["RLTRAINER_TEST_HANG_MARK"], "w") as mark:
        mark.write(str(time.time()))
    time.sleep(3600)
    return [0.0] * len(completions)


class HangingPolicyStep(GRPO):
    def policy_step(self, micro_batch):
        return hang()


def fit(module, gsm8k_prompts, **kwargs):
    trainer = Trainer(max_steps=2, logger=False, enable_progress_bar=False, **kwargs)
    with pytest.raises(StageTimeout) as info:
        trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2))
    return info.value, time.monotonic() - STARTED[0] if STARTED else None


def grpo(tiny_config, bpe_tokenizer, cls=GRPO, **kwargs):
    return cls(tiny_config, bpe_tokenizer, **{"reward_funcs": length_reward, "num_generations": 2,
                                              "max_new_tokens": 8, **kwargs})


def check(error: StageTimeout, stage: str, where: str, after_s: float | None) -> str:
    headline, message = str(error).splitlines()[0], str(error)
    assert error.stage == stage, message
    assert headline.startswith(f"Stage {stage!r} timed out after "), headline
    assert where in message, message  # the stuck thread's stack shows where it hangs
    assert after_s is None or TIMEOUT_S <= after_s < TIMEOUT_S + SLACK_S, after_s
    return headline


def test_a_call_past_its_timeout_raises_with_its_stack_and_leaves_a_daemon_thread():
    dog = Watchdog(TIMEOUT_S)
    start = time.monotonic()
    with pytest.raises(StageTimeout) as info:
        dog.call("reward.reward_step", hang)
    assert TIMEOUT_S <= time.monotonic() - start < TIMEOUT_S + SLACK_S
    headline = check(info.value, "reward.reward_step", "in hang", None)
    assert "did not return (in hang (test_watchdog_in_process.py:" in headline, headline  # where it hangs
    assert "in the controller's thread 'rltrainer-reward.reward_step'" in headline
    left = [t for t in threading.enumerate() if t.name == "rltrainer-reward.reward_step"]
    assert left and all(t.daemon for t in left)  # it does not keep the process alive at exit
    assert dog.call("single.compute", lambda x: x + 1, 1) == 2 and not dog.in_flight()
    with pytest.raises(ZeroDivisionError):
        dog.call("single.compute", lambda: 1 / 0)  # an error comes back as itself


def test_unwatched_without_stage_timeout_and_what_a_call_declared_is_stopped():
    assert Watchdog().call("single.compute", threading.current_thread) is threading.current_thread()
    stopped = []

    def pooled():
        with doing("reward function 'f' (in a pool)", lambda: stopped.append(True)):
            hang()
    with pytest.raises(StageTimeout, match="reward function 'f' \\(in a pool\\) did not return"):
        Watchdog({"reward": TIMEOUT_S}).call("reward.reward_step", pooled)  # a group name's timeout
    assert stopped == [True]


def test_a_wait_on_rollout_threads_names_them_with_their_stacks():
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1, thread_name_prefix="rltrainer-rollout") as pool:
        future = pool.submit(hang)
        with pytest.raises(StageTimeout) as info:
            Watchdog(TIMEOUT_S).wait_first("pipeline.wait", [future], threads="rltrainer-rollout")
        RELEASE.set()
    headline = check(info.value, "pipeline.wait", "in hang", time.monotonic() - STARTED[0])
    assert "'rltrainer-rollout_0'" in headline


def test_an_outer_wait_lets_an_inner_watched_wait_report_first():
    dog = Watchdog({"weights.push": 1.0, "actor.send_weights": 3.0})
    inner = dog.begin("actor.send_weights")  # e.g. a push's wait on its Ray workers, in flight
    start = time.monotonic()
    threading.Timer(3.0, dog.end, args=(inner,)).start()  # the inner one gives up (and reports) at 3 s
    with pytest.raises(StageTimeout, match="'weights.push' timed out"):
        dog.call("weights.push", hang)
    assert 3.0 <= time.monotonic() - start < 3.0 + SLACK_S  # not at 1 s: the inner one had its time


def test_a_hung_reward_function_in_process(tiny_config, bpe_tokenizer, gsm8k_prompts):
    module = grpo(tiny_config, bpe_tokenizer, reward_funcs=[length_reward, hanging_reward])
    error, after_s = fit(module, gsm8k_prompts, stage_timeout_s={"reward": TIMEOUT_S})
    headline = check(error, "reward.reward_step", "in hanging_reward", after_s)
    assert "reward function 'hanging_reward' did not return" in headline


def test_a_hung_reward_function_in_a_pool_kills_the_pool(tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path,
                                                         monkeypatch):
    mark = tmp_path / "started"
    monkeypatch.setenv("RLTRAINER_TEST_HANG_MARK", str(mark))
    module = grpo(tiny_config, bpe_tokenizer, reward_funcs=sleeping_reward, reward_num_workers=1)
    timeout_s = 20.0  # the pool's start (a spawned process) counts too
    with pytest.raises(StageTimeout) as info:
        Trainer(max_steps=2, logger=False, enable_progress_bar=False, stage_timeout_s={"reward_step": timeout_s}
                ).fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2))
    after_s = time.time() - float(mark.read_text())
    headline = str(info.value).splitlines()[0]
    assert info.value.stage == "reward.reward_step"
    assert "reward function 'sleeping_reward' (in a pool of 1 processes, killed) did not return" in headline
    assert after_s < timeout_s + SLACK_S
    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not multiprocessing.active_children(), "the reward pool outlived the timeout"


def test_a_hung_single_strategy_stage(tiny_config, bpe_tokenizer, gsm8k_prompts):
    module = grpo(tiny_config, bpe_tokenizer, cls=HangingPolicyStep)
    error, after_s = fit(module, gsm8k_prompts, strategy="single", stage_timeout_s={"train_step": TIMEOUT_S})
    headline = check(error, "single.train_step", "in policy_step", after_s)
    assert "the call did not return (in hang (test_watchdog_in_process.py:" in headline, headline


def test_a_hung_engine_call_in_process(tiny_config, bpe_tokenizer, gsm8k_prompts, monkeypatch):
    monkeypatch.setattr(HFEngine, "generate", hang_on_call(2, HFEngine.generate))
    error, after_s = fit(grpo(tiny_config, bpe_tokenizer), gsm8k_prompts, stage_timeout_s={"rollout_step": TIMEOUT_S})
    check(error, "rollout.rollout_step", "in stand_in", after_s)
    assert "in rollout_step" in str(error)


def test_a_hung_engine_call_in_validation(tiny_config, bpe_tokenizer, gsm8k_prompts, monkeypatch):
    monkeypatch.setattr(HFEngine, "generate", hang_on_call(1, HFEngine.generate))
    trainer = Trainer(logger=False, enable_progress_bar=False, stage_timeout_s={"validation_step": TIMEOUT_S})
    with pytest.raises(StageTimeout) as info:
        trainer.validate(grpo(tiny_config, bpe_tokenizer), prompt_dataloader(gsm8k_prompts, batch_size=2))
    check(info.value, "rollout.validation_step", "in stand_in", time.monotonic() - STARTED[0])
    assert "in validation_step" in str(info.value)


def test_a_hung_weight_push(tiny_config, bpe_tokenizer, gsm8k_prompts, monkeypatch):
    monkeypatch.setattr(InProcessTransport, "_start", hang_on_call(2, InProcessTransport._start))  # 1: setup's
    error, after_s = fit(grpo(tiny_config, bpe_tokenizer), gsm8k_prompts, stage_timeout_s={"weights": TIMEOUT_S})
    check(error, "weights.push", "in _start_push", after_s)


@pytest.mark.usefixtures("warm_ranks")  # the split replica reuses a warm process (tests/conftest.py)
@pytest.mark.parametrize("pipeline, policy", [("one_step_off", "wait"), ("async", "drop")])
def test_a_hung_rollout_thread_under_the_buffer_wait(pipeline, policy, tiny_config, bpe_tokenizer, gsm8k_prompts,
                                                     ray_session, monkeypatch):
    from rltrainer.pipelines import SyncRun
    from rltrainer.strategies import FSDP2Strategy

    monkeypatch.setattr(SyncRun, "_run", hang_on_call(2, SyncRun._run))  # outside rollout_step's own watch
    strategy = FSDP2Strategy(devices=1, micro_batch_size=4)
    start = time.monotonic()
    error, after_s = fit(grpo(tiny_config, bpe_tokenizer), gsm8k_prompts, strategy=strategy,
                         rollout=Rollout(placement="split"),
                         pipeline=AsyncPipeline(staleness_policy=policy) if pipeline == "async" else pipeline,
                         stage_timeout_s={"pipeline.wait": TIMEOUT_S})
    check(error, "pipeline.wait", "in stand_in", None)
    assert "'rltrainer-rollout_" in str(error).splitlines()[0]
    assert after_s < 2 * TIMEOUT_S + SLACK_S  # the trainer's wait began after the hang (one step later)
    assert time.monotonic() - start < 120  # fit's teardown did not wait for the stuck request


class HangingReplicaEngine(HFEngine):
    """An ``hf`` engine whose second ``generate`` never returns (in its replica's process)."""

    def generate(self, prompts, sampling):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls >= 2:
            while True:
                time.sleep(3600)
        return super().generate(prompts, sampling)


@pytest.mark.usefixtures("warm_ranks")
def test_a_hung_engine_replica_names_its_rank(tiny_config, bpe_tokenizer, gsm8k_prompts, ray_session):
    from rltrainer.strategies import FSDP2Strategy

    strategy = FSDP2Strategy(devices=1, micro_batch_size=4)
    start = time.monotonic()
    error, _ = fit(grpo(tiny_config, bpe_tokenizer), gsm8k_prompts, strategy=strategy,
                   rollout=Rollout(HangingReplicaEngine(), placement="split"),
                   stage_timeout_s={"generate": TIMEOUT_S})
    headline = check(error, "rollout.generate", "generate", None)
    assert "rank 0 of 'rollout' did not answer" in headline and error.ranks == [0]
    assert time.monotonic() - start < 120
