"""Settings routed to the group that declares them, by the one mapping of flat keywords."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from rltrainer.modules.settings import Optimizer, Rewards, flat_keywords, route_settings


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


def test_a_flat_keyword_is_the_field_of_the_one_group_that_declares_it():
    assert flat_keywords(GROUPS) == {"low": "clip", "high": "clip", "coef": "coef"}


def test_the_module_groups_check_their_values():
    with pytest.raises(ValueError, match="warmup"):
        Optimizer(warmup_steps=-1)
    assert Optimizer(lr_scheduler_kwargs=None).exposed()["lr_scheduler_kwargs"] == {}
    assert Rewards(reward_num_workers=2).exposed() == {"reward_weights": None, "reward_num_workers": 2,
                                                       "reward_timeout": None}
