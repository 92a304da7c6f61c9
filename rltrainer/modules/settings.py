"""A module's settings, grouped: each setting belongs to one dataclass (a part of the algorithm,
or one of the groups here) that types, documents and defaults it, once, and holds it: read it there
(``module.parts["loss"].clip_ratio_high``, ``module.optimizer_settings.lr``).

A module's signature names its own arguments and takes each group whole (``optimizer=Optimizer(lr=
1e-5)``, ``parts=[PolicyLoss(clip_ratio_high=0.28)]``: what the command line's jsonargparse reads);
``**settings`` takes the same settings flat (``GRPO(..., lr=1e-5, clip_ratio_high=0.28)``), by one
mapping, :func:`flat_keywords`: a keyword is the field of the one group that declares it.
:func:`route_settings` hands each to that group (an unknown name raises a TypeError with the
closest valid one).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rltrainer.algorithms.part import settings_of
from rltrainer.optim import adamw
from rltrainer.schedulers import build_lr_scheduler, check_lr_scheduler
from rltrainer.values import check_float, check_int


@dataclass
class Optimizer:
    """The policy's optimizer: AdamW, with a linear warm-up then an LR schedule.

    Args:
        lr, weight_decay, warmup_steps: AdamW, with a linear warm-up over ``warmup_steps`` optimizer
            steps (transformers' schedules: from 0).
        lr_scheduler_type: the LR schedule after the warm-up, a name of transformers'
            ``get_scheduler`` (as TRL's ``lr_scheduler_type``): ``"constant"`` (default),
            ``"linear"`` or ``"cosine"`` decay to 0 over the run (the Trainer's estimate of its
            optimizer steps), ``"cosine_with_min_lr"``, ...
        lr_scheduler_kwargs: that schedule's own arguments (e.g. ``{"min_lr_rate": 0.1}``).
    """

    lr: float = 1e-6
    weight_decay: float = 0.01
    warmup_steps: int = 0
    lr_scheduler_type: str = "constant"
    lr_scheduler_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.lr = check_float("lr", self.lr, above=0, meaning="the policy's learning rate")
        self.weight_decay = check_float("weight_decay", self.weight_decay, at_least=0, meaning="AdamW's")
        self.warmup_steps = check_int("warmup_steps", self.warmup_steps, at_least=0,
                                      meaning="optimizer steps of linear warm-up")
        check_lr_scheduler(self.lr_scheduler_type, self.warmup_steps)

    def build(self, params: list[torch.nn.Parameter], estimated_steps: int | None) -> dict[str, Any]:
        opt = adamw(params, lr=self.lr, weight_decay=self.weight_decay)
        sched = build_lr_scheduler(opt, self.lr_scheduler_type, self.warmup_steps, estimated_steps,
                                   dict(self.lr_scheduler_kwargs or {}))
        return {"optimizer": opt, "lr_scheduler": sched}

    def exposed(self) -> dict[str, Any]:
        return {**settings_of(self), "lr_scheduler_kwargs": dict(self.lr_scheduler_kwargs or {})}


@dataclass
class Rewards:
    """How the rule rewards (``reward_funcs``) are combined and run.

    Args:
        reward_weights: one weight per entry of ``reward_funcs`` (default 1.0 each).
        reward_num_workers: run the synchronous reward functions in this many processes (``0``: one
            after another on the controller); ``async def`` ones are always awaited concurrently.
        reward_timeout: seconds a sample's reward may take (async, or with ``reward_num_workers``);
            past it the sample scores 0 and counts in ``reward/errors``.
    """

    reward_weights: Sequence[float] | None = None
    reward_num_workers: int = 0
    reward_timeout: float | None = None

    def __post_init__(self) -> None:
        self.reward_num_workers = check_int("reward_num_workers", self.reward_num_workers, at_least=0,
                                            meaning="reward processes; 0: on the controller")
        self.reward_timeout = check_float("reward_timeout", self.reward_timeout, above=0, none="no limit",
                                          meaning="seconds a sample's reward may take")

    def exposed(self) -> dict[str, Any]:
        return settings_of(self)


def flat_keywords(groups: Mapping[str, type | None]) -> dict[str, str]:
    """The one mapping of flat keywords: each setting of each group's (or part's) dataclass, to the
    kind of the group that declares it (``{"clip_ratio_high": "loss", "lr": "optimizer", ...}``)."""
    return {f.name: kind for kind, cls in groups.items() if cls is not None for f in dataclasses.fields(cls) if f.init}


def route_settings(owner: str, settings: Mapping[str, Any], groups: Mapping[str, type | None],
                   given: Mapping[str, Any] | None = None, defaults: Mapping[str, Any] | None = None,
                   named: Sequence[str] = ()) -> dict[str, Any]:
    """One object per group: the one ``given`` (a part passed as such), or the group's class built
    from its settings (``defaults``, a preset's, under ``settings``). A group with no class and
    none given is left out. Raises a TypeError for a name no group declares (with the closest of
    the valid ones: the groups' settings and ``named``, the owner's own arguments), and for a part
    given together with one of its settings."""
    given = {k: v for k, v in (given or {}).items() if v is not None}
    owners = flat_keywords(groups)
    unknown = [name for name in settings if name not in owners]
    if unknown:
        valid = sorted(set(owners) | set(named))
        close = difflib.get_close_matches(unknown[0], valid, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise TypeError(f"{owner}() got an unexpected keyword argument {unknown[0]!r}.{hint} Its arguments: "
                        f"{', '.join(valid)}.")
    out: dict[str, Any] = {}
    for kind, cls in groups.items():
        mine = {k: v for k, v in settings.items() if owners[k] == kind}
        if kind in given:
            mine = {k: v for k, v in mine.items() if not _is_default(cls, k, v, defaults)}
            if mine:
                raise TypeError(f"{owner}() got {kind}={given[kind]!r} and its setting(s) {', '.join(mine)}: set "
                                f"them in the part ({type(given[kind]).__name__}(...)) or leave the part out.")
            out[kind] = given[kind]
        elif cls is not None:
            preset = {k: v for k, v in (defaults or {}).items() if owners.get(k) == kind}
            out[kind] = cls(**{**preset, **mine})
    return out


def _is_default(cls: type | None, name: str, value: Any, defaults: Mapping[str, Any] | None) -> bool:
    if cls is None:
        return False
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    default = (defaults or {}).get(name, field.default)
    return value is default or (type(value) is type(default) and value == default)
