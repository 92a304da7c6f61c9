"""Pipelines (sync, one_step_off, async) on CPU with ``hf`` replicas in split placement: version
tags, the staleness bound under random generation delays, drop counts, one_step_off against a
sync run that generates with the previous weights, exact / lossless resume, and failures."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from rltrainer import GRPO, AsyncPipeline, Trainer, prompt_dataloader
from rltrainer.callbacks import Callback
from rltrainer.controller import WorkerError
from rltrainer.data.batch import RolloutBatch
from rltrainer.module import generate_rollouts
from rltrainer.pipelines import concat_rollouts
from rltrainer.rollout.hf import HFEngine
from rltrainer.rollout.rollout import Rollout
from rltrainer.strategies import FSDP2Strategy, SingleDeviceStrategy
from rltrainer.testing import SlowHFEngine, length_reward

G = 2  # samples per prompt
B = 4  # prompts per step


class RecordingGRPO(GRPO):
    """Records, per step, the versions, prompt positions and responses it trains on."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.records: list[dict] = []

    def advantage_step(self, batch):
        self.records.append({"step": self.trainer.global_step, "versions": batch["policy_version"].tolist(),
                             "positions": [tuple(p) for p in batch["prompt_position"][::G].tolist()],
                             "responses": batch["responses"].clone()})
        return super().advantage_step(batch)

    def rollout_step(self, batch, engine):
        self.log("test/loader_batch", batch["prompt_position"][0, 1])  # logged in a pipeline thread
        return super().rollout_step(batch, engine)


class LoggedPerStep(Callback):
    """The ``test/loader_batch`` each step's metrics carry."""

    def __init__(self):
        self.seen: list[float] = []

    def on_step_end(self, trainer, module, metrics):
        self.seen.append(metrics.get("test/loader_batch"))


class LaggedGRPO(RecordingGRPO):
    """A sync run made to generate with the previous step's weights: a local engine kept one push
    behind (what one_step_off must be equal to)."""

    lagged: HFEngine | None = None

    def rollout_step(self, batch, engine):
        strategy = self.trainer.strategy
        if self.lagged is None:
            self.lagged = HFEngine()
            self.lagged.setup(strategy.model_config(), self.tokenizer, device="cpu")
            self.lagged.update_weights(strategy.export_weights())
        out = generate_rollouts(batch, self.lagged, self.sampling, self.tokenizer.pad_token_id)
        self.lagged.update_weights(strategy.export_weights())  # this step's weights, for the next one
        return out


def module(cls, config, tokenizer, seed=None, **kwargs):
    m = cls(config, tokenizer, reward_funcs=length_reward, num_generations=G, max_new_tokens=6, lr=1e-3, **kwargs)
    m.sampling.seed = seed  # a seeded engine: the samples depend on the weights and prompts only
    return m


def split(replicas=1):
    """Where :func:`trainer` places its engine: ``replicas`` processes of their own."""
    return {"placement": "split", "replicas": replicas}


def trainer(where, rollout="hf", **kwargs):
    """A Trainer on one FSDP2 rank whose ``rollout`` engine is placed ``where`` (``split(...)``)."""
    defaults = dict(logger=False, enable_progress_bar=False, seed=5)
    return Trainer(strategy=FSDP2Strategy(devices=1, micro_batch_size=4), rollout=Rollout(rollout, **where),
                   **{**defaults, **kwargs})


def test_modes_that_cannot_work_refuse_at_construction():
    with pytest.raises(ValueError, match="split"):
        Trainer(pipeline="one_step_off")  # in-process engine: nothing to overlap with
    with pytest.raises(ValueError, match="split"):
        Trainer(strategy=FSDP2Strategy(devices=1), pipeline="async")  # colocated
    with pytest.raises(ValueError, match="sync, one_step_off, async"):
        Trainer(pipeline="overlap")
    with pytest.raises(ValueError, match="max_staleness"):
        Trainer(strategy=FSDP2Strategy(devices=1), rollout=Rollout(**split()), pipeline=AsyncPipeline(max_staleness=-1))
    with pytest.raises(ValueError, match="wait, drop"):
        Trainer(strategy=FSDP2Strategy(devices=1), rollout=Rollout(**split()),
                pipeline=AsyncPipeline(staleness_policy="skip"))
    assert Trainer(strategy=FSDP2Strategy(devices=1), rollout=Rollout(**split()), pipeline="async").off_policy
    assert not Trainer(strategy=SingleDeviceStrategy()).off_policy  # hf in fp32: the trainer's log-probs


def test_concat_rollouts_pads_prompts_left_and_responses_right():
    def rows(p, t, fill):
        prompts = torch.full((2, p), fill)
        responses = torch.full((2, t), fill + 1)
        mask = torch.ones(2, p + t, dtype=torch.long)
        return RolloutBatch({"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
                             "attention_mask": mask, "response_mask": torch.ones(2, t, dtype=torch.long),
                             "policy_version": torch.tensor([3, 3]), "prompt_position": torch.zeros(2, 3, dtype=torch.long)},
                            non_tensors={"uid": ["a", "a"]})

    out = concat_rollouts([rows(2, 3, 10), rows(4, 1, 20)], pad_token_id=0)
    assert out["prompts"].tolist()[0] == [0, 0, 10, 10] and out["prompts"].tolist()[2] == [20] * 4
    assert out["responses"].tolist()[0] == [11, 11, 11] and out["responses"].tolist()[2] == [21, 0, 0]
    assert out["input_ids"].tolist()[0] == [0, 0, 10, 10, 11, 11, 11]
    assert out["input_ids"].tolist()[2] == [20, 20, 20, 20, 21, 0, 0]
    assert out["attention_mask"].tolist()[0] == [0, 0, 1, 1, 1, 1, 1]
    assert out["response_mask"].tolist()[2] == [1, 0, 0]
    assert out["prompt_position"].shape == (4, 3) and list(out["uid"]) == ["a"] * 4


class StepStartRecorder(GRPO):
    """Records ``on_step_start``'s batch and the order of each step's hooks."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.events: list[tuple[str, object]] = []

    def on_step_start(self, batch):
        self.events.append(("start", batch))

    def rollout_step(self, batch, engine):
        self.events.append(("rollout", [tuple(p) for p in batch["prompt_position"].tolist()]))
        return super().rollout_step(batch, engine)

    def reward_step(self, batch):
        self.events.append(("reward", [tuple(p) for p in batch["prompt_position"][::G].tolist()]))
        return super().reward_step(batch)

    def on_step_end(self, metrics):
        self.events.append(("end", None))


@pytest.mark.usefixtures("warm_ranks")  # replicas reuse warm processes (tests/conftest.py)
@pytest.mark.parametrize("pipeline", ["sync", "one_step_off", "async"])
def test_on_step_start_gets_the_steps_prompt_batch_in_every_pipeline(pipeline, tiny_config, bpe_tokenizer,
                                                                      gsm8k_prompts, request):
    """Issue 45: ``on_step_start`` keeps one promise in every pipeline: at the start of each step
    (after the previous one's ``on_step_end``, before its ``reward_step``) with the prompt batch of
    the rows the step trains on (``B`` prompt rows, ``prompt_position [B, 3]``, no responses); in
    ``sync`` also before their ``rollout_step``."""
    if pipeline != "sync":
        request.getfixturevalue("ray_session")
    m = module(StepStartRecorder, tiny_config, bpe_tokenizer, seed=11)
    where = dict(strategy=SingleDeviceStrategy()) if pipeline == "sync" else \
        dict(strategy=FSDP2Strategy(devices=1, micro_batch_size=4), rollout=Rollout(**split()))
    with Trainer(**where, pipeline=pipeline, max_epochs=1, logger=False, enable_progress_bar=False, seed=5) as t:
        t.fit(m, prompt_dataloader(gsm8k_prompts.select(range(3 * B)), batch_size=B))
    events = m.events
    starts, rewards, ends = ([i for i, (kind, _) in enumerate(events) if kind == k] for k in ("start", "reward", "end"))
    assert len(starts) == len(rewards) == len(ends) == 3
    for step, (s, r, e) in enumerate(zip(starts, rewards, ends)):
        batch = events[s][1]
        assert isinstance(batch, RolloutBatch) and len(batch) == B
        assert "prompt_ids" in batch and "responses" not in batch  # the prompts, not the generated rows
        positions = [tuple(p) for p in batch["prompt_position"].tolist()]
        assert positions == events[r][1]  # the prompts of the rows this step trains on, in their order
        assert (ends[step - 1] if step else -1) < s < r < e
        if pipeline == "sync":
            assert events[s + 1] == ("rollout", positions)  # before their rollout_step


@pytest.mark.usefixtures("warm_ranks")  # replicas reuse warm processes (tests/conftest.py)
def test_one_step_off_trains_step_t_on_samples_of_version_t_minus_1(tiny_config, bpe_tokenizer, gsm8k_prompts,
                                                                     ray_session):
    """With a seeded engine, one_step_off equals a sync run whose rollouts use the previous step's
    weights: the same responses at every step and the same weights at the end."""
    prompts = gsm8k_prompts.select(range(4 * B))
    runs = {}
    for name, cls, pipeline in (("one_step_off", RecordingGRPO, "one_step_off"), ("lagged", LaggedGRPO, "sync")):
        m = module(cls, tiny_config, bpe_tokenizer, seed=11)
        logged = LoggedPerStep()
        with trainer(split(), pipeline=pipeline, max_epochs=1, callbacks=[logged]) as t:
            t.fit(m, prompt_dataloader(prompts, batch_size=B))
            runs[name] = (m.records, dict(t.strategy.export_weights()))
            if pipeline == "one_step_off":  # off-policy, one optimizer step: measured inside the update
                assert "rollout_corr/kl" in t.callback_metrics and "timing_s/old_log_prob" not in t.callback_metrics
                assert abs(t.callback_metrics["rollout_corr/kl"]) > 0  # the previous version's log-probs
                # what rollout_step logged (in a thread, during the previous step) is its batch's step's
                assert logged.seen == [0, 1, 2, 3]
    records, weights = runs["one_step_off"]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for r in records:
        assert set(r["versions"]) == {max(r["step"] - 1, 0)}  # exactly one version of lag after the first
        assert r["positions"] == [(0, r["step"], i) for i in range(B)]  # the loader's order
    for ours, lagged in zip(records, runs["lagged"][0]):
        assert torch.equal(ours["responses"], lagged["responses"]), ours["step"]
    for name, tensor in runs["lagged"][1].items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-6, msg=name)


@pytest.mark.usefixtures("warm_ranks")  # replicas reuse warm processes (tests/conftest.py)
@pytest.mark.parametrize("policy,max_staleness", [("wait", 1), ("drop", 1), ("wait", 0)])
def test_async_never_exceeds_the_staleness_bound_and_counts_drops(policy, max_staleness, tiny_config, bpe_tokenizer,
                                                                  gsm8k_prompts, ray_session):
    """Two replicas with random delays: every trained row is at most ``max_staleness`` versions
    old, each prompt of the epoch is trained exactly once, and the dropped rows are exactly the
    groups generated but not trained on."""
    generated: list[tuple] = []
    lock = threading.Lock()

    class Counting(RecordingGRPO):
        def rollout_step(self, batch, engine):
            out = super().rollout_step(batch, engine)
            with lock:
                generated.extend(range(len(batch)))
            return out

    drops = []

    class Drops(Callback):
        def on_step_end(self, trainer, module, metrics):
            drops.append(metrics["pipeline/dropped_rows"])
            assert metrics["pipeline/staleness_max"] <= max_staleness

    prompts = gsm8k_prompts.select(range(6 * B))
    m = module(Counting, tiny_config, bpe_tokenizer)
    delay = (0.0, 1.0) if policy == "drop" else (0.0, 0.4)  # drop: a replica often falls behind the other
    with trainer(split(replicas=2), rollout=SlowHFEngine(delay_s=delay, seed=max_staleness),
                 pipeline=AsyncPipeline(max_staleness=max_staleness, staleness_policy=policy), max_epochs=1,
                 callbacks=[Drops()]) as t:
        t.fit(m, prompt_dataloader(prompts, batch_size=B))
    trained = [p for r in m.records for p in r["positions"]]
    assert sorted(trained) == sorted((0, b, i) for b in range(6) for i in range(B))  # once each
    for r in m.records:
        assert all(0 <= r["step"] - v <= max_staleness for v in r["versions"]), r
    print(f"{policy} max_staleness={max_staleness}: dropped {sum(drops):.0f} rows, generated {len(generated)} groups")
    assert sum(drops) == (len(generated) - len(trained)) * G
    if policy == "wait":
        assert sum(drops) == 0
    assert t.current_epoch == 1


@pytest.mark.usefixtures("warm_ranks")  # replicas reuse warm processes (tests/conftest.py)
@pytest.mark.parametrize("pipeline", ["sync", "one_step_off"])
def test_resume_is_exact(pipeline, tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path, ray_session):
    """The same weights as an uninterrupted run (one_step_off's next batch, already generated,
    travels in the checkpoint; the replica's RNG is restored)."""
    prompts = gsm8k_prompts.select(range(4 * B))

    def run(max_steps, ckpt=None, save=None):
        m = module(RecordingGRPO, tiny_config, bpe_tokenizer)
        with trainer(split(), pipeline=pipeline, max_steps=max_steps, default_root_dir=tmp_path) as t:
            t.fit(m, prompt_dataloader(prompts, batch_size=B), ckpt_path=ckpt)
            if save:
                t.save_checkpoint(save)
            return dict(t.strategy.export_weights()), m.records

    full, records = run(3)
    run(1, save=tmp_path / "step1.ckpt")
    resumed, resumed_records = run(3, ckpt=tmp_path / "step1.ckpt")
    assert [r["positions"] for r in resumed_records] == [r["positions"] for r in records[1:]]
    for name, tensor in full.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=0, atol=1e-6, msg=name)


@pytest.mark.usefixtures("warm_ranks")  # replicas reuse warm processes (tests/conftest.py)
def test_async_resume_loses_and_repeats_no_prompt(tiny_config, bpe_tokenizer, gsm8k_prompts, tmp_path, ray_session):
    prompts = gsm8k_prompts.select(range(5 * B))
    trained = []
    for max_steps, ckpt, save in ((2, None, tmp_path / "a.ckpt"), (-1, tmp_path / "a.ckpt", None)):
        m = module(RecordingGRPO, tiny_config, bpe_tokenizer)
        with trainer(split(replicas=2), rollout=SlowHFEngine(delay_s=(0.0, 0.3)),
                     pipeline=AsyncPipeline(max_staleness=2, staleness_policy="drop"), max_steps=max_steps,
                     max_epochs=1) as t:
            t.fit(m, prompt_dataloader(prompts, batch_size=B), ckpt_path=ckpt)
            if save:
                t.save_checkpoint(save)
        trained += [p for r in m.records for p in r["positions"]]
    assert sorted(trained) == sorted((0, b, i) for b in range(5) for i in range(B))


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("pipeline", ["one_step_off", "async"])
def test_a_dead_rollout_process_raises_in_the_controller(pipeline, tiny_config, bpe_tokenizer, gsm8k_prompts,
                                                         ray_session):
    killed = {}

    class Kill(Callback):
        def on_step_end(self, trainer, module, metrics):
            if trainer.global_step == 2:
                killed["pid"], killed["at"] = trainer.rollout.group.pids[0], time.perf_counter()
                os.kill(killed["pid"], signal.SIGKILL)

    m = module(RecordingGRPO, tiny_config, bpe_tokenizer)
    t = trainer(split(), pipeline=pipeline, max_epochs=1, callbacks=[Kill()])
    with pytest.raises(WorkerError) as info:
        t.fit(m, prompt_dataloader(gsm8k_prompts, batch_size=B))
    assert time.perf_counter() - killed["at"] < 30
    assert "rollout[rank 0]" in str(info.value) and "died" in str(info.value)
    assert not [th for th in threading.enumerate() if th.name.startswith("rltrainer-rollout")]


def test_shutdown_with_requests_in_flight_leaves_no_process_behind(tiny_config, bpe_tokenizer, gsm8k_prompts,
                                                                   ray_session):
    seen = {}

    class Interrupt(Callback):
        def on_step_end(self, trainer, module, metrics):
            seen["pids"] = list(trainer.rollout.group.pids)
            seen["in_flight"] = len(trainer._run._in_flight)
            seen["at"] = time.perf_counter()
            raise KeyboardInterrupt  # e.g. Ctrl-C while the replicas generate

    m = module(RecordingGRPO, tiny_config, bpe_tokenizer)
    t = trainer(split(replicas=2), rollout=SlowHFEngine(delay_s=(1.0, 1.0)), pipeline=AsyncPipeline(max_staleness=2),
                max_epochs=1, callbacks=[Interrupt()])
    with pytest.raises(KeyboardInterrupt):
        t.fit(m, prompt_dataloader(gsm8k_prompts, batch_size=B))
    assert seen["in_flight"] > 0
    assert time.perf_counter() - seen["at"] < 10  # the requests in flight are not waited for
    assert all(_gone(pid) for pid in seen["pids"])
    assert not [th for th in threading.enumerate() if th.name.startswith("rltrainer-rollout")]


@pytest.mark.usefixtures("warm_ranks")  # replicas reuse warm processes (tests/conftest.py)
def test_remote_generate_async_returns_before_the_replica_finishes(tiny_config, bpe_tokenizer, gsm8k_prompts,
                                                                   ray_session):
    m = module(RecordingGRPO, tiny_config, bpe_tokenizer)
    with trainer(split(), rollout=SlowHFEngine(delay_s=(1.5, 1.5)), max_steps=1) as t:
        t.validate(m, prompt_dataloader(gsm8k_prompts.select(range(2)), batch_size=2))  # sets up, syncs
        start = time.perf_counter()
        future = t.engine.generate_async([gsm8k_prompts[0]["prompt_ids"]], m.sampling)
        assert time.perf_counter() - start < 0.5 and not future.done()
        generation = future.result(timeout=30)
        assert generation.weight_version == 0 and len(generation.text) == G


class SleepCountingEngine(HFEngine):
    """The ``hf`` engine, noting each ``sleep`` / ``wake_up`` in a file of its process in ``log_dir``."""

    def __init__(self, log_dir: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.log_dir = log_dir

    def _note(self, call: str) -> None:
        with open(os.path.join(self.log_dir, f"{os.getpid()}.log"), "a") as f:
            f.write(call + "\n")

    def sleep(self, level: int = 1) -> None:
        self._note("sleep")
        super().sleep(level)

    def wake_up(self) -> None:
        self._note("wake_up")
        super().wake_up()


@pytest.mark.usefixtures("warm_ranks")  # replicas reuse warm processes (tests/conftest.py)
@pytest.mark.parametrize("placement", ["split", "colocated"])
def test_sync_puts_only_engines_that_share_the_trainers_memory_to_sleep(placement, tiny_config, bpe_tokenizer,
                                                                        gsm8k_prompts, tmp_path, ray_session):
    """A split engine has a device of its own: sleeping it after each rollout would only copy its
    weights out and back (vLLM's level 1). A colocated one sleeps while the policy trains."""
    m = module(RecordingGRPO, tiny_config, bpe_tokenizer)
    with trainer({"placement": placement}, rollout=SleepCountingEngine(str(tmp_path)), max_steps=2) as t:
        t.fit(m, prompt_dataloader(gsm8k_prompts.select(range(2 * B)), batch_size=B))
    calls = [line for path in sorted(tmp_path.glob("*.log")) for line in path.read_text().split()]
    assert calls == ([] if placement == "split" else ["wake_up", "sleep"] * 2)


def test_async_with_a_bound_of_one_equals_one_step_off(tiny_config, bpe_tokenizer, gsm8k_prompts, ray_session):
    """With one replica and ``max_staleness=1`` (``wait``), async keeps two requests out: the same
    schedule as one_step_off. With a seeded engine both train on the same responses of the same
    versions and end with the same weights."""
    prompts = gsm8k_prompts.select(range(4 * B))
    runs = {}
    for pipeline, spec in (("one_step_off", "one_step_off"), ("async", AsyncPipeline(max_staleness=1))):
        m = module(RecordingGRPO, tiny_config, bpe_tokenizer, seed=11)
        with trainer(split(), pipeline=spec, max_epochs=1) as t:
            t.fit(m, prompt_dataloader(prompts, batch_size=B))
            runs[pipeline] = (m.records, dict(t.strategy.export_weights()))
    (ours, weights), (theirs, reference) = runs["async"], runs["one_step_off"]
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == [0, 1, 2, 3]
    for a, b in zip(ours, theirs):
        assert a["versions"] == b["versions"] and a["positions"] == b["positions"], a["step"]
        assert torch.equal(a["responses"], b["responses"]), a["step"]
    for name, tensor in reference.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-6, msg=name)


class RoutesGRPO(GRPO):
    """Keeps, per trained batch, the rows' versions, tokens and routes (a MoE policy's)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.records: list[dict] = []

    def advantage_step(self, batch):
        self.records.append({k: batch[k].clone() for k in ("policy_version", "input_ids", "attention_mask",
                                                             "position_ids", "routed_experts")})
        return super().advantage_step(batch)


class WeightsPerVersion(Callback):
    """The policy's weights at every version (0: before the first step; v: after step v's update)."""

    def __init__(self):
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    def on_fit_start(self, trainer, module):
        self.weights[0] = {n: t.clone() for n, t in trainer.strategy.export_weights()}

    def on_step_end(self, trainer, module, metrics):
        self.weights[trainer.global_step] = {n: t.clone() for n, t in trainer.strategy.export_weights()}


@pytest.mark.parametrize("pipeline", ["one_step_off", AsyncPipeline(max_staleness=1)], ids=["one_step_off", "async"])
def test_moe_rows_keep_the_routes_of_the_weights_that_generated_them(pipeline, bpe_tokenizer, gsm8k_prompts,
                                                                     ray_session):
    """Off-policy rows of a MoE policy carry the routes their own version's weights chose (an ``hf``
    replica in fp32 routes as the policy of that version does), not the trainer's current ones."""
    from rltrainer.models import build_causal_lm
    from rltrainer.models.moe import capturing, moe_of, take_routes
    from rltrainer.testing.families import tiny_moe_config

    config = tiny_moe_config(len(bpe_tokenizer))
    m = RoutesGRPO(config, bpe_tokenizer, reward_funcs=length_reward, num_generations=G, max_new_tokens=6, lr=3e-3)
    versions = WeightsPerVersion()
    with trainer(split(), pipeline=pipeline, max_steps=3, callbacks=[versions]) as t:
        t.fit(m, prompt_dataloader(gsm8k_prompts.select(range(4 * B)), batch_size=B))
    model = build_causal_lm(config, seed=0)
    lagged = differ = 0
    for r in m.records:
        for version in r["policy_version"].unique().tolist():
            rows = r["policy_version"] == version
            batch = {k: v[rows] for k, v in r.items()}
            model.load_state_dict(versions.weights[version], strict=False)
            with torch.no_grad(), capturing(model) as routing:
                model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                      position_ids=batch["position_ids"])
                own = take_routes(routing, batch["input_ids"].numel()).view(*batch["input_ids"].shape, 2, 2)
            known = (batch["routed_experts"] >= 0).all(-1) & batch["attention_mask"].bool()[..., None]
            same = (own.sort(-1).values == batch["routed_experts"].sort(-1).values).all(-1)
            assert same[known].float().mean() >= 0.999, (version, same[known].float().mean())
            lagged += version < max(versions.weights)
            if version + 1 in versions.weights:  # the next version's weights route some tokens elsewhere
                model.load_state_dict(versions.weights[version + 1], strict=False)
                with torch.no_grad(), capturing(model) as routing:
                    model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                          position_ids=batch["position_ids"])
                    newer = take_routes(routing, batch["input_ids"].numel()).view(*batch["input_ids"].shape, 2, 2)
                differ += int((newer.sort(-1).values != batch["routed_experts"].sort(-1).values).any(-1)[known].sum())
    assert lagged and differ > 0
    assert moe_of(model) is not None


# -- reproducible under load: the version a row is generated with is a function of its step --------
@pytest.mark.usefixtures("warm_ranks")  # replicas reuse warm processes (tests/conftest.py)
def test_async_generates_each_step_with_the_version_its_place_assigns(tiny_config, bpe_tokenizer, gsm8k_prompts,
                                                                      ray_session):
    """``max_staleness=2``, one replica, generation slower than a step: step ``s`` trains on rows of
    version ``max(0, s - 2)`` exactly. (Timing-driven, a push that lands while a request waits behind
    another on the replica gave that request the newer version.)"""
    m = module(RecordingGRPO, tiny_config, bpe_tokenizer, seed=11)
    with trainer(split(), rollout=SlowHFEngine(delay_s=(0.6, 0.6)), pipeline=AsyncPipeline(max_staleness=2),
                 max_steps=5) as t:
        t.fit(m, prompt_dataloader(gsm8k_prompts.select(range(6 * B)), batch_size=B))
    assert [sorted(set(r["versions"])) for r in m.records] == [[max(0, s - 2)] for s in range(5)]


class LateGRPO(RecordingGRPO):
    """Sends each request only once the trainer has started pushing a newer version than its batch's
    (loader batch ``b`` of a run ``lag`` versions behind: after push ``b - lag + 1``)."""

    lag = 1

    def rollout_step(self, batch, engine):
        index, deadline = int(batch["prompt_position"][0, 1]), time.monotonic() + 10
        while index >= self.lag and self.trainer.global_step <= index - self.lag and time.monotonic() < deadline:
            time.sleep(0.01)
        return super().rollout_step(batch, engine)


@pytest.mark.usefixtures("warm_ranks")  # replicas reuse warm processes (tests/conftest.py)
@pytest.mark.parametrize("pipeline,lag", [("one_step_off", 1), (AsyncPipeline(max_staleness=2), 2)],
                         ids=["one_step_off", "async"])
def test_a_request_sent_after_a_newer_push_still_uses_its_scheduled_version(pipeline, lag, tiny_config, bpe_tokenizer,
                                                                            gsm8k_prompts, ray_session):
    """The controller thread is late: the replica already receives the next version when the request
    arrives. The request still generates with its batch's version (timing-driven, it took the newer one)."""
    m = module(LateGRPO, tiny_config, bpe_tokenizer, seed=11)
    m.lag = lag
    with trainer(split(), pipeline=pipeline, max_steps=4) as t:
        t.fit(m, prompt_dataloader(gsm8k_prompts.select(range(6 * B)), batch_size=B))
    assert [sorted(set(r["versions"])) for r in m.records] == [[max(0, s - lag)] for s in range(4)]


class CoinFlipEngine(HFEngine):
    """The ``hf`` engine that waits either not at all or ``long_s`` before each request, by a coin
    tossed with the operating system's entropy: two runs' timings differ at about every step."""

    def __init__(self, long_s: float = 0.6, **kwargs) -> None:
        super().__init__(**kwargs)
        self.long_s = long_s

    def generate(self, prompts, sampling):
        time.sleep(self.long_s * (os.urandom(1)[0] & 1))
        return super().generate(prompts, sampling)


class CoinFlipGRPO(RecordingGRPO):
    """Waits 0 or 0.6 s before each step's update (and so before its push), by a coin as above."""

    def advantage_step(self, batch):
        time.sleep(0.6 * (os.urandom(1)[0] & 1))
        return super().advantage_step(batch)


class CpuBurner:
    """A process that spins on a CPU while the block runs (the load that made runs differ)."""

    def __enter__(self):
        import subprocess
        import sys

        self.process = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        return self

    def __exit__(self, *exc):
        self.process.kill()
        self.process.wait()


@pytest.mark.usefixtures("warm_ranks")  # replicas reuse warm processes (tests/conftest.py)
def test_async_runs_beside_a_cpu_burner_end_with_the_same_weights(tiny_config, bpe_tokenizer, gsm8k_prompts,
                                                                   ray_session):
    """The same seeded ``max_staleness=2`` run twice, a CPU burned beside it, and the engine and the
    trainer each waiting 0 or 0.6 s at random before each request / update (so the runs' timings
    differ): the weights end bit for bit equal, trained on the same rows of the same versions."""
    runs = []
    with CpuBurner():
        for _ in range(2):
            m = module(CoinFlipGRPO, tiny_config, bpe_tokenizer, seed=11)
            with trainer(split(), rollout=CoinFlipEngine(), pipeline=AsyncPipeline(max_staleness=2),
                         max_steps=8) as t:  # 2 prompts a step: eight coin tosses that may move a version
                t.fit(m, prompt_dataloader(gsm8k_prompts.select(range(20)), batch_size=2))
                runs.append((m.records, dict(t.strategy.export_weights())))
    (first, weights), (second, again) = runs
    assert [r["versions"] for r in first] == [r["versions"] for r in second]
    for a, b in zip(first, second):
        assert torch.equal(a["responses"], b["responses"]), a["step"]
    for name, tensor in weights.items():
        assert torch.equal(again[name], tensor), name


def test_async_is_deterministic_with_wait_and_drop_is_timing_driven():
    assert AsyncPipeline().deterministic and not AsyncPipeline(staleness_policy="drop").deterministic
    assert not AsyncPipeline(deterministic=False).deterministic
    with pytest.raises(ValueError, match="deterministic=True needs staleness_policy='wait'"):
        AsyncPipeline(staleness_policy="drop", deterministic=True)
    with pytest.raises(ValueError, match="deterministic must be True, False or None.*got 'yes'"):
        AsyncPipeline(deterministic="yes")
    assert repr(AsyncPipeline(2, deterministic=False)) == \
        "AsyncPipeline(max_staleness=2, staleness_policy='wait', deterministic=False)"


class Replica:
    """A fake replica: ``rollout_step`` blocks until ``go`` is set; ``hold`` records its versions
    and returns a wait that blocks until ``held`` is set (``holds=False``: it cannot hold)."""

    replicas = 1

    def __init__(self, holds: bool):
        self.holds_versions, self.weight_version = holds, 0
        self.go, self.held, self.calls = threading.Event(), threading.Event(), []

    def replica(self, index):
        return self

    def at_version(self, version):
        return self

    def hold(self, version):
        self.calls.append(("hold", version))
        return lambda: self.held.wait(10)

    def release(self, version):
        self.calls.append(("release", version))

    def rollout_step(self, name, batch, engine):
        assert self.go.wait(10)
        return RolloutBatch({"responses": torch.zeros(len(batch) * G, 2, dtype=torch.long)})


@pytest.mark.parametrize("holds", [True, False], ids=["held", "in_order"])
def test_before_a_push_rollouts_of_older_versions_are_held_or_done(holds):
    """A replica that holds: the push waits until the hold is in place, not for the rollout. One that
    receives in order with its requests (tensor-parallel vLLM): the push waits for the rollout."""
    from types import SimpleNamespace

    from rltrainer.controller.watchdog import Watchdog
    from rltrainer.module import StepMetrics
    from rltrainer.pipelines import AsyncRun, Prompts

    engine = Replica(holds)
    engine.placement = "split"  # as Rollout.connect marks split replicas
    fit = SimpleNamespace(module=SimpleNamespace(sampling=SimpleNamespace(n=G)), step=0, metrics=StepMetrics(),
                          engine=engine, watchdog=Watchdog(),
                          call_module=engine.rollout_step)
    run = AsyncRun(fit, [], max_staleness=1, staleness_policy="wait", deterministic=True)
    prompts = Prompts(RolloutBatch.from_rows([{"prompt_ids": [1, 2]}]), [(0, 0, 0)])
    future = run._submit(prompts, engine=engine, version=0, lane=0)
    pushing = threading.Thread(target=run.before_push, args=(1,), daemon=True)
    pushing.start()
    time.sleep(0.2)
    assert pushing.is_alive()
    (engine.held if holds else engine.go).set()  # the hold arrives / the rollout ends
    pushing.join(5)
    assert not pushing.is_alive() and future.done() != holds
    engine.go.set()
    assert future.result()["policy_version"].tolist() == [0] * G
    run.before_push(2)  # nothing more to wait for
    assert engine.calls == ([("hold", 0), ("release", 0)] if holds else [])
    run.close()
