"""Loss aggregation modes by hand, and their independence of micro-batching."""

import pytest
import torch

from rltrainer.algorithms import AGGREGATIONS, aggregate

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])  # kept: 1, 2 | 4  (7 in total over 3 tokens, 2 rows)


def test_registry_has_the_four_modes() -> None:
    assert AGGREGATIONS.names() == sorted(MODES)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7.0 / 3.0),  # (1 + 2 + 4) / 3 tokens
        ("seq-mean-token-mean", (1.5 + 4.0) / 2.0),  # row means 1.5 and 4, then their mean
        ("seq-mean-token-sum", (3.0 + 4.0) / 2.0),  # row sums 3 and 4, then their mean
        ("seq-mean-token-sum-norm", 7.0 / (2.0 * 4.0)),  # sum / (rows * max_response_length=4)
    ],
)
def test_local_counts(mode: str, expected: float) -> None:
    out = aggregate(LOSS, MASK, mode, max_response_length=4)
    torch.testing.assert_close(out, torch.tensor(expected))


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7.0 / 10.0),
        ("seq-mean-token-mean", 5.5 / 5.0),
        ("seq-mean-token-sum", 7.0 / 5.0),
        ("seq-mean-token-sum-norm", 7.0 / (5.0 * 4.0)),
    ],
)
def test_global_counts(mode: str, expected: float) -> None:
    # this micro-batch is part of a mini-batch of 10 tokens and 5 rows
    out = aggregate(LOSS, MASK, mode, global_tokens=10.0, global_rows=5.0, max_response_length=4)
    torch.testing.assert_close(out, torch.tensor(expected))


def test_row_without_tokens_counts_as_zero_in_seq_mean() -> None:
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    # rows: mean 1.5, empty row 0 -> (1.5 + 0) / 2
    torch.testing.assert_close(aggregate(LOSS, mask, "seq-mean-token-mean"), torch.tensor(0.75))
    torch.testing.assert_close(aggregate(LOSS, torch.zeros(2, 3), "token-mean"), torch.tensor(0.0))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("micro", [1, 3, 8])
def test_micro_batch_sum_equals_whole_batch(mode: str, micro: int) -> None:
    gen = torch.Generator().manual_seed(1)
    loss = torch.randn(8, 5, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([5, 1, 3, 0, 2, 5, 4, 1])
    mask = (torch.arange(5) < lengths.unsqueeze(-1)).long()  # [8, 5], right-padded
    counts = {"global_tokens": float(mask.sum()), "global_rows": 8.0, "max_response_length": 6}
    whole = aggregate(loss, mask, mode, **counts)
    parts = sum(aggregate(loss[i : i + micro], mask[i : i + micro], mode, **counts) for i in range(0, 8, micro))
    torch.testing.assert_close(parts, whole, rtol=0, atol=1e-12)
    # and the whole-batch value with global counts is the one with local counts
    torch.testing.assert_close(whole, aggregate(loss, mask, mode, max_response_length=6), rtol=0, atol=1e-12)


def test_micro_batch_local_counts_would_differ() -> None:
    """Without the global counts, token-mean over micro-batches is not the whole-batch token-mean."""
    loss = torch.tensor([[1.0, 1.0], [3.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    whole = aggregate(loss, mask, "token-mean")  # 5 / 3
    # the mean of the two local token-means: (1 + 3) / 2 = 2
    local = (aggregate(loss[:1], mask[:1], "token-mean") + aggregate(loss[1:], mask[1:], "token-mean")) / 2
    torch.testing.assert_close(whole, torch.tensor(5.0 / 3.0))
    assert not torch.isclose(local, whole)


def test_sum_norm_needs_max_response_length() -> None:
    with pytest.raises(ValueError, match="max_response_length"):
        aggregate(LOSS, MASK, "seq-mean-token-sum-norm")


def test_unknown_mode_lists_names() -> None:
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        aggregate(LOSS, MASK, "sum")
