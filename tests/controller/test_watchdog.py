"""No silent hangs: the controller's watchdog turns a hung stage into an error that names it, the
ranks that did not answer and their stacks, and shuts everything down."""

import os
import shutil
import time
from pathlib import Path

import pytest

from rltrainer import GRPO, Callback, Trainer, prompt_dataloader
from rltrainer.controller.watchdog import StageTimeout, Watchdog
from rltrainer.strategies import FSDP2Strategy
from rltrainer.testing import length_reward

TRAIN_STEP_TIMEOUT_S = 15.0


class HangingGRPO(GRPO):
    """``policy_step`` never returns, on every rank (a deadlock, a stuck collective, a lost device)."""

    def advantage_step(self, batch):
        batch = super().advantage_step(batch)
        self.logged_update_start = time.monotonic()  # on the controller: the update starts next
        return batch

    def policy_step(self, micro_batch):
        while True:
            time.sleep(3600)


class RecordPids(Callback):
    def on_fit_start(self, trainer, module):
        self.pids = list(trainer.strategy.group.pids)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state  # a zombie has exited


@pytest.mark.usefixtures("warm_ranks")  # warm processes (tests/conftest.py): a timed-out group still kills its own
def test_a_hung_policy_step_on_two_fsdp2_ranks_raises_with_stacks_and_leaves_no_process(
        tiny_config, bpe_tokenizer, gsm8k_prompts, ray_session):
    module = HangingGRPO(tiny_config, bpe_tokenizer, reward_funcs=length_reward, num_generations=2, max_new_tokens=8)
    pids = RecordPids()
    trainer = Trainer(strategy=FSDP2Strategy(devices=2, micro_batch_size=4), max_steps=2, logger=False,
                      enable_progress_bar=False, callbacks=[pids], stage_timeout_s={"train_step": TRAIN_STEP_TIMEOUT_S})
    with pytest.raises(StageTimeout) as info:
        trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2))
    raised_after = time.monotonic() - module.logged_update_start
    error, message = info.value, str(info.value)
    assert error.stage == "actor.train_step" and error.ranks == [0, 1]
    headline = message.splitlines()[0]
    assert headline.startswith("Stage 'actor.train_step' timed out after ") and "(its timeout: 15 s)" in headline
    assert "ranks 0, 1 of 'actor' did not answer" in headline, headline  # both hang: no collective to wait in
    assert TRAIN_STEP_TIMEOUT_S <= error.waited_s < TRAIN_STEP_TIMEOUT_S + 5
    assert raised_after < TRAIN_STEP_TIMEOUT_S + 45  # the stacks and the shutdown included, under load
    if shutil.which("py-spy"):
        assert message.count("policy_step") >= 2, message  # each rank's stack shows where it hangs
    assert trainer.strategy.group is None  # fit tore everything down
    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids.pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [p for p in pids.pids if alive(p)], "worker processes survived the timeout"


class HangingOnRank1(GRPO):
    """``policy_step`` never returns on rank 1; rank 0 then waits for it in FSDP2's collectives."""

    def policy_step(self, micro_batch):
        import torch.distributed as dist

        if dist.get_rank() == 1:
            while True:
                time.sleep(3600)
        return super().policy_step(micro_batch)


@pytest.mark.usefixtures("warm_ranks")
def test_the_headline_names_the_rank_that_hung_not_the_one_waiting_for_it(tiny_config, bpe_tokenizer, gsm8k_prompts,
                                                                           ray_session):
    module = HangingOnRank1(tiny_config, bpe_tokenizer, reward_funcs=length_reward, num_generations=2,
                            max_new_tokens=8)
    trainer = Trainer(strategy=FSDP2Strategy(devices=2, micro_batch_size=4), max_steps=2, logger=False,
                      enable_progress_bar=False, stage_timeout_s={"train_step": TRAIN_STEP_TIMEOUT_S})
    start = time.monotonic()
    with pytest.raises(StageTimeout) as info:
        trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2))
    error, headline = info.value, str(info.value).splitlines()[0]
    assert error.ranks == [0, 1]  # neither answered...
    if shutil.which("py-spy"):  # ...but rank 0's stack shows it waiting in a collective
        assert error.hung == [1] and error.rank == 1, str(error)
        assert "rank 1 of 'actor' did not answer (rank 0 waits for it in a collective)" in headline, headline
    assert time.monotonic() - start < TRAIN_STEP_TIMEOUT_S + 90  # setup, one step, the stacks, the shutdown


def test_timeouts_scale_with_the_running_median_above_a_floor():
    dog = Watchdog(factor=10.0, floor_s=2.0, first_timeout_s=100.0)
    assert dog.timeout_for("actor.train_step") == 100.0  # never completed: the first call's allowance
    for seconds in (0.5, 0.5, 3.0):
        dog._durations.setdefault("actor.train_step", __import__("collections").deque(maxlen=20)).append(seconds)
    assert dog.timeout_for("actor.train_step") == 5.0  # 10 x median 0.5
    dog._durations["actor.compute"] = __import__("collections").deque([0.01])
    assert dog.timeout_for("actor.compute") == 2.0  # the floor
    call = dog.begin("rollout.generate")
    assert dog.in_flight()[0].startswith("rollout.generate for ")
    dog.end(call)
    assert list(dog._durations["rollout.generate"]) and not dog.in_flight()
    failed = dog.begin("rollout.generate")
    dog.end(failed, completed=False)  # a failed call does not count towards the median
    assert len(dog._durations["rollout.generate"]) == 1


def test_fixed_timeouts_by_stage_or_method_and_bad_values():
    dog = Watchdog({"train_step": 7, "rollout.generate": 9})
    assert dog.timeout_for("actor.train_step") == 7 and dog.timeout_for("rollout.generate") == 9
    assert dog.timeout_for("actor.compute") == dog.first_timeout_s
    assert Watchdog(12).timeout_for("anything.at_all") == 12
    for bad in (0, -1, {"train_step": "soon"}):
        with pytest.raises(ValueError, match=r"stage_timeout_s(\['train_step'\])? must be a number > 0"):
            Trainer(stage_timeout_s=bad, logger=False, enable_progress_bar=False)


def test_a_timeout_for_a_stage_that_does_not_exist_is_refused_listing_the_known_ones():
    """{"rewrad": 5} was taken, and the reward stage kept its 1800 s default."""
    with pytest.raises(ValueError, match=r"stage_timeout_s=\{'rewrad': 5\}\): 'rewrad' names no stage, so its timeout "
                                         r"would never apply\. Did you mean 'reward'\? A key is a group \(actor, "
                                         r"rollout, reward, .*\), a method \(.*reward_step.*train_step.*\) or a stage"):
        Trainer(stage_timeout_s={"rewrad": 5}, logger=False, enable_progress_bar=False)
    for key in ("reward", "reward_step", "reward.reward_step", "train_step", "actor.train_step", "send_weights",
                "actor+rollout.send_weights", "rollout.generate", "pipeline"):
        assert Trainer(stage_timeout_s={key: 5}, logger=False, enable_progress_bar=False).watchdog.timeout_s == {key: 5}
    for key in ("actor.reward", "trainstep", "rollout.generat"):
        with pytest.raises(ValueError, match="names no stage"):
            Watchdog({key: 5})


def test_the_known_stage_names_are_the_workers_and_the_controllers():
    """WORKER_METHODS is the workers' @remote stages and the methods called by name; CONTROLLER_STAGES
    the controller's own watched calls (read from the source)."""
    import re

    from rltrainer.controller.methods import remote_methods
    from rltrainer.controller.watchdog import CONTROLLER_STAGES, STAGE_GROUPS, WORKER_METHODS
    from rltrainer.rollout.worker import InOrderWorker, Worker
    from rltrainer.strategies.fsdp2.worker import FSDP2Worker
    from rltrainer.strategies.megatron.worker import MegatronWorker

    source = "\n".join(p.read_text() for p in (Path(__file__).parents[2] / "rltrainer").rglob("*.py"))
    by_name = set(re.findall(r"execute_(?:all|rank_zero)(?:_async)?\(\"(\w+)\"", source))
    remote = {spec.stage for cls in (Worker, InOrderWorker, FSDP2Worker, MegatronWorker)
              for spec in remote_methods(cls).values()}
    assert set(WORKER_METHODS) == remote | by_name
    watched = set(re.findall(r"watchdog\.(?:call|wait_first)\(\"([\w.]+)\"", source))
    assert set(CONTROLLER_STAGES) == watched
    assert {s.split(".")[0] for s in CONTROLLER_STAGES} <= set(STAGE_GROUPS)
    assert set(re.findall(r'_ray_group\(.*?, "(\w+)"', source)) | {"actor"} <= set(STAGE_GROUPS)


def test_stacks_of_a_process_or_why_there_are_none():
    from rltrainer.controller.watchdog import python_stacks

    stacks = python_stacks({0: os.getpid()} if shutil.which("py-spy") else {0: 1})
    assert 0 in stacks and stacks[0].strip()
