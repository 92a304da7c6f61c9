"""The check the real-vLLM tests read vLLM's parameters with (no vLLM needed here): values, in the
dtype vLLM keeps, which the CPU build widens by CPU (a fused QKV bias in fp32 in a bf16 engine)."""

from __future__ import annotations

import torch

from rltrainer.testing.vllm_probe import holds_exactly


def test_a_parameter_kept_in_fp32_holds_the_bf16_values_it_was_given():
    expected = torch.randn(6, 4).to(torch.bfloat16)
    assert holds_exactly(expected.clone(), expected)  # kept in the engine's dtype (where the CPU build does)
    assert holds_exactly(expected.float(), expected)  # kept in fp32 (where it widens), exact
    assert holds_exactly(torch.cat([expected.float(), torch.zeros(2, 4)]), expected)  # a padded vocabulary
    moved = expected.float()
    moved[2, 1] += 1e-3  # a value a bf16 sync cannot have loaded
    assert not holds_exactly(moved, expected)


def test_a_narrower_or_integer_or_reshaped_parameter_does_not_hold_it():
    expected = torch.randn(6, 4).to(torch.bfloat16)
    assert not holds_exactly(expected.to(torch.float16), expected)  # fp16 has not bf16's range
    assert not holds_exactly(expected.view(torch.int16), expected)  # the same bytes, not the same values
    assert not holds_exactly(expected.float().view(4, 6), expected)
    assert not holds_exactly(expected.float()[:5], expected)
