"""On-policy distillation (Agarwal et al. 2024, GKD; Thinking Machines' "on-policy distillation"):
a frozen teacher scores the policy's own samples, and each token's advantage is lowered by
``coef`` times the per-token reverse-KL estimate ``log pi_old - log pi_teacher`` (k1 on the
sampled token). Added after any advantage estimator; with no reward at all, it is the whole signal.

The teacher is any transformers causal LM that shares the policy's tokenizer: the rollouts' token
ids are scored as they are, so a teacher with another vocabulary would score other words.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from rltrainer.algorithms.part import BaseModels, Part, Setup, Step
from rltrainer.data.batch import RolloutBatch
from rltrainer.models import build_causal_lm, freeze, response_log_probs
from rltrainer.values import check_float, check_int


@dataclass(frozen=True)
class Teacher(Part):
    """A teacher for on-policy distillation (``GRPO(teacher=Teacher(...))``): the distillation part.

    Args:
        model: hub id or local path, a transformers ``PretrainedConfig`` (random init) or a
            callable returning a causal LM; built frozen in ``configure_model``, like the
            reference model, so every strategy places (and shards) it the same way.
        coef: ``lambda`` in ``A - lambda * (log pi_old - log pi_teacher)``, per response token.
        tokenizer: the teacher's own tokenizer, optional. Given, its vocabulary must equal the
            policy tokenizer's (checked at construction), and the models' embedding sizes may then
            differ (padded vocabularies, e.g. Qwen2.5-7B's 152064 rows vs 1.5B's 151936). Not
            given, the teacher's ``config.vocab_size`` must equal the policy's.
        seed: seed of a config's random init (``None``: the RNG as the policy's init left it, so a
            teacher with the policy's config is another random model; the policy's ``model_seed``
            gives a copy of the policy).

    Stages ``old_log_prob`` and ``teacher`` (``teacher_log_probs [N, T]``, at the sampling
    temperature, as the policy's); ``advantage_step`` subtracts ``coef * (old_log_probs -
    teacher_log_probs)`` from the estimator's advantages, per token, and logs
    ``distill/reverse_kl/mean``.
    """

    model: Any
    coef: float = 1.0
    tokenizer: Any = None
    seed: int | None = None

    def __post_init__(self) -> None:
        check_float("coef", self.coef, at_least=0, owner="Teacher",
                    meaning="the distillation weight: lambda in A - lambda * (log pi - log pi_teacher)")
        check_int("seed", self.seed, none="the RNG as the policy's init left it", owner="Teacher")

    kind: ClassVar[str] = "teacher"
    reads: ClassVar[tuple[str, ...]] = ("old_log_probs", "teacher_log_probs")
    adds: ClassVar[tuple[str, ...]] = ("teacher_log_probs",)

    def stages(self, off_policy: bool) -> tuple[str, ...]:
        return ("old_log_prob", "teacher")

    def check(self, setup: Setup) -> None:
        check_same_vocabulary(setup.tokenizer, self.tokenizer)

    def build_models(self, base: BaseModels) -> dict[str, torch.nn.Module]:
        """The frozen teacher, built like the reference model, so every strategy places it alike."""
        teacher = freeze(build_causal_lm(self.model, seed=self.seed))
        check_teacher_vocab(base.policy, teacher, base.tokenizer, self.tokenizer is not None)
        return {"teacher": teacher}

    def compute(self, models: Mapping[str, torch.nn.Module], micro_batch: RolloutBatch, stage: str
                ) -> dict[str, torch.Tensor] | None:
        if stage != "teacher":
            return None
        temperature = micro_batch.temperature or 1.0
        return {"teacher_log_probs": response_log_probs(models["teacher"], micro_batch, temperature)[0]}

    def adjust_advantages(self, batch: RolloutBatch, advantages: torch.Tensor, step: Step) -> torch.Tensor:
        """``advantages [N, T] - coef * (old_log_probs - teacher_log_probs)``."""
        missing = [f for f in ("old_log_probs", "teacher_log_probs") if f not in batch]
        if missing:
            raise KeyError(f"Distillation needs {missing} [N, T] from the compute stages 'old_log_prob' and 'teacher' "
                           f"(compute_stages adds them with a teacher); the batch has {batch.keys()}")
        term, reverse_kl = distillation_term(batch["old_log_probs"], batch["teacher_log_probs"],
                                             batch["response_mask"], self.coef)
        step.log("distill/reverse_kl/mean", reverse_kl)
        return advantages - term  # [N, T]


def check_same_vocabulary(tokenizer: Any, teacher_tokenizer: Any) -> None:
    """Raise unless the two tokenizers map the same strings to the same ids."""
    if teacher_tokenizer is None or teacher_tokenizer is tokenizer:
        return
    ours, theirs = tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if ours != theirs:
        differ = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda kv: kv[1])[:3]
        raise ValueError(
            f"The teacher's tokenizer differs from the policy's ({len(theirs)} vs {len(ours)} entries; e.g. "
            f"{differ}). Distillation scores the policy's token ids with the teacher, so both must share one "
            "tokenizer: choose a teacher of the policy's family.")


def check_teacher_vocab(policy: torch.nn.Module, teacher: torch.nn.Module, tokenizer: Any,
                        verified_tokenizer: bool) -> None:
    """Raise if the teacher cannot score the policy's token ids: its embedding is smaller than the
    tokenizer, or (unless the teacher's tokenizer was verified equal) its ``vocab_size`` differs."""
    mine = getattr(getattr(policy, "config", None), "vocab_size", None)
    theirs = getattr(getattr(teacher, "config", None), "vocab_size", None)
    if theirs is None or mine is None:
        return
    if theirs < len(tokenizer):
        raise ValueError(f"The teacher's vocab_size is {theirs}, smaller than the tokenizer's {len(tokenizer)} "
                         "entries: it cannot score every token the policy samples. Use a teacher that shares the "
                         "policy's tokenizer.")
    if theirs != mine and not verified_tokenizer:
        raise ValueError(
            f"The teacher's vocab_size is {theirs}, the policy's {mine}: they may not share a tokenizer, which "
            "distillation needs (the policy's token ids are scored as they are). Use a teacher of the policy's "
            "family, or, if only the embedding padding differs, pass Teacher(..., tokenizer=teacher_tokenizer) "
            "so that the vocabularies are compared.")


def distillation_term(old_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor,
                      response_mask: torch.Tensor, coef: float) -> tuple[torch.Tensor, float]:
    """``coef * (log pi_old - log pi_teacher)`` per response token (``[N, T]``, 0 on padding), to
    subtract from the advantages, and the token mean of the reverse-KL estimate (the metric)."""
    reverse_kl = (old_log_probs - teacher_log_probs) * response_mask  # [N, T]
    tokens = response_mask.sum()
    mean = (reverse_kl.sum() / tokens).item() if tokens > 0 else 0.0
    return coef * reverse_kl, mean
