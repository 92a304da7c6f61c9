"""Version counters of weight sync.

- :class:`ParamVersions` (a training rank's, or an in-process strategy's): one counter per
  parameter name, so a sync sends exactly the tensors an optimizer step changed.
- :class:`WeightVersions` (the controller's): the policy version (training steps taken) and the
  version each sync carried to the engine. A sync is started with a version; the engine that
  loaded it reports it as ``RolloutEngine.weight_version`` once its last bucket has loaded. That
  number is what asynchronous rollout tags its rows with (how stale the weights that sampled a
  row were: ``policy - weight_version``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

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


@dataclass
class WeightVersions:
    """The controller's counters.

    Attributes:
        policy: the version of the weights the strategy trains: training steps taken (the
            Trainer's ``global_step``; one per update of the policy, whatever its optimizer steps).
        started: the version of the last sync started (its bytes are handed off).
        loaded: the version of the last sync waited for (every replica has loaded it).
    """

    policy: int = 0
    started: int = -1
    loaded: int = -1
