"""Tinker's losses (rltrainer.own_loop.losses) on tiny tensors, against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rltrainer.own_loop.losses import loss_settings, token_losses


def test_gspo_clips_the_sequence_ratio_and_gives_each_token_its_own_gradient():
    # one row of 4 tokens; the mask leaves out token 0 (a prompt token, sampler log-prob 0) and token 3
    lp = torch.tensor([[-1.0, -1.7, -0.4, -2.0]], requires_grad=True)
    inputs = {"logprobs": torch.tensor([[0.0, -1.8, -0.7, -0.5]]),
              "advantages": torch.tensor([[0.0, 2.0, -1.0, 0.0]]),
              "sequence_ratio_mask": torch.tensor([[0.0, 1.0, 1.0, 0.0]])}
    per_token = token_losses("gspo", lp, inputs, loss_settings("gspo", None))
    # log-ratios of the masked tokens: 0.1 and 0.3, mean 0.2, so s = e^0.2 = 1.2214 (> 1.2):
    # token 1 (A = 2): min(s * 2, 1.2 * 2) = 2.4, clipped, so no gradient;
    # token 2 (A = -1): min(-s, -1.2) = -s, so loss s with gradient s (the token's own log-prob);
    # tokens 0 and 3 (A = 0): 0.
    s = math.exp(0.2)
    torch.testing.assert_close(per_token, torch.tensor([[0.0, -2.4, s, 0.0]]))
    per_token.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.0, s, 0.0]]))


def test_gspo_takes_its_clip_thresholds_and_needs_the_mask():
    lp = torch.tensor([[-1.0, -1.0]])
    inputs = {"logprobs": torch.tensor([[-1.5, -1.5]]), "advantages": torch.tensor([[1.0, 1.0]]),
              "sequence_ratio_mask": torch.tensor([[1.0, 1.0]])}
    wide = token_losses("gspo", lp, inputs, loss_settings("gspo", {"clip_high_threshold": 2.0}))
    torch.testing.assert_close(wide, -torch.full((1, 2), math.exp(0.5)))  # s = e^0.5 = 1.65 < 2: not clipped
    empty = token_losses("gspo", lp, {**inputs, "sequence_ratio_mask": torch.zeros(1, 2)}, loss_settings("gspo", None))
    torch.testing.assert_close(empty, -torch.ones(1, 2))  # no token marked: s = 1
    with pytest.raises(ValueError, match="'gspo' needs loss_fn_inputs .*'sequence_ratio_mask'.*missing"):
        token_losses("gspo", lp, {k: v for k, v in inputs.items() if k != "sequence_ratio_mask"}, {})
