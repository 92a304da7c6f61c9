"""Rollout corrections equal verl's (``verl_rollout_corr_reference.py``, vendored verbatim) to 1e-6:
weights, masks and the metrics with the same names; and the registry's errors."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from rltrainer.algorithms import ROLLOUT_CORRECTIONS, mismatch_metrics
from rltrainer.algorithms.rollout_corr import check_rollout_correction
from rltrainer.registry import Registry

_spec = importlib.util.spec_from_file_location("verl_rollout_corr_reference",
                                               Path(__file__).with_name("verl_rollout_corr_reference.py"))
verl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(verl)

N, T = 16, 24
SEEDS = [0, 1, 2]
#: how far rollout_log_probs lag old_log_probs: (std of the difference, share of outlier tokens off by
#: 20 to 40 nats, past verl's +-20 clamp): bf16-like noise, a few versions behind, and outliers
LAGS = {"realistic": (0.02, 0.0), "lagged": (0.3, 0.0), "extreme": (0.3, 0.05)}


def k1_bounds(low: float, high: float) -> str:
    """verl's ``"L_U"`` for ``*_k1`` options bounds ``pi_rollout / pi_old``: ours ``[low, high]`` on
    ``rho = pi_old / pi_rollout`` is verl's ``[1/high, 1/low]``."""
    return f"{1.0 / high!r}_{1.0 / low!r}"


#: entry, its parameters, the verl call that computes the same
CASES = [
    ("token_tis", {"threshold": 1.5}, {"rollout_is": "token", "rollout_is_threshold": 1.5}),
    ("seq_tis", {"threshold": 3.0}, {"rollout_is": "sequence", "rollout_is_threshold": 3.0}),
    ("token_rs", {"low": 0.7, "high": 1.2}, {"rollout_rs": "token_k1", "rollout_rs_threshold": k1_bounds(0.7, 1.2)}),
    ("seq_rs", {"low": 0.4, "high": 3.0}, {"rollout_rs": "seq_sum_k1", "rollout_rs_threshold": k1_bounds(0.4, 3.0)}),
    ("geo_rs", {"low": 0.98, "high": 1.01}, {"rollout_rs": "seq_mean_k1",
                                             "rollout_rs_threshold": k1_bounds(0.98, 1.01)}),
    ("token_mis", {"threshold": 1.5, "low": 0.6, "high": 1.5},
     {"rollout_is": "token", "rollout_is_threshold": 1.5, "rollout_rs": "token_k1",
      "rollout_rs_threshold": k1_bounds(0.6, 1.5)}),
    ("seq_mis", {"threshold": 2.0, "low": 0.5, "high": 2.0},
     {"rollout_is": "sequence", "rollout_is_threshold": 2.0, "rollout_rs": "seq_sum_k1",
      "rollout_rs_threshold": "0.5_2.0"}),  # verl's decoupled_seq_is_rs() preset: symmetric, same in both
    ("geo_rs_token_tis", {"threshold": 2.0, "low": 0.99, "high": 1.02},
     {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "seq_mean_k1",
      "rollout_rs_threshold": k1_bounds(0.99, 1.02)}),
    ("icepop", {}, {"rollout_is": "token", "rollout_is_threshold": 5.0, "rollout_rs": "token_k1",
                    "rollout_rs_threshold": k1_bounds(0.5, 5.0)}),
]


def log_probs(seed: int, lag: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``old, rollout, mask [N, T]``: right padding of every length (one row empty, one full), padding
    holding junk in ``old`` and 0 in ``rollout`` (as the batch has them)."""
    scale, outlier_share = lag
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    lengths[0], lengths[1] = T, 0
    mask = (torch.arange(T) < lengths.unsqueeze(-1)).long()  # [N, T]
    old = torch.log(torch.rand(N, T, generator=g).clamp(min=1e-6))  # [N, T] log-probs in (-14, 0)
    diff = scale * torch.randn(N, T, generator=g)
    outliers = torch.rand(N, T, generator=g) < outlier_share
    sign = torch.where(torch.rand(N, T, generator=g) < 0.5, -1.0, 1.0)
    diff = torch.where(outliers, sign * (20 + 20 * torch.rand(N, T, generator=g)), diff)
    return old, (old + diff) * mask, mask


def assert_metrics_equal(ours: dict[str, float], theirs: dict[str, float]) -> None:
    """Every metric of ours has verl's name (with the ``rollout_corr/`` prefix) and value."""
    for name, value in ours.items():
        assert f"rollout_corr/{name}" in theirs, f"{name} is not one of verl's metric names"
        torch.testing.assert_close(torch.tensor(float(value), dtype=torch.float64),
                                   torch.tensor(theirs[f"rollout_corr/{name}"], dtype=torch.float64),
                                   rtol=1e-6, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("lag", LAGS)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("name", "params", "verl_kwargs"), CASES, ids=[c[0] for c in CASES])
def test_equals_verl(name: str, params: dict, verl_kwargs: dict, seed: int, lag: str) -> None:
    old, rollout, mask = log_probs(seed, LAGS[lag])
    weights, new_mask, metrics = ROLLOUT_CORRECTIONS.build(name, old_log_probs=old, rollout_log_probs=rollout,
                                                           response_mask=mask, **params)
    verl_weights, verl_mask, verl_metrics = verl.compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, **{"rollout_is": None, **verl_kwargs})

    assert (weights is None) == (verl_weights is None)
    if weights is not None:
        torch.testing.assert_close(weights, verl_weights, rtol=1e-6, atol=1e-6)
        assert not weights.requires_grad and (weights[mask == 0] == 0).all()
    assert new_mask.dtype == mask.dtype
    torch.testing.assert_close(new_mask, verl_mask, rtol=0, atol=0)
    assert_metrics_equal(metrics, verl_metrics)
    expected = {"rollout_is_mean", "rollout_is_max", "rollout_is_eff_sample_size"} if weights is not None else set()
    if "rollout_rs" in verl_kwargs:
        expected |= {"rollout_rs_masked_fraction", "rollout_rs_seq_masked_fraction"}
    assert expected <= set(metrics)


@pytest.mark.parametrize("lag", LAGS)
@pytest.mark.parametrize("seed", SEEDS)
def test_mismatch_metrics_equal_verl(seed: int, lag: str) -> None:
    old, rollout, mask = log_probs(seed, LAGS[lag])
    ours = mismatch_metrics(old, rollout, mask)
    theirs = verl.compute_offpolicy_metrics(old, rollout, mask)
    assert_metrics_equal(ours, {f"rollout_corr/{k}": v for k, v in theirs.items()})
    assert {"kl", "k3_kl", "chi2_token"} <= set(ours)


def test_inputs_exercise_every_branch() -> None:
    """The parity inputs are not degenerate: something is truncated, rejected and kept in every case,
    and the extreme lag goes past the +-20 clamp."""
    for name, params, _ in CASES:
        for lag in ("lagged", "extreme"):
            old, rollout, mask = log_probs(0, LAGS[lag])
            weights, new_mask, metrics = ROLLOUT_CORRECTIONS.build(name, old_log_probs=old, rollout_log_probs=rollout,
                                                                   response_mask=mask, **params)
            if "rollout_rs_masked_fraction" in metrics:
                assert 0 < new_mask.sum() < mask.sum(), (name, lag)
            if weights is not None and lag == "extreme":
                assert metrics["rollout_is_ratio_fraction_high"] > 0, name
                assert (weights[mask.bool()] < params.get("threshold", 5.0)).any(), name
    old, rollout, mask = log_probs(0, LAGS["extreme"])
    assert ((old - rollout).abs() * mask).max() > 20


def test_parity_check_can_fail() -> None:
    """Formulas that are easy to get wrong give different numbers on these inputs, so the parity
    test would catch them: the sequence ratio as a mean (not a sum) of log-ratios, bounds on
    ``pi_rollout / pi_old`` taken for bounds on ``rho``, and no clamp before ``exp``."""
    old, rollout, mask = log_probs(0, LAGS["lagged"])
    log_ratio = old - rollout
    verl_weights, _, _ = verl.compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, rollout_is="sequence", rollout_is_threshold=3.0)
    mean_based = (verl.masked_mean(log_ratio, mask, axis=-1).exp().clamp(max=3.0).unsqueeze(-1) * mask)
    assert not torch.allclose(mean_based, verl_weights, rtol=1e-6, atol=1e-6)

    _, verl_mask, _ = verl.compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, rollout_is=None, rollout_rs="token_k1", rollout_rs_threshold="0.7_1.2")
    _, ours_literal, _ = ROLLOUT_CORRECTIONS.build("token_rs", old_log_probs=old, rollout_log_probs=rollout,
                                                   response_mask=mask, low=0.7, high=1.2)
    assert not torch.equal(ours_literal, verl_mask)  # "L_U" must be mapped to low=1/U, high=1/L

    old, rollout, mask = log_probs(0, LAGS["extreme"])
    verl_weights, _, _ = verl.compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, rollout_is="sequence", rollout_is_threshold=1e30)
    unclamped = verl.masked_sum(old - rollout, mask, axis=-1).exp().unsqueeze(-1) * mask
    assert not torch.allclose(unclamped, verl_weights, rtol=1e-6, atol=1e-6)


def test_identical_policies() -> None:
    """rollout == old: weights 1, nothing rejected, KL 0, effective sample size 1."""
    old, _, mask = log_probs(0, (0.0, 0.0))
    rollout = old * mask
    for name in ROLLOUT_CORRECTIONS:
        weights, new_mask, metrics = ROLLOUT_CORRECTIONS.build(name, old_log_probs=old, rollout_log_probs=rollout,
                                                               response_mask=mask)
        assert torch.equal(new_mask, mask), name
        if weights is not None:
            assert torch.equal(weights, mask.float()), name
            assert metrics["rollout_is_eff_sample_size"] == pytest.approx(1.0, abs=1e-6)
    metrics = mismatch_metrics(old, rollout, mask)
    assert metrics["kl"] == 0.0 and metrics["k3_kl"] == 0.0 and metrics["chi2_token"] == pytest.approx(0, abs=1e-6)


# -- registry and parameter errors -------------------------------------------------------------------
def test_unknown_name_lists_the_names() -> None:
    with pytest.raises(ValueError, match=r"Unknown rollout correction 'tis'.*geo_rs, geo_rs_token_tis, icepop, "
                                         r"seq_mis, seq_rs, seq_tis, token_mis, token_rs, token_tis"):
        check_rollout_correction("tis", {})


def test_unknown_parameter_lists_the_parameters() -> None:
    with pytest.raises(ValueError, match=r"'token_tis' has no parameter\(s\) cap.*threshold=2.0"):
        check_rollout_correction("token_tis", {"cap": 2.0})
    with pytest.raises(ValueError, match=r"'geo_rs' has no parameter\(s\) threshold.*low=0.999, high=1.001"):
        check_rollout_correction("geo_rs", {"threshold": 2.0})


@pytest.mark.parametrize(("name", "params", "match"), [
    ("token_tis", {"threshold": 0.0}, "threshold"),
    ("seq_tis", {"threshold": -2.0}, "threshold"),
    ("token_tis", {"threshold": "2"}, "threshold"),
    ("token_rs", {"low": 2.0, "high": 0.5}, "0 < low < high"),
    ("seq_rs", {"low": 0.0, "high": 2.0}, "0 < low < high"),
    ("geo_rs", {"low": 1.0, "high": 1.0}, "0 < low < high"),
    ("token_mis", {"high": None}, "0 < low < high"),
])
def test_bad_values_raise(name: str, params: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_rollout_correction(name, params)


def test_presets_carry_their_parameters() -> None:
    assert check_rollout_correction("icepop", {}) == {"threshold": 5.0, "low": 0.5, "high": 5.0}
    assert check_rollout_correction("icepop", {"low": 0.2}) == {"threshold": 5.0, "low": 0.2, "high": 5.0}
    assert ROLLOUT_CORRECTIONS.get("icepop") is ROLLOUT_CORRECTIONS.get("token_mis")
    registry = Registry("thing")
    registry.register("a", x=1)(lambda x: x)
    assert registry.defaults("a") == {"x": 1} and registry.build("a") == 1 and registry.build("a", x=2) == 2
    assert math.isclose(check_rollout_correction("token_tis", {"threshold": 3})["threshold"], 3.0)
