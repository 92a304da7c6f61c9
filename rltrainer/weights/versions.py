"""Version counters of weight sync: every number that names a version of the policy's weights.

A version is a count of training steps: the weights after ``k`` updates of the policy are
version ``k`` (the Trainer's ``global_step``; version 0 is the initial weights).

- ``WeightSync.version`` (the controller's, kept by the engine's sync owner,
  :class:`rltrainer.weights.sync.WeightSync`): the version last pushed, the weights the strategy
  trains (the Trainer's ``global_step``); a push's default version.
- ``RolloutEngine.weight_version``: the version the engine holds, written where the engine lives by
  :func:`mark_loaded` (a rollout process once a sync's last bucket has loaded; an engine in the
  controller's process by the in-process transport). The controller's handle on remote replicas
  (``RemoteEngine``) holds the version its requests ask for: the sync owner sets it when a push starts
  and when it has loaded (a replica generates with that version or a later one).
- The batch column ``policy_version [N]``: the engine's version when a row was generated (what
  asynchronous rollout tags its rows with; how stale the weights that sampled a row were:
  ``global_step - policy_version``).
- :class:`ParamVersions` (a training rank's, or an in-process strategy's): one counter per
  parameter name, so a sync sends exactly the tensors an optimizer step changed. These count
  optimizer steps per parameter, not policy versions.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class ParamVersions:
    """One counter per parameter name, bumped when an optimizer step changes that parameter.

    ``synced`` remembers the version the engine last received, so a sync sends exactly the names
    whose counter moved since. Frozen parameters (no gradient, so never stepped) keep their
    version and are skipped after the first sync. No tensor is hashed or compared.
    """

    def __init__(self) -> None:
        self.current: dict[str, int] = {}
        self.synced: dict[str, int] = {}
        self.groups: list[list[str]] = []  # names the engine takes together (RolloutEngine.weight_groups)
        self._group_of: dict[str, int] = {}

    def set_groups(self, groups: Iterable[Iterable[str]]) -> None:
        """Names that travel together: when one changed, :meth:`changed` returns them all."""
        self.groups = [list(g) for g in groups]
        self._group_of = {name: i for i, group in enumerate(self.groups) for name in group}

    def bump(self, names: Iterable[str]) -> None:
        for name in names:
            self.current[name] = self.current.get(name, 0) + 1

    def changed(self, names: Iterable[str]) -> list[str]:
        """Names never synced, or changed since the last sync, or in a group (:meth:`set_groups`)
        with such a name; in the order of ``names``."""
        names = list(names)
        moved = {n for n in names if self.synced.get(n, -1) != self.current.get(n, 0)}
        touched = {self._group_of[n] for n in moved if n in self._group_of}
        return [n for n in names if n in moved or self._group_of.get(n, -1) in touched]

    def mark_synced(self, names: Iterable[str]) -> None:
        for name in names:
            self.synced[name] = self.current.get(name, 0)

    def forget_synced(self) -> None:
        """The engine lost its weights (new engine, restored checkpoint): send everything next time."""
        self.synced.clear()


def stepped_parameter_names(named_params: Iterable[tuple[str, torch.nn.Parameter]]) -> list[str]:
    """Parameters an optimizer step may change: trainable and holding a gradient."""
    return [n for n, p in named_params if p.requires_grad and p.grad is not None]


def mark_loaded(engine: Any, version: int) -> None:
    """The one writer of ``engine.weight_version`` where the engine lives: sync ``version`` has
    fully loaded into it (its last bucket; a sync that changed nothing still moves the version)."""
    engine.weight_version = version
