"""The step alone (issue 45, point 3): :func:`rltrainer.loop.training_step` runs a module's step
hooks with a fake strategy, a fake weight sync and no Trainer at all; everything the step and the
module read comes from the :class:`~rltrainer.loop.FitContext` and the module's
:class:`~rltrainer.module.Attachment`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rltrainer.data.batch import RolloutBatch
from rltrainer.loop import FitContext, training_step
from rltrainer.module import Attachment, RLModule, StepMetrics

G, T = 2, 3  # samples per prompt, response length


class Reinforce(RLModule):
    """Scores = response lengths; advantages = score minus the group mean. Records its hook calls."""

    def __init__(self, calls: list[str]) -> None:
        super().__init__()
        self.calls = calls

    def reward_step(self, batch: RolloutBatch) -> RolloutBatch:
        self.calls.append("reward_step")
        batch["scores"] = batch["response_mask"].sum(-1).float()  # [N]
        self.log("test/reward_rows", len(batch))
        return batch

    def advantage_step(self, batch: RolloutBatch) -> RolloutBatch:
        self.calls.append("advantage_step")
        scores = batch["scores"].view(-1, G)  # [B, G]
        advantage = (scores - scores.mean(-1, keepdim=True)).view(-1, 1)  # [N, 1]
        batch["advantages"] = advantage * batch["response_mask"]  # [N, T]
        return batch

    def configure_model(self) -> None: ...
    def configure_optimizers(self) -> None: ...
    def policy_step(self, micro_batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, float]]: ...


class FakeStrategy:
    """The compute side: forward passes and optimizer steps, recorded (no model, no process)."""

    def __init__(self, calls: list[str]) -> None:
        self.calls, self.mini_batches = calls, []

    def compute(self, batch: RolloutBatch, stage: str) -> RolloutBatch:
        self.calls.append(f"compute:{stage}")
        return RolloutBatch({"old_log_probs": torch.zeros(len(batch), T)})

    def train_step(self, mini_batch: RolloutBatch) -> dict[str, float]:
        self.calls.append("train_step")
        self.mini_batches.append(mini_batch)
        return {"actor/grad_norm": 1.0, "actor/pg_loss": float(mini_batch["advantages"].sum())}


class FakeSync:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def push(self, version: int) -> dict[str, float]:
        self.calls.append(f"push:{version}")
        return {"sync/tensors": 0.0}


def rows(n: int = 4) -> RolloutBatch:
    """``n`` generated rows as a pipeline hands them over: tagged, with what the rollout logged."""
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]])[:n]  # [N, T]
    batch = RolloutBatch({"responses": torch.ones(n, T, dtype=torch.long), "response_mask": mask,
                          "attention_mask": torch.cat([torch.ones(n, 2, dtype=torch.long), mask], 1),
                          "policy_version": torch.full((n,), 7)},
                         non_tensors={"uid": ["a", "a", "b", "b"][:n]}, logged={"timing_s/gen": 0.5})
    return batch


def test_training_step_runs_with_fakes_and_no_trainer() -> None:
    calls: list[str] = []
    module = Reinforce(calls)
    module.mini_batch_size = 2
    metrics = StepMetrics()
    module.attach(Attachment(off_policy=False, vocab_size=16, metrics=metrics))
    watchdog = SimpleNamespace(call=lambda name, fn, *args: fn(*args))
    pushed_after: list[int] = []
    fit = FitContext(module, FakeStrategy(calls), engine=None, sync=FakeSync(calls), watchdog=watchdog, seed=0,
                     step=7, metrics=metrics)
    fit.before_push = pushed_after.append  # what a pipeline's run sets

    out = training_step(fit, rows())

    assert calls == ["reward_step", "compute:old_log_prob", "advantage_step", "train_step", "train_step", "push:8"]
    assert pushed_after == [8]  # the run readied its engines for version step + 1
    assert out is metrics.current  # the step's metrics: what the module logged, the rollout carried, the step added
    assert out["test/reward_rows"] == 4 and out["timing_s/gen"] == 0.5 and out["sync/tensors"] == 0.0
    assert out["training/optimizer_steps"] == 2.0 and out["pipeline/staleness_max"] == 0.0
    assert {"timing_s/reward", "timing_s/old_log_prob", "timing_s/adv", "timing_s/update_actor"} <= set(out)
    for mini_batch in fit.strategy.mini_batches:  # the counts as typed fields, per (shuffled) mini-batch
        assert mini_batch.global_tokens == float(mini_batch["response_mask"].sum()) and mini_batch.global_rows == 2.0
    assert sum(mb.global_tokens for mb in fit.strategy.mini_batches) == 9.0
    assert module.prompt_vocab_size() == 16  # handed over, not asked of a Trainer
    with pytest.raises(RuntimeError, match="not attached to a Trainer"):
        module.trainer


def test_log_writes_to_the_one_sink_a_thread_collects_its_own() -> None:
    """``log`` writes to the attached :class:`StepMetrics`; inside ``collect`` (a pipeline's rollout
    thread) to that block's dict, which travels with the batch."""
    module = Reinforce([])
    module.log("a", 1)  # no Trainer: the module's own sink
    assert module.logged_metrics == {"a": 1.0}
    sink = StepMetrics()
    module.attach(Attachment(metrics=sink))
    with sink.collect() as logged:
        module.log("b", 2)
    module.log("c", 3)
    assert logged == {"b": 2.0} and sink.current == {"c": 3.0} and module.logged_metrics is sink.current
    assert not module.attached.off_policy and module.__getstate__()["_attached"].metrics.current == {}
