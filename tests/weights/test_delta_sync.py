"""Delta weight sync end to end (``Rollout(delta=...)``, split placement, FSDP2 -> ``hf`` replicas on CPU):
after every step's sync the replica holds exactly what a full sync delivers (the policy cast to the
engine's dtype), on 1 and 2 training ranks, bf16 and fp32 engines, over shared memory, the object
store and a broadcast; a replica whose weights drifted is caught by the checksums and repaired; a
woken replica that dropped its weights, a new replica and a resumed run get full buckets first."""

from __future__ import annotations

import os

import pytest
import torch

from rltrainer import GRPO, Trainer, prompt_dataloader
from rltrainer.callbacks import Callback
from rltrainer.rollout.hf import HFEngine
from rltrainer.rollout.rollout import Rollout
from rltrainer.strategies import FSDP2Strategy
from rltrainer.testing import DiscardingHFEngine, length_reward
from rltrainer.weights import transports
from rltrainer.weights.delta import DeltaSync

pytestmark = pytest.mark.usefixtures("warm_ranks")  # ranks reuse warm processes (tests/conftest.py)

# tiny buckets at a small lr change 4-8% of their words: deltas up to half a bucket's bytes (the default, 10%,
# is what pays on the 2-core CPU, see bench_delta_sync.py)
SHARE_HALF = DeltaSync(max_share=0.5)

DELTA_METRICS = ("sync/changed_share", "sync/wire_share", "sync/checksum_mismatches", "sync/delta_buckets",
                 "sync/full_buckets")


@pytest.fixture
def syncs(monkeypatch):
    """Every split sync's stats as the controller's transport returns them, ``(version, stats)`` in
    order (the initial sync and a restore's too, which no step's metrics show)."""
    seen: list[tuple[int, dict]] = []
    start = transports._Split._start

    def recording(self, version):
        finish = start(self, version)

        def done():
            stats = finish()
            seen.append((version, dict(stats)))
            return stats

        return done

    monkeypatch.setattr(transports._Split, "_start", recording)
    return seen


class MatchesFullSync(Callback):
    """After every step (its sync waited for): each replica's weights equal, bit for bit, the policy's
    cast to the engine's dtype (but after the steps in ``unchecked``); keeps the step's metrics."""

    def __init__(self, dtype: torch.dtype, unchecked: tuple[int, ...] = ()) -> None:
        self.dtype, self.unchecked = dtype, unchecked
        self.metrics: list[dict[str, float]] = []

    def on_step_end(self, trainer, module, metrics):
        self.metrics.append(dict(metrics))
        if trainer.global_step not in self.unchecked:
            assert_replicas_hold_the_policy(trainer, self.dtype, f"after step {trainer.global_step}")


def assert_replicas_hold_the_policy(trainer, dtype: torch.dtype, when: str) -> None:
    full = {name: tensor.to(dtype) for name, tensor in trainer.strategy.export_weights()}
    for replica in trainer.rollout.group.remote.engine_weights():
        assert replica.keys() <= full.keys()
        bad = [name for name, tensor in replica.items() if not torch.equal(tensor, full[name])]
        assert not bad, f"{when}: the replica differs from a full sync in {bad}"


def make_module(config, tokenizer, lr: float):
    return GRPO(config, tokenizer, reward_funcs=length_reward, num_generations=2, max_new_tokens=8, lr=lr,
                kl_coef=0.0)


def make_trainer(devices: int, transport: str, engine, steps: int, callbacks=(), delta=SHARE_HALF, replicas: int = 1,
                 **kwargs) -> Trainer:
    strategy = FSDP2Strategy(devices=devices, micro_batch_size=4)
    rollout = Rollout(engine, placement="split", replicas=replicas, transport=transport, delta=delta,
                      bucket_bytes=16 << 10)
    return Trainer(strategy=strategy, rollout=rollout, max_steps=steps, logger=False, enable_progress_bar=False, seed=3,
                   callbacks=list(callbacks), **kwargs)


BF16_RUNS = [(devices, torch.bfloat16, transport) for devices in (1, 2)
             for transport in ("shared_memory", "object_store", "broadcast")]
FP32_RUNS = [(2, torch.float32, "shared_memory"), (1, torch.float32, "object_store"), (2, torch.float32, "broadcast")]


@pytest.mark.parametrize("devices, dtype, transport", BF16_RUNS + FP32_RUNS,
                         ids=lambda v: str(v).removeprefix("torch."))
def test_every_step_the_replica_equals_a_full_sync(devices, dtype, transport, tiny_config, bpe_tokenizer,
                                                   gsm8k_prompts, ray_session, syncs):
    check = MatchesFullSync(dtype)
    lr = 2e-6 if dtype == torch.bfloat16 else 1e-4  # bf16: most words keep their bytes, as at a realistic lr
    trainer = make_trainer(devices, transport, HFEngine(dtype=dtype), 3, [check])
    with trainer:
        trainer.fit(make_module(tiny_config, bpe_tokenizer, lr), prompt_dataloader(gsm8k_prompts, batch_size=2))
        assert trainer.sync.transport.name == transport
    assert len(check.metrics) == 3
    for metrics in check.metrics:
        assert set(DELTA_METRICS) <= metrics.keys()
        assert metrics["sync/checksum_mismatches"] == 0
        assert 0 <= metrics["sync/changed_share"] <= 1 and 0 <= metrics["sync/wire_share"] <= 1.01
        assert metrics["sync/delta_buckets"] + metrics["sync/full_buckets"] == metrics["sync/buckets"]
    first = syncs[0][1]
    assert syncs[0][0] == 0 and first["delta_buckets"] == 0 and first["full_buckets"] == first["buckets"] > 2
    if dtype == torch.bfloat16:  # the delta path was taken, and sent less than a full sync
        assert sum(m["sync/delta_buckets"] for m in check.metrics) > 0
        assert min(m["sync/wire_share"] for m in check.metrics) < 1


class CorruptingEngine(HFEngine):
    """The ``hf`` engine; after its ``corrupt_at``-th weight update session one element of its final
    norm drifts (as a faulty load or a stray write would), in the one replica that creates ``claim``."""

    def __init__(self, dtype: torch.dtype, corrupt_at: int, claim: str) -> None:
        super().__init__(dtype=dtype)
        self.corrupt_at, self.claim, self.sessions = corrupt_at, claim, 0

    def finish_weight_update(self) -> None:
        super().finish_weight_update()
        self.sessions += 1
        if self.sessions == self.corrupt_at:
            try:
                os.close(os.open(self.claim, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return  # another replica drifts
            with torch.no_grad():
                self.model.model.norm.weight[0] += 1


@pytest.mark.parametrize("devices, transport, replicas", [(1, "shared_memory", 1), (1, "broadcast", 2),
                                                          (2, "object_store", 2)])
def test_a_checksum_mismatch_is_counted_and_repaired(devices, transport, replicas, tiny_config, bpe_tokenizer,
                                                     gsm8k_prompts, ray_session, syncs, tmp_path):
    """Sessions: 1 the initial sync, 2 step 1's (then one replica drifts), 3 step 2's: its checksums
    catch the drift in the one bucket that holds the norm, that bucket is sent again in full to that
    replica, and every replica equals the policy again."""
    dtype = torch.bfloat16
    check = MatchesFullSync(dtype, unchecked=(1,))  # the drift, until step 2's sync
    delta = DeltaSync(max_share=1.0)  # every bucket with a base travels as a delta
    engine = CorruptingEngine(dtype, corrupt_at=2, claim=str(tmp_path / "drifted"))
    trainer = make_trainer(devices, transport, engine, 3, [check], delta=delta, replicas=replicas)
    with trainer:
        trainer.fit(make_module(tiny_config, bpe_tokenizer, 2e-6), prompt_dataloader(gsm8k_prompts, batch_size=2))
        assert trainer.rollout.group.remote.engine_weight_version() == [3] * replicas
    assert [m["sync/checksum_mismatches"] for m in check.metrics] == [0, 1, 0]


def test_a_woken_engine_and_a_new_engine_get_full_buckets_first(tiny_config, bpe_tokenizer, gsm8k_prompts,
                                                                ray_session, syncs):
    dtype = torch.bfloat16
    trainer = make_trainer(1, "shared_memory", DiscardingHFEngine(dtype=dtype), 2, [MatchesFullSync(dtype)])
    with trainer:
        trainer.fit(make_module(tiny_config, bpe_tokenizer, 2e-6), prompt_dataloader(gsm8k_prompts, batch_size=2))
        engine = trainer.engine
        engine.sleep(2)
        engine.wake_up()
        assert engine.weights_discarded
        stats = trainer.sync.push(10, mode="wait")  # nothing changed since the last sync, but it is gone
        assert stats["sync/buckets"] == syncs[0][1]["buckets"] and stats["sync/delta_buckets"] == 0
        assert_replicas_hold_the_policy(trainer, dtype, "after the woken engine's sync")

        trainer.rollout.engine = HFEngine(dtype=dtype)
        fresh = trainer.rollout.connect(trainer.strategy, bpe_tokenizer)  # replaces the replicas
        stats = fresh.push(11, mode="wait")
        assert stats["sync/buckets"] == syncs[0][1]["buckets"] and stats["sync/delta_buckets"] == 0
        assert_replicas_hold_the_policy(trainer, dtype, "after the new engine's sync")
        assert trainer.rollout.group.remote.engine_weight_version() == [11]


def test_a_resumed_run_syncs_in_full_first(tiny_config, bpe_tokenizer, gsm8k_prompts, ray_session, syncs, tmp_path):
    dtype = torch.bfloat16
    with make_trainer(1, "object_store", HFEngine(dtype=dtype), 2, default_root_dir=tmp_path) as trainer:
        trainer.fit(make_module(tiny_config, bpe_tokenizer, 2e-6), prompt_dataloader(gsm8k_prompts, batch_size=2))
        trainer.save_checkpoint(tmp_path / "step2.ckpt")
    syncs.clear()
    check = MatchesFullSync(dtype)
    with make_trainer(1, "object_store", HFEngine(dtype=dtype), 3, [check], default_root_dir=tmp_path) as trainer:
        trainer.fit(make_module(tiny_config, bpe_tokenizer, 2e-6), prompt_dataloader(gsm8k_prompts, batch_size=2),
                    ckpt_path=tmp_path / "step2.ckpt")
    assert [version for version, _ in syncs] == [0, 2, 3]  # set up, restored, step 3
    for version, stats in syncs[:2]:
        assert stats["delta_buckets"] == 0 and stats["full_buckets"] == stats["buckets"] > 0, (version, stats)
    assert len(check.metrics) == 1


class NativeBroadcastEngine(HFEngine):
    """An engine that receives broadcast buckets itself (as SGLang's schedulers)."""

    native_weight_broadcast = True


def test_an_engine_that_receives_broadcasts_itself_is_refused_with_delta(bpe_tokenizer):
    rollout = Rollout(NativeBroadcastEngine(), placement="split", delta=True)
    with pytest.raises(ValueError, match=r"NativeBroadcastEngine receives .*delta=False"):
        rollout.connect(FSDP2Strategy(devices=1), bpe_tokenizer)
