"""KL estimators against closed-form values: with r = p_ref / p,
k1 = log p - log p_ref, k2 = 0.5 * (log p - log p_ref)^2, k3 = r - log r - 1."""

import math

import pytest
import torch

from rltrainer.algorithms import KL_ESTIMATORS, kl_penalty

LN2, LN3 = math.log(2.0), math.log(3.0)
# three tokens: (p, p_ref) = (0.5, 0.25), (0.2, 0.6), (0.3, 0.3)  ->  r = 0.5, 3, 1
LOG_P = torch.log(torch.tensor([[0.5, 0.2, 0.3]]))
LOG_REF = torch.log(torch.tensor([[0.25, 0.6, 0.3]]))


def test_k1() -> None:
    # log(0.5/0.25) = ln 2; log(0.2/0.6) = -ln 3; 0
    torch.testing.assert_close(kl_penalty(LOG_P, LOG_REF, "k1"), torch.tensor([[LN2, -LN3, 0.0]]))


def test_k2() -> None:
    expected = torch.tensor([[0.5 * LN2**2, 0.5 * LN3**2, 0.0]])  # 0.240227, 0.603474, 0
    torch.testing.assert_close(kl_penalty(LOG_P, LOG_REF, "k2"), expected)


def test_k3() -> None:
    # r = 0.5: 0.5 + ln 2 - 1 = 0.193147;  r = 3: 3 - ln 3 - 1 = 0.901388;  r = 1: 0
    expected = torch.tensor([[0.5 + LN2 - 1.0, 2.0 - LN3, 0.0]])
    torch.testing.assert_close(kl_penalty(LOG_P, LOG_REF, "k3"), expected)
    torch.testing.assert_close(kl_penalty(LOG_P, LOG_REF), expected)  # k3 is the default


@pytest.mark.parametrize(("alias", "name"), [("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")])
def test_aliases(alias: str, name: str) -> None:
    assert KL_ESTIMATORS.get(alias) is KL_ESTIMATORS.get(name)
    torch.testing.assert_close(kl_penalty(LOG_P, LOG_REF, alias), kl_penalty(LOG_P, LOG_REF, name))


def test_k3_clamp() -> None:
    log_p = torch.tensor([[0.0, 0.0, -20.0, 0.0]])
    log_ref = torch.tensor([[-2.5, 2.5, 0.0, -30.0]])
    out = kl_penalty(log_p, log_ref, "k3")
    # log r = 2.5:  e^2.5 - 3.5 = 8.682494 (under the cap);  log r = -2.5: e^-2.5 + 1.5 = 1.582085
    # log r = 20:   e^20 - 21 -> capped at 10;  log r = -30 -> clamped to -20: e^-20 + 19 -> capped at 10
    expected = torch.tensor([[math.exp(-2.5) + 1.5, math.exp(2.5) - 3.5, 10.0, 10.0]])
    torch.testing.assert_close(out, expected)
    assert torch.isfinite(out).all()


def test_k2_k3_non_negative_k1_can_be_negative() -> None:
    gen = torch.Generator().manual_seed(0)
    log_p = -torch.rand(64, 16, generator=gen) * 6
    log_ref = -torch.rand(64, 16, generator=gen) * 6
    assert (kl_penalty(log_p, log_ref, "k2") >= 0).all()
    assert (kl_penalty(log_p, log_ref, "k3") >= 0).all()
    assert (kl_penalty(log_p, log_ref, "k1") < 0).any()


def test_gradient_of_k3_is_one_minus_r() -> None:
    # d/d log p of (r - log r - 1) with log r = log p_ref - log p:  -r + 1
    log_p = LOG_P.clone().requires_grad_(True)
    kl_penalty(log_p, LOG_REF, "k3").sum().backward()
    torch.testing.assert_close(log_p.grad, torch.tensor([[1.0 - 0.5, 1.0 - 3.0, 0.0]]))


def test_unknown_estimator_raises_with_names() -> None:
    with pytest.raises(ValueError, match="Unknown KL estimator 'k4'") as info:
        kl_penalty(LOG_P, LOG_REF, "k4")
    for name in ("k1", "k2", "k3", "kl", "low_var_kl", "mse"):
        assert name in str(info.value)
