"""The run plan's mini-batch check: its advice is computed, and the values it advises pass."""

from __future__ import annotations

import itertools
import re

import pytest

from rltrainer.plan import check_plan, prompts_for


def passes(B: int, G: int, mini: int, epochs: int = 1) -> bool:
    try:
        check_plan(B, G, mini, epochs)
        return True
    except ValueError:
        return False


def test_the_issues_case_advises_32_prompts_not_11():
    """10 prompts x 3 samples with mini-batches of 32: 11 prompts (33 rows) do not split into 32s either."""
    with pytest.raises(ValueError, match="larger than the batch: 10 prompts x 3 samples = 30 rows") as info:
        check_plan(10, 3, 32, 1)
    assert "batch_size to 32 prompts" in str(info.value) and "11" not in str(info.value)
    assert passes(32, 3, 32) and not passes(31, 3, 32) and not passes(11, 3, 32)


@pytest.mark.parametrize("B, G, mini, epochs", [
    (B, G, mini, epochs) for B, G, mini, epochs in itertools.product(
        (1, 3, 7, 10, 12, 32), (1, 2, 3, 5, 8, 16), (1, 4, 6, 9, 32, 48, 100), (1, 3))
    if not passes(B, G, mini, epochs)])
def test_advised_values_pass_and_the_ones_just_below_fail(B, G, mini, epochs):
    with pytest.raises(ValueError) as info:
        check_plan(B, G, mini, epochs)
    message = str(info.value)
    prompts = int(re.search(r"batch_size to (\d+) prompts", message)[1])
    assert prompts > B and passes(prompts, G, mini, epochs), message
    assert all(not passes(b, G, mini, epochs) for b in range(B, prompts)), message  # it is the next one
    if "does not divide" in message:
        below, above = map(int, re.search(r"Use mini_batch_size=(\d+) or (\d+)", message).groups())
        assert below < mini < above and passes(B, G, below, epochs) and passes(B, G, above, epochs), message
        assert all(not passes(B, G, m, epochs) for m in range(below + 1, above)), message
    else:
        assert "larger than the batch" in message and passes(B, G, B * G, epochs)


def test_prompts_for():
    assert prompts_for(32, 3, 11) == 32 and prompts_for(32, 8, 1) == 4 and prompts_for(32, 8, 5) == 8
    assert prompts_for(6, 4, 1) == 3 and prompts_for(1, 7, 3) == 3
