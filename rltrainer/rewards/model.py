"""A learned reward: a transformers sequence-classification model (one label) as a reward source.

Given in ``reward_funcs`` next to rule rewards (``GRPO(reward_funcs=["gsm8k", RewardModel(path)],
reward_weights=[1.0, 0.5])``), it is built in ``configure_model`` and scored on the training ranks
as the compute stage ``"reward_model"`` (batched per micro-batch, under any strategy that runs it);
``advantage_step`` then adds ``weight * rm_scores`` to the rule rewards' weighted sum. It scores the
rollout's token ids, so it must share the policy's tokenizer.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rltrainer.data.batch import RolloutBatch
from rltrainer.models import init_from_config, load_pretrained
from rltrainer.rewards import RewardManager, resolve_reward
from rltrainer.values import check_float, check_int


@dataclass(frozen=True)
class RewardModel:
    """A sequence-classification reward model, an entry of ``reward_funcs``.

    Args:
        model: hub id or local path of an ``AutoModelForSequenceClassification`` checkpoint with one
            label, a transformers ``PretrainedConfig`` (random init, ``num_labels`` set to 1), or a
            callable returning such a model.
        name: the name in metrics (``reward/<name>/mean``).
        seed: seed of a config's random init (``None``: the RNG as the models before left it).
    """

    model: Any
    name: str = "reward_model"
    seed: int | None = None

    def __post_init__(self) -> None:
        check_int("seed", self.seed, none="the RNG as the models before left it", owner="RewardModel")


def build_reward_model(spec: Any, pad_token_id: int, seed: int | None = None) -> torch.nn.Module:
    """The frozen, eval-mode sequence classifier of ``spec``. Its ``config.pad_token_id`` is set to
    the tokenizer's, which the rollouts are padded with: transformers scores each row at its
    rightmost token that is not ``pad_token_id``. Inside :func:`~rltrainer.models.deferred_init` a
    config or checkpoint is built on the meta device with its weights attached, as causal LMs are."""
    from transformers import AutoModelForSequenceClassification, PretrainedConfig

    if isinstance(spec, PretrainedConfig):
        if seed is not None:
            torch.manual_seed(seed)
        config = copy.deepcopy(spec)
        config.num_labels, config.use_cache, config.pad_token_id = 1, False, pad_token_id
        model = init_from_config(config, auto_class=AutoModelForSequenceClassification)
    elif isinstance(spec, str):
        model = load_pretrained(spec, AutoModelForSequenceClassification)
    elif callable(spec):
        model = spec()
    else:
        raise TypeError(f"RewardModel(model=...) must be a hub id or path (str), a transformers PretrainedConfig, "
                        f"or a callable returning a model; got {type(spec).__name__}")
    labels = getattr(model.config, "num_labels", None)
    if labels != 1:
        raise ValueError(f"A reward model must have one output (num_labels=1); {type(model).__name__} has "
                         f"num_labels={labels}. Use a sequence-classification reward model with one label.")
    model.config.pad_token_id = pad_token_id
    model.requires_grad_(False)
    return model.eval()


def sequence_scores(reward_model: torch.nn.Module, batch: RolloutBatch) -> torch.Tensor:
    """``rm_scores [n]``: the reward model's score of each row's prompt + response (``input_ids
    [n, P+T]``), taken by transformers at the last token that is not padding."""
    out = reward_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"], use_cache=False)
    if out.logits.dim() == 2:  # transformers' sequence classifier: already pooled, [n, 1]
        return out.logits[:, 0].float()  # [n]
    # a per-token head (the megatron strategy runs the classifier as a critic-style trunk): pool as
    # transformers does (modeling_layers.py, GenericForSequenceClassification), at the rightmost token
    # that is not pad_token_id
    ids = batch["input_ids"]  # [n, P+T]
    positions = torch.arange(ids.shape[1], device=ids.device)
    last = (positions * (ids != reward_model.config.pad_token_id)).argmax(-1)  # [n]
    return out.logits[torch.arange(len(ids), device=ids.device), last, 0].float()  # [n]


#: An entry of ``reward_funcs``: a registered name, a reward function or a :class:`RewardModel`.
RewardSpec = str | Callable[..., list[float]] | RewardModel  # str first: a config file's name stays a name


def split_rewards(reward_funcs: RewardSpec | Sequence[RewardSpec] | None, weights: Sequence[float] | None,
                  **options: Any) -> tuple[RewardManager | None, RewardModel | None, float]:
    """The rule rewards (a :class:`RewardManager` with ``options``, or ``None`` if there are none), the
    reward model among ``reward_funcs`` (at most one) and its weight; ``weights`` has one entry per element."""
    entries = [] if reward_funcs is None else (
        list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs])
    weights = [1.0] * len(entries) if weights is None else [
        check_float(f"reward_weights[{i}]", w, meaning="a reward's weight") for i, w in enumerate(weights)]
    if len(weights) != len(entries):
        raise ValueError(f"Got {len(weights)} reward_weights for {len(entries)} reward_funcs; pass one weight per "
                         "entry (reward models included), or reward_weights=None for all 1.0.")
    models = [(e, w) for e, w in zip(entries, weights) if isinstance(e, RewardModel)]
    if len(models) > 1:
        raise ValueError(f"reward_funcs holds {len(models)} RewardModel entries; one reward model is supported "
                         "(its stage 'reward_model'). Keep one, or combine them in a model of your own.")
    rules = [(resolve_reward(e), w) for e, w in zip(entries, weights) if not isinstance(e, RewardModel)]
    manager = RewardManager([f for f, _ in rules], [w for _, w in rules], **options) if rules else None
    return manager, (models[0][0] if models else None), (models[0][1] if models else 0.0)
