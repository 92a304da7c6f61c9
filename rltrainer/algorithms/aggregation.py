"""Loss aggregation: turn a per-token loss matrix ``[n, T]`` into a scalar.

Every mode divides by a count of the *whole mini-batch* (``global_tokens`` response tokens,
``global_rows`` sequences), never by the micro-batch's own, so summing the results of all
micro-batches on all ranks gives the same value (and gradient) as one pass over the whole
mini-batch. When the global counts are not given, the local ones are used.
"""

from __future__ import annotations

import torch

from rltrainer.registry import Registry

AGGREGATIONS: Registry = Registry("loss aggregation mode")


@AGGREGATIONS.register("token-mean")
def token_mean(loss: torch.Tensor, mask: torch.Tensor, global_tokens: float, global_rows: float,
               max_response_length: int | None = None) -> torch.Tensor:
    """Sum over all tokens / number of response tokens in the mini-batch (DAPO; TRL ``dapo``)."""
    return (loss * mask).sum() / global_tokens


@AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor, global_tokens: float, global_rows: float,
                        max_response_length: int | None = None) -> torch.Tensor:
    """Mean over each sequence's tokens, then mean over sequences (original GRPO; TRL ``grpo``)."""
    per_row = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_row.sum() / global_rows


@AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(loss: torch.Tensor, mask: torch.Tensor, global_tokens: float, global_rows: float,
                       max_response_length: int | None = None) -> torch.Tensor:
    """Sum over each sequence's tokens, then mean over sequences."""
    return (loss * mask).sum() / global_rows


@AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(loss: torch.Tensor, mask: torch.Tensor, global_tokens: float, global_rows: float,
                            max_response_length: int | None = None) -> torch.Tensor:
    """Sum over tokens / (sequences x a constant: the generation budget) (Dr. GRPO; TRL ``dr_grpo``).

    The constant is ``max_response_length`` (``max_new_tokens``), not the padded width of the
    batch, so it does not change with micro-batching.
    """
    if not max_response_length:
        raise ValueError("seq-mean-token-sum-norm needs max_response_length (the max_new_tokens budget)")
    return (loss * mask).sum() / (global_rows * max_response_length)


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str, global_tokens: float | None = None,
              global_rows: float | None = None, max_response_length: int | None = None) -> torch.Tensor:
    """Aggregate ``loss [n, T]`` over ``mask [n, T]`` with the named mode (see :data:`AGGREGATIONS`)."""
    fn = AGGREGATIONS.get(mode)
    mask = mask.to(loss.dtype)
    if global_tokens is None:
        global_tokens = mask.sum().clamp(min=1).item()
    if global_rows is None:
        global_rows = float(mask.shape[0])
    return fn(loss, mask, global_tokens=global_tokens, global_rows=global_rows,
              max_response_length=max_response_length)


def masked_sum_over(values: torch.Tensor, mask: torch.Tensor, global_tokens: float) -> torch.Tensor:
    """``sum(values * mask) / global_tokens``: a token-mean metric's share from one micro-batch."""
    return (values * mask).sum() / global_tokens
