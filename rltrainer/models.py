"""Build transformers causal LMs, and the teacher-forced forward over response tokens."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from rltrainer.data.batch import RolloutBatch

ModelSpec = str | Any | Callable[[], torch.nn.Module]


def build_causal_lm(spec: ModelSpec, dtype: torch.dtype | None = None, seed: int | None = None) -> torch.nn.Module:
    """A causal LM from a hub id or local path, a transformers ``PretrainedConfig`` (random
    init; ``seed`` makes it reproducible), or a zero-argument callable returning a model."""
    from transformers import AutoModelForCausalLM, PretrainedConfig

    if isinstance(spec, PretrainedConfig):
        if seed is not None:
            torch.manual_seed(seed)
        config = copy.deepcopy(spec)
        config.use_cache = False
        model = AutoModelForCausalLM.from_config(config, dtype=dtype) if dtype else AutoModelForCausalLM.from_config(config)
    elif isinstance(spec, str):
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype) if dtype else AutoModelForCausalLM.from_pretrained(spec)
    elif callable(spec):
        model = spec()
    else:
        raise TypeError(
            f"model must be a hub id or path (str), a transformers PretrainedConfig, or a callable "
            f"returning a model; got {type(spec).__name__}"
        )
    return model


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy with gradients off and in eval mode (a reference model)."""
    ref = copy.deepcopy(model)
    ref.requires_grad_(False)
    return ref.eval()


def response_log_probs(
    model: torch.nn.Module,
    batch: RolloutBatch,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropies) of ``batch["responses"]`` under ``model``.

    Runs ``model`` on ``input_ids [n, P+T]`` and keeps only the ``T`` positions that predict the
    response (``logits_to_keep``), so the LM head never sees the prompt. Logits are divided by
    ``temperature`` to match the sampling distribution of the engine. Returns ``log_probs [n, T]``
    and ``entropy [n, T]`` (or ``None``), both float32. The entropy carries gradients only with
    ``entropy_grad`` (a softmax over the vocabulary kept for backward is costly).
    """
    responses = batch["responses"]  # [n, T]
    T = responses.shape[1]
    logits = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        use_cache=False,
        logits_to_keep=T + 1,
    ).logits[:, :-1]  # [n, T, V]: position P-1+t predicts response token t
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    log_softmax = logits.log_softmax(-1)  # one fused pass; faster than logsumexp on CPU
    log_probs = log_softmax.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        entropy = entropy_from_log_softmax(log_softmax if entropy_grad else log_softmax.detach())
    return log_probs, entropy


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[..., tokens]``."""
    return logits.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_from_log_softmax(log_softmax: torch.Tensor) -> torch.Tensor:
    """Entropy ``-sum(p * log p)`` over the last dimension, from ``log_softmax(logits)``."""
    return -(log_softmax.exp() * log_softmax).sum(-1)
