"""Each part declares the forward passes it needs and the fields it reads and adds; the module's
stages and checks come from these declarations."""

from __future__ import annotations

import pytest
import torch

from rltrainer.algorithms.distill import Teacher
from rltrainer.algorithms.part import STAGE_FIELDS, Part, Step, Update
from rltrainer.algorithms.parts import (Advantage, Critic, CriticAdvantage, KLPenalty, PolicyLoss, RolloutCorrection)
from rltrainer.data.batch import RolloutBatch


@pytest.mark.parametrize("part, off_policy, stages", [
    (PolicyLoss(), False, ()),
    (PolicyLoss("clip_cov"), False, ("old_log_prob",)),  # a batch-level selection needs the old log-probs
    (KLPenalty(), False, ()),
    (KLPenalty(kl_coef=0.1), False, ("ref",)),
    (Advantage(), False, ()),
    (Advantage("reinforce_plus_plus", {"kl_in_reward_coef": 0.1}), False, ("old_log_prob", "ref")),
    (CriticAdvantage(), False, ()),  # GAE reads the values the critic's own stage adds
    (RolloutCorrection("token_tis"), False, ()),  # weights only: applied inside the update
    (RolloutCorrection("token_rs"), False, ("old_log_prob",)),  # rejects tokens: before the advantages
    (RolloutCorrection(), True, ()),
    (Critic(), False, ("values",)),
    (Teacher("unused"), False, ("old_log_prob", "teacher")),
])
def test_parts_declare_their_stages(part: Part, off_policy: bool, stages: tuple[str, ...]) -> None:
    assert part.stages(off_policy) == stages
    assert set(stages) <= set(STAGE_FIELDS)


def test_parts_declare_the_fields_they_read_and_add() -> None:
    assert "values" in CriticAdvantage().fields_read() and "values" not in Advantage().fields_read()
    assert "reward_baselines" in Advantage("remax").fields_read()
    assert Critic.adds == ("values",) and Advantage.adds == ("advantages", "returns")
    assert "rollout_is_weights" in RolloutCorrection.adds and "rollout_is_weights" in PolicyLoss.reads


def test_settings_are_checked_where_they_are_declared() -> None:
    with pytest.raises(ValueError, match="clip_ratio_c must be a number > 1"):
        PolicyLoss(clip_ratio_c=0.5)
    with pytest.raises(ValueError, match="Unknown KL estimator 'k9'"):
        KLPenalty(kl_estimator="k9")
    with pytest.raises(ValueError, match="rollout_correction_kwargs=.* given without rollout_correction"):
        RolloutCorrection(rollout_correction_kwargs={"threshold": 2.0})
    with pytest.raises(ValueError, match="lam=0.5 does not apply to advantage estimator 'grpo'"):
        CriticAdvantage("grpo", lam=0.5)


def test_a_loss_term_adds_to_what_the_parts_before_it_added() -> None:
    mask = torch.ones(2, 3)
    batch = RolloutBatch({"response_mask": mask, "ref_log_probs": torch.zeros(2, 3)},
                         global_tokens=6.0, global_rows=2.0)
    log_probs = torch.full((2, 3), -0.5)
    u = Update(batch, {}, log_probs, torch.zeros(2, 3), log_probs, "token-mean",
               {"global_tokens": 6.0, "global_rows": 2.0, "max_response_length": 3}, loss=torch.tensor(1.0))
    KLPenalty(kl_coef=0.5, kl_estimator="k1").update(u)
    torch.testing.assert_close(u.loss, torch.tensor(1.0 - 0.25))  # 1 + 0.5 * mean(-0.5 - 0)
    assert u.metrics["actor/kl_loss"] == pytest.approx(-0.5)


def test_the_correction_logs_the_mismatch_before_the_advantages() -> None:
    logged: dict[str, float] = {}
    old = torch.full((2, 3), -1.0)
    batch = RolloutBatch({"response_mask": torch.ones(2, 3), "old_log_probs": old, "rollout_log_probs": old - 0.1})
    out = RolloutCorrection("token_tis").before_advantages(batch, Step(logged.__setitem__, off_policy=False))
    assert "rollout_is_weights" in out and logged["rollout_corr/kl"] == pytest.approx(-0.1)
