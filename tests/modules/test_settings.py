"""Settings routed to the group that declares them, and the flat signature that lists them."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import pytest

from rltrainer.modules.settings import Optimizer, Rewards, flat_signature, route_settings


@dataclass
class Clip:
    low: float = 0.2
    high: float = 0.2


@dataclass
class Coef:
    coef: float = 0.0


GROUPS = {"clip": Clip, "coef": Coef, "optional": None}


def test_each_setting_goes_to_its_group_and_presets_fill_the_rest():
    built = route_settings("Algo", {"high": 0.3}, GROUPS, defaults={"coef": 0.5})
    assert built == {"clip": Clip(high=0.3), "coef": Coef(coef=0.5)}  # no class, none given: left out
    assert route_settings("Algo", {}, GROUPS, given={"optional": "part"})["optional"] == "part"


def test_an_unknown_name_raises_a_type_error_with_the_closest():
    with pytest.raises(TypeError, match=r"Algo\(\) got an unexpected keyword argument 'hihg'\. Did you mean 'high'\? "
                                        r"Its arguments: coef, high, low, model\."):
        route_settings("Algo", {"hihg": 1.0}, GROUPS, named=["model"])
    with pytest.raises(TypeError, match="'zzz'. Its arguments"):
        route_settings("Algo", {"zzz": 1.0}, GROUPS)


def test_a_given_part_takes_no_setting_but_its_defaults():
    assert route_settings("Algo", {"high": 0.2}, GROUPS, given={"clip": Clip(high=0.9)})["clip"] == Clip(high=0.9)
    with pytest.raises(TypeError, match=r"got clip=Clip\(low=0.2, high=0.9\) and its setting\(s\) high"):
        route_settings("Algo", {"high": 0.3}, GROUPS, given={"clip": Clip(high=0.9)})


def test_the_flat_signature_spells_out_the_settings_in_order():
    def init(self, model: str, tokenizer: object, reward: object, *, steps: int = 1, **settings: float) -> None: ...

    sig = flat_signature(init, GROUPS, {"high": 0.28}, None, ["model", "tokenizer", "reward", "coef", "low"])
    assert list(sig.parameters) == ["self", "model", "tokenizer", "reward", "coef", "low", "steps", "high"]
    assert sig.parameters["high"].default == 0.28 and sig.parameters["coef"].annotation is float
    assert sig.parameters["low"].kind is inspect.Parameter.KEYWORD_ONLY
    assert sig.parameters["model"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD


def test_the_module_groups_check_their_values():
    with pytest.raises(ValueError, match="warmup"):
        Optimizer(warmup_steps=-1)
    assert Optimizer(lr_scheduler_kwargs=None).exposed()["lr_scheduler_kwargs"] == {}
    assert Rewards(reward_num_workers=2).exposed() == {"reward_weights": None, "reward_num_workers": 2,
                                                       "reward_timeout": None}
